"""Run examples/train_digits.py once per backend named on the command line, in one process.

``python digits_backends.py gloo,mpi -- --epochs 1`` trains with gloo, then with mpi, so one
launch (one start-up of every rank) covers both backends. Exits with the first non-zero status.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[3] / "examples" / "train_digits.py"  # from the root


def main() -> int:
    backends, rest = sys.argv[1].split(","), sys.argv[3:] if sys.argv[2:3] == ["--"] else []
    spec = importlib.util.spec_from_file_location("train_digits", SCRIPT)
    assert spec is not None and spec.loader is not None  # a file of this repository
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    for backend in backends:
        status = int(example.main(["--backend", backend, *rest]))
        if status != 0:
            return status
    return 0


if __name__ == "__main__":
    sys.exit(main())

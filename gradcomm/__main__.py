"""Command line: ``gradcomm <command>`` or ``python -m gradcomm <command>``.

Commands:
    info    environment report (launcher, ranks, backends, versions, CUDA, MPI); ``--json``.
    bench   collective sweep; forwards its arguments to ``python -m gradcomm.bench``.

Under a launcher (``mpiexec -n 2 gradcomm info``) every rank prints its own report, each text line
prefixed with ``[rank N]`` (or one JSON object per line with ``--json``); ``--rank0`` prints rank
0's only.
"""

from __future__ import annotations

import argparse
import json
import runpy
import sys
from collections.abc import Sequence

__all__ = ["main", "build_parser"]


def build_parser() -> argparse.ArgumentParser:
    """The ``gradcomm`` argument parser (one sub-parser per command)."""
    parser = argparse.ArgumentParser(
        prog="gradcomm", description="gradcomm: collectives and gradient all-reduce for PyTorch."
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="command")

    info = sub.add_parser(
        "info", help="report launcher, ranks, backends, versions, CUDA and MPI",
        description="Report what gradcomm sees here: launcher and ranks, the backend gradcomm.init "
        "would select and why, every backend's availability, versions, CUDA and CUDA-aware MPI. "
        "Builds no communicator and does not initialise MPI unless --init-mpi is given.",
    )
    info.add_argument("--json", action="store_true",
                      help="print one JSON object per rank (one line each) instead of text")
    info.add_argument("--rank0", action="store_true",
                      help="under a launcher, print only rank 0's report")
    info.add_argument("--backend", default=None,
                      help="report the selection as if gradcomm.init(backend=BACKEND) were called")
    info.add_argument("--no-mpi", dest="include_mpi", action="store_false",
                      help="do not import mpi4py (skips the MPI library version and CUDA-aware "
                      "MPI check)")
    info.add_argument("--init-mpi", action="store_true",
                      help="initialise MPI (every rank must) so the CUDA-aware check can ask the "
                      "MPI library itself (MPIX_Query_cuda_support)")

    sub.add_parser(
        "bench", help="collective benchmark sweep (python -m gradcomm.bench)", add_help=False,
        description="Forwards every argument to python -m gradcomm.bench.",
    )
    return parser


def _info(args: argparse.Namespace) -> int:
    from .info import collect_info, format_info

    report = collect_info(backend=args.backend, include_mpi=args.include_mpi,
                          init_mpi=args.init_mpi)
    launch = report["launch"]
    rank = launch.get("rank", 0)
    if args.rank0 and rank != 0:
        return 0
    if args.json:
        text = json.dumps(report, sort_keys=False)
    else:
        text = format_info(report)
        if launch.get("world_size", 1) > 1 and not args.rank0:
            text = "\n".join(f"[rank {rank}] {line}" for line in text.splitlines())
    sys.stdout.write(text + "\n")  # one write, so ranks' reports interleave less
    sys.stdout.flush()
    return 0


def _bench(argv: Sequence[str]) -> int:
    saved = sys.argv
    sys.argv = ["python -m gradcomm.bench", *argv]
    try:
        runpy.run_module("gradcomm.bench", run_name="__main__", alter_sys=True)
    except ImportError as exc:
        print(f"gradcomm bench: cannot run gradcomm.bench: {exc}", file=sys.stderr)
        return 2
    except SystemExit as exc:
        return exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    finally:
        sys.argv = saved
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``gradcomm`` command line; returns the exit status."""
    args_in = list(sys.argv[1:] if argv is None else argv)
    if args_in[:1] == ["bench"]:  # everything after "bench" belongs to gradcomm.bench
        return _bench(args_in[1:])
    args = build_parser().parse_args(args_in)
    if args.command == "info":
        return _info(args)
    raise AssertionError(f"unhandled command {args.command}")  # pragma: no cover - argparse


if __name__ == "__main__":
    sys.exit(main())

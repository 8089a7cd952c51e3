"""Rows of an all-reduce sweep, their CSV, JSON and nccl-tests-style text forms, and the
provenance every benchmark result records (:func:`run_metadata`)."""

from __future__ import annotations

import csv
import dataclasses
import datetime
import json
import math
import os
import platform
import subprocess
import sys
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = [
    "SweepRow",
    "SweepResult",
    "write_csv",
    "write_json",
    "read_json",
    "format_table",
    "run_metadata",
    "mpi_versions",
    "NOTE_ENV",
]

#: Environment variable whose value a result records as ``note`` (e.g. "machine shared with CI").
NOTE_ENV = "GRADCOMM_BENCH_NOTE"
_REPO = Path(__file__).resolve().parents[2]


@dataclass(frozen=True)
class SweepRow:
    """One message size of one backend: gradcomm's all-reduce and the raw transport's beside it.

    Times are the max over ranks of each rank's mean time per operation, in microseconds;
    bandwidths in GB/s (1e9 bytes/s) as nccl-tests defines them. ``raw_*`` fields are None when
    the raw transport was not measured (``--no-raw``, or a dtype/op it cannot reduce).

    Attributes:
        backend: gradcomm backend name (``gloo``, ``mpi``, ...).
        transport: what the raw column measured (``torch.distributed (gloo)``, ``mpi4py``).
        size: bytes each rank reduces.
        count: elements each rank reduces.
        type: dtype name (``float32``).
        redop: reduction op (``sum``, ``prod``, ``min``, ``max``, ``avg``).
        world_size: ranks in the job.
        time_us, algbw, busbw: gradcomm's all_reduce.
        raw_time_us, raw_algbw, raw_busbw: the raw transport's all-reduce.
        wrong: elements of a check all-reduce that differed from the expected value.
        collective: the collective measured (``all_reduce``, ``reduce_scatter``, ...).
    """

    backend: str
    transport: str
    size: int
    count: int
    type: str
    redop: str
    world_size: int
    time_us: float
    algbw: float
    busbw: float
    raw_time_us: float | None = None
    raw_algbw: float | None = None
    raw_busbw: float | None = None
    wrong: int = 0
    collective: str = "all_reduce"

    @property
    def overhead_us(self) -> float | None:
        """gradcomm's extra time per call over the raw transport, in microseconds."""
        return None if self.raw_time_us is None else self.time_us - self.raw_time_us

    @property
    def overhead_ratio(self) -> float | None:
        """``time / raw_time``: 1.05 means gradcomm is 5 % slower than the raw transport."""
        if self.raw_time_us is None or self.raw_time_us <= 0:
            return None
        return self.time_us / self.raw_time_us

    def as_dict(self) -> dict[str, Any]:
        """The fields plus ``overhead_us`` and ``overhead_ratio`` (JSON/CSV record)."""
        out = dataclasses.asdict(self)
        out["overhead_us"] = self.overhead_us
        out["overhead_ratio"] = self.overhead_ratio
        return out

    @classmethod
    def from_dict(cls, record: Mapping[str, Any]) -> SweepRow:
        """Inverse of :meth:`as_dict` (derived fields are ignored).

        Raises:
            ValueError: a required field is missing.
        """
        names = [f.name for f in dataclasses.fields(cls)]
        required = [f.name for f in dataclasses.fields(cls) if f.default is dataclasses.MISSING]
        missing = [n for n in required if n not in record]
        if missing:
            raise ValueError(f"sweep record lacks field(s) {', '.join(missing)}")
        return cls(**{n: record[n] for n in names if n in record})


@dataclass
class SweepResult:
    """A whole sweep: the run's settings (``meta``) and its rows in measurement order."""

    meta: dict[str, Any] = field(default_factory=dict)
    rows: list[SweepRow] = field(default_factory=list)


_FIELDS = [f.name for f in dataclasses.fields(SweepRow)] + ["overhead_us", "overhead_ratio"]


def write_csv(rows: Iterable[SweepRow], path: str | Path) -> None:
    """Write one CSV line per row (header: the :class:`SweepRow` fields and the overheads).

    Missing raw values are empty cells.
    """
    with open(path, "w", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=_FIELDS)
        writer.writeheader()
        for row in rows:
            writer.writerow({k: ("" if v is None else v) for k, v in row.as_dict().items()})


def write_json(result: SweepResult, path: str | Path) -> None:
    """Write ``{"meta": {...}, "rows": [...]}`` (rows as :meth:`SweepRow.as_dict`)."""
    doc = {"meta": result.meta, "rows": [row.as_dict() for row in result.rows]}
    Path(path).write_text(json.dumps(doc, indent=1) + "\n")


def read_json(path: str | Path) -> SweepResult:
    """Read a file written by :func:`write_json`.

    Raises:
        ValueError: the file is not a sweep result (no ``rows`` list, or a row lacks a field).
        OSError: the file cannot be read. json.JSONDecodeError (a ValueError): not JSON.
    """
    doc = json.loads(Path(path).read_text())
    if not isinstance(doc, dict) or not isinstance(doc.get("rows"), list):
        raise ValueError(f"{path} is not a gradcomm.bench JSON result (no 'rows' list)")
    return SweepResult(dict(doc.get("meta", {})), [SweepRow.from_dict(r) for r in doc["rows"]])


def _num(value: float | None, width: int, digits: int) -> str:
    if value is None or not math.isfinite(value):
        return f"{'n/a':>{width}}"
    return f"{value:>{width}.{digits}f}"


def format_table(rows: Sequence[SweepRow]) -> list[str]:
    """nccl-tests-style lines for the rows of one backend (header lines start with ``#``).

    Columns: size (B), count (elements), type, redop, then time (us), algbw and busbw (GB/s) and
    #wrong for gradcomm, the same three for the raw transport, and the overhead (us, and percent
    of the raw time).
    """
    if not rows:
        return []
    head = rows[0]
    lines = [
        f"#{'':45}{'gradcomm ' + head.backend:^32}  {'raw: ' + head.transport:^26}  "
        f"{'overhead':^16}",
        f"#{'size':>11} {'count':>13} {'type':>9} {'redop':>6} "
        f"{'time':>9} {'algbw':>7} {'busbw':>7} {'#wrong':>6}  "
        f"{'time':>9} {'algbw':>7} {'busbw':>7}  {'time':>8} {'ratio':>7}",
        f"#{'(B)':>11} {'(elements)':>13} {'':>9} {'':>6} "
        f"{'(us)':>9} {'(GB/s)':>7} {'(GB/s)':>7} {'':>6}  "
        f"{'(us)':>9} {'(GB/s)':>7} {'(GB/s)':>7}  {'(us)':>8} {'':>7}",
    ]
    for r in rows:
        lines.append(
            f" {r.size:>11} {r.count:>13} {r.type:>9} {r.redop:>6} "
            f"{_num(r.time_us, 9, 1)} {_num(r.algbw, 7, 3)} {_num(r.busbw, 7, 3)} {r.wrong:>6}  "
            f"{_num(r.raw_time_us, 9, 1)} {_num(r.raw_algbw, 7, 3)} {_num(r.raw_busbw, 7, 3)}  "
            f"{_num(r.overhead_us, 8, 1)} {_num(r.overhead_ratio, 7, 3)}"
        )
    return lines


def _git(*args: str) -> str | None:
    try:
        done = subprocess.run(["git", "-C", str(_REPO), *args], capture_output=True, text=True,
                              timeout=10, check=False)
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout.strip() if done.returncode == 0 else None


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as fh:
            for line in fh:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def mpi_versions() -> dict[str, Any]:
    """``mpi4py``'s version and, once this process imported ``mpi4py.MPI``, its library banner."""
    # Only a process that already imported mpi4py.MPI is asked for its library: importing it
    # here would initialise MPI (or, with rc.initialize off, stop a later import from doing so).
    from ..info import _dist_version

    out: dict[str, Any] = {"mpi4py": _dist_version("mpi4py"), "library": None}
    mpi = sys.modules.get("mpi4py.MPI")
    if mpi is not None:
        out["library"] = " ".join(mpi.Get_library_version().split("\n", 1)[0].split())
    return out


def run_metadata(command: Sequence[str] | None = None) -> dict[str, Any]:
    """Where and how a benchmark ran: the provenance each file in ``benchmarks/results`` records.

    Call it once at the start of a run (the tree state and load are taken then).

    Args:
        command: the command line as run (default: ``sys.argv`` after ``python``).

    Returns:
        A JSON-serialisable dict: ``command``, ``date_utc``; ``commit`` (``git rev-parse HEAD`` of
        the checkout gradcomm is imported from, None outside one) and ``dirty`` (tracked files
        differ from it; None when unknown); ``machine`` (``cpu`` model, ``cores`` as
        ``os.cpu_count()``, ``usable_cores`` of this process's affinity mask, ``host``);
        ``python``, ``torch``, ``mpi`` (``mpi4py`` version and the MPI ``library`` banner's first
        line, when this process imported ``mpi4py.MPI``), ``omp_num_threads``,
        ``loadavg_start`` (1, 5, 15 minutes) and ``note`` (the ``GRADCOMM_BENCH_NOTE``
        environment variable, e.g. what else ran on the machine).
    """
    import torch

    # Only a source checkout's own history says which code ran (not one the venv lies inside).
    commit = _git("rev-parse", "HEAD") if (_REPO / ".git").exists() else None
    status = _git("status", "--porcelain", "--untracked-files=no") if commit else None
    try:
        usable: int | None = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        usable = None
    return {
        "command": " ".join(command if command is not None else ["python", *sys.argv]),
        "date_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "commit": commit,
        "dirty": None if status is None else bool(status),
        "machine": {"cpu": _cpu_model(), "cores": os.cpu_count(), "usable_cores": usable,
                    "host": platform.node()},
        "python": platform.python_version(),
        "torch": torch.__version__,
        "mpi": mpi_versions(),
        "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
        "loadavg_start": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
        "note": os.environ.get(NOTE_ENV) or None,
    }

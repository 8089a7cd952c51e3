"""gradcomm.bench: the all-reduce sweep behind ``python -m gradcomm.bench``.

The sweep reports what nccl-tests' ``all_reduce_perf`` reports -- size (bytes), count (elements),
type, redop, time (us), algbw and busbw (GB/s, ``busbw = algbw * 2(n-1)/n``, see nccl-tests'
``doc/PERFORMANCE.md``) -- for gradcomm's ``Communicator.all_reduce``, with the raw transport
(``torch.distributed.all_reduce`` for gloo, mpi4py's ``Allreduce`` for mpi) measured beside it so
gradcomm's own overhead is a ratio. Results go to the terminal (rank 0), JSON, CSV and a plot.
:func:`run_metadata` is the provenance (commit, machine, versions) every benchmark result records.
"""

from .metrics import algbw, busbw, busbw_factor, parse_dtype, parse_size, size_sweep
from .plot import plot_busbw
from .results import (
    SweepResult,
    SweepRow,
    format_table,
    read_json,
    run_metadata,
    write_csv,
    write_json,
)
from .sweep import (
    MPIRaw,
    RawTransport,
    TorchDistRaw,
    make_raw_transport,
    raw_transport_unavailable,
    run_sweep,
)

__all__ = [
    "algbw",
    "busbw",
    "busbw_factor",
    "parse_size",
    "parse_dtype",
    "size_sweep",
    "SweepRow",
    "SweepResult",
    "format_table",
    "read_json",
    "write_csv",
    "write_json",
    "run_metadata",
    "plot_busbw",
    "RawTransport",
    "TorchDistRaw",
    "MPIRaw",
    "make_raw_transport",
    "raw_transport_unavailable",
    "run_sweep",
]

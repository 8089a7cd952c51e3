"""Per-call cost of ``comm.all_reduce`` on a small tensor against the raw transport, call by call.

``python -m gradcomm.bench`` times rounds of many calls of one kind, so slow drift of a shared
machine lands on whichever kind ran then. This script alternates the kinds call by call (in an
order reversed every round) on the *same* transport object, so drift cancels, and reports the
median over calls of the max over ranks. Kinds:

* gloo: ``raw`` = ``ProcessGroupGloo.allreduce([t], opts).wait(timeout)`` on the communicator's
  own process group; ``work`` = the same wrapped in gradcomm's ``Work`` (what the backend's
  ``_all_reduce`` returns); ``comm`` = ``comm.all_reduce(t)``.
* mpi: ``raw`` = mpi4py ``Iallreduce`` + ``Wait`` on a ``Dup`` of the communicator's ``MPI.Comm``;
  ``comm`` = ``comm.all_reduce(t)``.

Run: ``mpiexec -n 2 python benchmarks/call_overhead.py --backend gloo --bytes 8 --calls 2000``
(``--json FILE`` keeps the numbers; ``python benchmarks/report.py FILE`` prints them).
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

import argparse
import datetime
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch


def interleaved_times(world: Any, kinds: dict[str, Callable[[], object]], calls: int, *,
                      warmup: int) -> dict[str, dict[str, float]]:
    """Time each of ``kinds`` ``calls`` times, alternating them call by call in an order reversed
    every round (after ``warmup`` rounds); call on every rank of ``world`` (an ``MPI.Comm``).

    Returns, on every rank, per kind the median and 25th percentile over calls of the slowest
    rank's time, in microseconds (``{"median_us": ..., "p25_us": ...}``).
    """
    names = list(kinds)
    times: dict[str, list[float]] = {k: [] for k in names}
    clock = time.perf_counter
    for _ in range(warmup):
        for k in names:
            kinds[k]()
    for r in range(calls):
        for k in (names if r % 2 else names[::-1]):
            t0 = clock()
            kinds[k]()
            times[k].append(clock() - t0)
    out = {}
    for k, v in times.items():
        slowest = [max(x) * 1e6 for x in zip(*world.allgather(v), strict=True)]
        out[k] = {"median_us": statistics.median(slowest),
                  "p25_us": statistics.quantiles(slowest, n=4)[0]}
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--backend", choices=("gloo", "mpi"), default="gloo")
    p.add_argument("--bytes", type=int, default=8, help="message size in bytes (float32 data)")
    p.add_argument("--calls", type=int, default=2000, help="calls of each kind (default 2000)")
    p.add_argument("--json", type=Path, help="also write the numbers here (benchmarks/report.py "
                   "prints them as a table)")
    args = p.parse_args()
    if args.bytes < 4 or args.bytes % 4 or args.calls < 10:
        p.error("need --bytes >= 4, a multiple of 4 (float32 data), and --calls >= 10")
    from mpi4py import MPI

    import gradcomm
    from gradcomm.bench.results import run_metadata

    world = MPI.COMM_WORLD
    if world.Get_size() < 2:  # one process, or torchrun (whose ranks are MPI singletons)
        p.error("run under mpiexec with 2 or more ranks, e.g. "
                "mpiexec -n 2 python benchmarks/call_overhead.py")
    comm = gradcomm.init(args.backend, timeout=60)
    t = torch.zeros(args.bytes // 4)
    kinds: dict[str, Callable[[], object]] = {"comm": lambda: comm.all_reduce(t)}
    if args.backend == "gloo":
        import torch.distributed as dist

        from gradcomm.comm.backends.torch_dist import TorchWork

        pg = comm.process_group  # type: ignore[attr-defined]
        opts = dist.AllreduceOptions()
        opts.reduceOp = dist.ReduceOp(dist.ReduceOp.SUM)
        td = datetime.timedelta(seconds=60)
        kinds["raw"] = lambda: pg.allreduce([t], opts).wait(td)
        kinds["work"] = lambda: TorchWork(pg.allreduce([t], opts), "x", 60.0).wait()
    else:
        raw = world.Dup()
        buf = t.numpy()
        kinds["raw"] = lambda: raw.Iallreduce(MPI.IN_PLACE, buf, op=MPI.SUM).Wait()
    meta = run_metadata(["mpiexec", "-n", str(world.Get_size()), "python",
                         "benchmarks/call_overhead.py", *sys.argv[1:]])
    kinds_us = interleaved_times(world, kinds, args.calls, warmup=20)
    if world.Get_rank() == 0:
        print(f"{args.backend}, {world.Get_size()} ranks, {args.bytes} B, {args.calls} calls each, "
              "interleaved; median / 25th percentile of the max over ranks, us")
        for k, row in kinds_us.items():
            print(f"  {k:<5} {row['median_us']:8.1f} {row['p25_us']:8.1f}")
        overhead = kinds_us["comm"]["median_us"] - kinds_us["raw"]["median_us"]
        print(f"  comm - raw: {overhead:+.1f} us")
        if args.json is not None:
            meta.update({"tool": "benchmarks/call_overhead.py", "world_size": world.Get_size(),
                         "backend": args.backend, "bytes": args.bytes, "calls": args.calls,
                         "time": "median over calls of the max over ranks",
                         "loadavg_end": list(os.getloadavg())})
            doc = {"meta": meta, "kinds": kinds_us, "overhead_us": overhead,
                   "overhead_ratio": kinds_us["comm"]["median_us"] / kinds_us["raw"]["median_us"]}
            args.json.write_text(json.dumps(doc, indent=1) + "\n")
            print(f"wrote {args.json}")
    comm.close()


if __name__ == "__main__":
    main()

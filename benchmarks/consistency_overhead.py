"""Per-call cost of the cross-rank collective check (gradcomm.comm.consistency), call by call.

For each backend (gloo and mpi, both built in one ``mpiexec`` job) and message size (8 B and
1 MiB of float32 by default) this times, interleaved call by call in an order reversed every
round (so drift of a shared machine cancels):

* ``all_reduce off`` / ``all_reduce detail``: ``comm.all_reduce(t)`` with ``comm.debug`` off
  and ``"detail"`` (``GRADCOMM_DEBUG=detail``): the debug mode's cost on the hottest call;
* ``all_gather off`` / ``all_gather detail``: ``comm.all_gather(out, t)`` the same way, for a
  collective whose size mismatch the check turns from an abort or garbage into an error.

Times are the median (and 25th percentile) over calls of the max over ranks; ratios are of
the medians, taken within the run.

Run: ``mpiexec -n 2 python benchmarks/consistency_overhead.py --json
benchmarks/results/consistency_overhead.json`` (``python benchmarks/report.py FILE`` prints it).
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

import argparse
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from call_overhead import interleaved_times  # this folder: the same call-by-call timer


def _kinds(comm: Any, nbytes: int) -> dict[str, Callable[[], object]]:
    t = torch.zeros(nbytes // 4)
    out = torch.zeros(comm.world_size * t.numel())

    def call(level: str, fn: Callable[[], object]) -> Callable[[], object]:
        def timed() -> object:
            comm.debug = level  # a setter: two stores, outside the collective's time scale
            return fn()
        return timed

    def reduce() -> object:
        return comm.all_reduce(t)

    def gather() -> object:
        return comm.all_gather(out, t)

    comm.debug = "off"
    return {f"{name} {level}": call(level, fn)
            for name, fn in (("all_reduce", reduce), ("all_gather", gather))
            for level in ("off", "detail")}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", type=int, nargs="+", default=[8, 2**20],
                   help="message sizes in bytes (float32 data; default 8 and 1 MiB)")
    p.add_argument("--calls", type=int, default=300, help="calls of each kind per size")
    p.add_argument("--json", type=Path, help="also write the numbers here")
    args = p.parse_args()
    if any(s < 4 or s % 4 for s in args.sizes) or args.calls < 10:
        p.error("need sizes >= 4 and a multiple of 4 (float32 data), and --calls >= 10")
    from mpi4py import MPI

    import gradcomm
    from gradcomm.bench.results import run_metadata

    world = MPI.COMM_WORLD
    if world.Get_size() < 2:
        p.error("run under mpiexec with 2 or more ranks, e.g. "
                "mpiexec -n 2 python benchmarks/consistency_overhead.py")
    meta = run_metadata(["mpiexec", "-n", str(world.Get_size()), "python",
                         "benchmarks/consistency_overhead.py", *sys.argv[1:]])
    rows = []
    for backend in ("gloo", "mpi"):
        comm = gradcomm.init(backend, timeout=60)
        for size in args.sizes:
            kinds = interleaved_times(world, _kinds(comm, size), args.calls if size < 2**16
                                      else max(10, args.calls // 3), warmup=10)
            us = {k: v["median_us"] for k, v in kinds.items()}
            rows.append({"backend": backend, "bytes": size, "kinds": kinds,
                         "detail_ratio": us["all_reduce detail"] / us["all_reduce off"],
                         "detail_us": us["all_reduce detail"] - us["all_reduce off"],
                         "gather_detail_ratio": us["all_gather detail"] / us["all_gather off"],
                         "gather_detail_us": us["all_gather detail"] - us["all_gather off"]})
        comm.close()
    if world.Get_rank() == 0:
        for row in rows:
            print(f"{row['backend']:<5} {row['bytes']:>8} B  "
                  + "  ".join(f"{k} {v['median_us']:8.1f}" for k, v in row["kinds"].items())
                  + f"  all_reduce detail x{row['detail_ratio']:.2f}, all_gather detail "
                  f"x{row['gather_detail_ratio']:.2f}")
        if args.json is not None:
            meta.update({"tool": "benchmarks/consistency_overhead.py",
                         "world_size": world.Get_size(), "calls": args.calls,
                         "time": "median (p25) over calls of the max over ranks, us",
                         "loadavg_end": list(os.getloadavg())})
            args.json.write_text(json.dumps({"meta": meta, "check_rows": rows}, indent=1) + "\n")
            print(f"wrote {args.json}")


if __name__ == "__main__":
    main()

"""Per-call cost of gradcomm's blocking collectives against the transport's own blocking call.

``python -m gradcomm.bench`` times rounds of many calls of one kind, so slow drift of a shared
machine lands on whichever kind ran then. This script alternates the kinds call by call (in an
order reversed every round) on the *same* buffers, so drift cancels, and reports the median over
calls of the max over ranks, per collective and message size:

* mpi: ``comm`` = gradcomm's blocking call (checks, the progress thread, MPI's blocking call);
  ``mpi4py`` = mpi4py's blocking call on a ``Dup`` of the world communicator (``Allreduce``,
  ``Allgather``, ``Reduce_scatter_block``, ``Bcast``, ...): what a user of mpi4py gets;
  ``handoff`` = that same mpi4py call run on a plain Python worker thread while the caller waits
  on a lock, with no code of gradcomm's: the bare hand-over that a layer written in Python pays
  to keep MPI's blocking calls off the caller's thread (as it must to time out and answer Ctrl-C)
  without polling. ``floor`` = handoff / mpi4py.
* gloo (all_reduce only): ``comm`` = ``comm.all_reduce(t)``; ``raw`` =
  ``ProcessGroupGloo.allreduce([t], opts).wait(timeout)`` on the communicator's own group.

Sizes are the larger buffer of one rank (the input of reduce_scatter and scatter's root, the output
of all_gather and gather's root, the buffer of the others), float32, rounded down to a whole
number of elements per rank. The number of calls is set from timed rounds before the measurement
so that each (op, size) takes about ``--seconds`` (:func:`calls_within`).

Run: ``mpiexec -n 2 python benchmarks/call_overhead.py --backend mpi`` (``--json FILE`` keeps the
numbers; ``python benchmarks/report.py FILE`` prints them). Targets (issue 33, 2 ranks, mpi):
``comm / mpi4py`` at most 1.05 at 4-16 MiB and 1.10 at 1 MiB, at most +30 us at 64 KiB.
docs/performance.md says what the floor shows and where it does not bound ``comm``.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

import _thread
import argparse
import datetime
import json
import queue
import statistics
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch


def calls_within(world: Any, kinds: dict[str, Callable[[], object]], seconds: float) -> int:
    """How many calls of each of ``kinds`` fit in about ``seconds`` (at least 30).

    After two untimed rounds of one call each (first calls pay for connections and page
    faults), three timed rounds give a first estimate, and rounds filling about a tenth of
    ``seconds`` (3 to 1000) the one used. The slowest rank's time decides each step, so every
    rank makes the same calls (call on every rank of ``world``, an ``MPI.Comm``)."""
    from mpi4py import MPI

    def round_s(count: int) -> float:
        t0 = time.perf_counter()
        for _ in range(count):
            for call in kinds.values():
                call()
        return float(world.allreduce((time.perf_counter() - t0) / count, op=MPI.MAX))

    round_s(2)
    first = round_s(3)
    return max(30, int(seconds / round_s(min(1000, max(3, int(seconds / 10 / first))))))


def interleaved_times(world: Any, kinds: dict[str, Callable[[], object]], calls: int, *,
                      warmup: int, block: int = 1) -> dict[str, dict[str, float]]:
    """Time each of ``kinds`` at least ``calls`` times, alternating them in turns of ``block``
    calls (1: call by call) in an order reversed every round, after ``warmup`` untimed rounds of
    one call each; call on every rank of ``world`` (an ``MPI.Comm``).

    Returns, on every rank, per kind the median and 25th percentile over calls of the slowest
    rank's time in microseconds, and the number of calls timed (``ceil(calls / block) * block``):
    ``{"median_us": ..., "p25_us": ..., "calls": ...}``.
    """
    names = list(kinds)
    times: dict[str, list[float]] = {k: [] for k in names}
    clock = time.perf_counter
    for _ in range(warmup):
        for k in names:
            kinds[k]()
    for r in range(-(-calls // block)):
        for k in (names if r % 2 else names[::-1]):
            call = kinds[k]
            for _ in range(block):
                t0 = clock()
                call()
                times[k].append(clock() - t0)
    out = {}
    for k, v in times.items():
        slowest = [max(x) * 1e6 for x in zip(*world.allgather(v), strict=True)]
        out[k] = {"median_us": statistics.median(slowest),
                  "p25_us": statistics.quantiles(slowest, n=4)[0], "calls": len(slowest)}
    return out


#: The collectives ``--op`` takes on mpi (gloo: all_reduce only).
OPS = ("all_reduce", "all_gather", "reduce_scatter", "broadcast", "all_to_all", "reduce",
       "gather", "scatter")
#: The sizes the issue's targets name, bytes.
SIZES = (64 << 10, 1 << 20, 4 << 20, 16 << 20)


class HandOff:
    """A worker thread that runs the calls given to :meth:`run` while the caller waits on a lock
    (no polling): the bare hand-over, with nothing else around it."""

    def __init__(self) -> None:
        self._queue: queue.SimpleQueue[tuple[Callable[[], object], Any]] = queue.SimpleQueue()
        threading.Thread(target=self._serve, name="handoff", daemon=True).start()

    def _serve(self) -> None:
        while True:
            call, done = self._queue.get()
            call()
            done.release()

    def run(self, call: Callable[[], object]) -> None:
        done = _thread.allocate_lock()
        done.acquire()
        self._queue.put((call, done))
        done.acquire()


def mpi_kinds(comm: Any, raw: Any, op: str, nbytes: int,
              handoff: HandOff) -> dict[str, Callable[[], object]]:
    """gradcomm's (``comm``) and mpi4py's (``mpi4py``) blocking call of ``op`` on the same
    float32 buffers of ``nbytes`` (the larger buffer of one rank), and mpi4py's run through
    ``handoff`` (``handoff``)."""
    from mpi4py import MPI

    n, root = comm.world_size, comm.rank == 0
    count = measured_bytes(nbytes, n) // 4
    chunk = count // n
    if op in ("all_reduce", "broadcast", "reduce", "all_to_all"):
        big = torch.zeros(count)
        other = torch.zeros(count) if op == "all_to_all" else big
    else:
        big, other = torch.zeros(chunk * n), torch.zeros(chunk)
    b, o = big.numpy(), other.numpy()
    rb = b if root else None
    ip: Any = MPI.IN_PLACE
    s = MPI.SUM
    calls: dict[str, tuple[Callable[[], object], Callable[[], object]]] = {
        "all_reduce": (lambda: comm.all_reduce(big), lambda: raw.Allreduce(ip, b, s)),
        "reduce_scatter": (lambda: comm.reduce_scatter(other, big),
                           lambda: raw.Reduce_scatter_block(b, o, s)),
        "all_gather": (lambda: comm.all_gather(big, other), lambda: raw.Allgather(o, b)),
        "all_to_all": (lambda: comm.all_to_all(big, other), lambda: raw.Alltoall(o, b)),
        "broadcast": (lambda: comm.broadcast(big, 0), lambda: raw.Bcast(b, 0)),
        "reduce": (lambda: comm.reduce(big, 0), lambda: raw.Reduce(ip if root else b, rb, s, 0)),
        "gather": (lambda: comm.gather(big if root else None, other, 0),
                   lambda: raw.Gather(o, rb, 0)),
        "scatter": (lambda: comm.scatter(other, big if root else None, 0),
                    lambda: raw.Scatter(rb, o, 0)),
    }
    ours, theirs = calls[op]
    return {"comm": ours, "mpi4py": theirs, "handoff": lambda: handoff.run(theirs)}


def gloo_kinds(comm: Any, nbytes: int) -> dict[str, Callable[[], object]]:
    """gradcomm's all_reduce and its own process group's, on one float32 buffer."""
    import torch.distributed as dist

    t = torch.zeros(measured_bytes(nbytes, comm.world_size) // 4)
    pg = comm.process_group
    opts = dist.AllreduceOptions()
    opts.reduceOp = dist.ReduceOp(dist.ReduceOp.SUM)
    td = datetime.timedelta(seconds=60)
    return {"comm": lambda: comm.all_reduce(t), "raw": lambda: pg.allreduce([t], opts).wait(td)}


def measured_bytes(nbytes: int, world_size: int) -> int:
    """The larger buffer's size that ``--bytes nbytes`` gives: whole float32 elements per rank."""
    return nbytes // 4 // world_size * world_size * 4


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--backend", choices=("gloo", "mpi"), default="mpi")
    p.add_argument("--op", choices=(*OPS, "all"), nargs="+",
                   help="the collectives (mpi; default the four of the targets; all: every one); "
                   "gloo measures all_reduce only")
    p.add_argument("--bytes", type=int, nargs="+", default=list(SIZES),
                   help="message sizes in bytes (float32 data; default 64 KiB, 1, 4, 16 MiB)")
    p.add_argument("--seconds", type=float, default=3.0,
                   help="about how long each (op, size) is timed, at most 3600; sets the number "
                   "of calls (default 3, at least 30 calls of each kind)")
    p.add_argument("--block", type=int, default=1,
                   help="calls of one kind per turn (default 1: call by call; with N, MPI's state "
                   "stays with one thread for N calls, as it does in use; each kind then makes "
                   "at least N calls)")
    p.add_argument("--json", type=Path, help="also write the numbers here (benchmarks/report.py "
                   "prints them as a table)")
    args = p.parse_args()
    if any(b < 4 or b % 4 for b in args.bytes):
        p.error("every --bytes must be a positive multiple of 4 (float32 data)")
    if not 0 < args.seconds <= 3600:  # also refuses nan
        p.error("--seconds must be > 0 and at most 3600")
    if args.block < 1:
        p.error("--block must be >= 1")
    if args.backend == "gloo" and args.op is not None and set(args.op) != {"all_reduce"}:
        p.error("on gloo only all_reduce is measured: leave out --op")
    if args.json is not None and not args.json.parent.is_dir():
        p.error(f"--json {args.json}: no folder {args.json.parent} to write it in")
    ops = (("all_reduce",) if args.backend == "gloo" else OPS[:4] if args.op is None
           else OPS if "all" in args.op else tuple(dict.fromkeys(args.op)))
    from mpi4py import MPI

    import gradcomm
    from gradcomm.bench.results import run_metadata

    world = MPI.COMM_WORLD
    n = world.Get_size()
    if n < 2:  # one process, or torchrun (whose ranks are MPI singletons)
        p.error("run under mpiexec with 2 or more ranks, e.g. "
                "mpiexec -n 2 python benchmarks/call_overhead.py")
    if any(b < 4 * n for b in args.bytes):
        p.error(f"every --bytes must be >= {4 * n}: a float32 element per rank")
    comm = gradcomm.init(args.backend, timeout=60)
    meta = run_metadata(["mpiexec", "-n", str(n), "python", "benchmarks/call_overhead.py",
                         *sys.argv[1:]])
    raw = world.Dup() if args.backend == "mpi" else None
    handoff = HandOff() if raw is not None else None
    baseline = "mpi4py" if args.backend == "mpi" else "raw"
    rows = []
    if world.Get_rank() == 0:
        turns = "call by call" if args.block == 1 else f"in turns of {args.block} calls"
        print(f"{args.backend}, {n} ranks, interleaved {turns}; median over calls of the "
              f"max over ranks\n{'op':<15} {'bytes':>9} {'calls':>6} {'comm us':>9} "
              f"{baseline + ' us':>10} {'diff us':>8} {'ratio':>6}"
              + ("" if handoff is None else f" {'handoff us':>10} {'floor':>6}"), flush=True)
    for op in ops:
        for nbytes in args.bytes:
            kinds = (gloo_kinds(comm, nbytes) if raw is None or handoff is None
                     else mpi_kinds(comm, raw, op, nbytes, handoff))
            calls = calls_within(world, kinds, args.seconds)
            times = interleaved_times(world, kinds, calls, warmup=max(3, calls // 20),
                                      block=args.block)
            us = {k: v["median_us"] for k, v in times.items()}
            calls = int(times["comm"]["calls"])
            row = {"op": op, "bytes": measured_bytes(nbytes, n), "calls": calls,
                   "comm_us": us["comm"], "baseline_us": us[baseline],
                   "diff_us": us["comm"] - us[baseline], "ratio": us["comm"] / us[baseline]}
            if "handoff" in us:
                row.update(handoff_us=us["handoff"], floor=us["handoff"] / us[baseline])
            rows.append(row)
            if world.Get_rank() == 0:
                floor = ("" if "handoff" not in us else
                         f" {row['handoff_us']:>10.1f} {row['floor']:>6.3f}")
                print(f"{op:<15} {row['bytes']:>9} {calls:>6} {row['comm_us']:>9.1f} "
                      f"{row['baseline_us']:>10.1f} {row['diff_us']:>+8.1f} "
                      f"{row['ratio']:>6.3f}{floor}", flush=True)
    if args.json is not None and world.Get_rank() == 0:
        meta.update({"tool": "benchmarks/call_overhead.py", "world_size": n,
                     "backend": args.backend, "baseline": baseline, "block": args.block,
                     "time": "median over calls of the max over ranks",
                     "loadavg_end": list(os.getloadavg())})
        args.json.write_text(json.dumps({"meta": meta, "overhead": rows}, indent=1) + "\n")
        print(f"wrote {args.json}")
    comm.close()


if __name__ == "__main__":
    main()

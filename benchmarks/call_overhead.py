"""Per-call cost of a gradcomm collective against the raw transport, call by call.

``python -m gradcomm.bench`` times rounds of many calls of one kind, so slow drift of a shared
machine lands on whichever kind ran then. This script alternates the kinds call by call (in an
order reversed every round) on the *same* buffers and transport, so drift cancels, and reports the
median over calls of the max over ranks. Kinds:

* gloo (all_reduce only): ``raw`` = ``ProcessGroupGloo.allreduce([t], opts).wait(timeout)`` on the
  communicator's own process group; ``work`` = the same wrapped in gradcomm's ``Work`` (what the
  backend's ``_all_reduce`` returns); ``comm`` = ``comm.all_reduce(t)``.
* mpi, every collective of ``--op``: ``comm`` = gradcomm's blocking call; ``raw`` = the
  non-blocking MPI call gradcomm posts (``Iallreduce``, ``Ireduce_scatter_block``, ``Iallgather``,
  ``Ialltoall``, ``Ibcast``, ``Ireduce``, ``Igather``, ``Iscatter``) on a ``Dup`` of the world
  communicator, polled with ``Test()`` until complete as gradcomm's wait polls it: ``comm / raw``
  is the cost of gradcomm's layer alone; ``wait`` = the same call + ``Wait()`` (MPICH's, which
  for messages of a few MiB was at times slower than polling here); ``blocking`` = the blocking
  call ``python -m gradcomm.bench`` takes as its raw column (``Allreduce``, ...), for which MPICH
  may pick another algorithm; ``floor`` = ``raw`` after :func:`probe` of each tensor, the fewest
  torch reads with which any Python layer can validate the call: ``floor / raw`` is the least
  overhead such a layer can have. ``--op sendrecv`` is the bench's ring (send to ``rank + 1``,
  receive from ``rank - 1``): gradcomm's ``batch_isend_irecv`` of two ``P2POp`` and their waits;
  ``raw`` ``Isend`` and ``Irecv`` polled with ``Testall``; ``blocking`` ``Sendrecv``.

Sizes follow the bench: ``--bytes`` is the larger buffer of one rank (the input of reduce_scatter
and scatter's root, the output of all_gather and gather's root, the buffer of the others), float32.

Run: ``mpiexec -n 2 python benchmarks/call_overhead.py --backend mpi --op all --bytes 1048576``
(``--json FILE``, for one ``--op``, keeps the numbers; ``python benchmarks/report.py FILE``
prints them).
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


#: The collectives ``--op`` takes on mpi (gloo: all_reduce only); sendrecv is the bench's ring.
OPS = ("all_reduce", "reduce_scatter", "all_gather", "all_to_all", "broadcast", "reduce",
       "gather", "scatter", "sendrecv")

_PROBED_DTYPES = {torch.float32: "float32"}


def probe(t: torch.Tensor) -> object:
    """The reads of ``t`` that any Python layer must make before handing it to MPI: its class
    (a subclass may answer the rest its own way), dtype (looked up in a dict), device,
    layout, contiguity, negative bit, size and address -- one torch call each, no more."""
    return (t.__class__ is torch.Tensor and _PROBED_DTYPES.get(t.dtype) is not None
            and t.is_cpu and t.layout is torch.strided and t.is_contiguous()
            and not t.is_neg() and t.nbytes and t.data_ptr())


def mpi_kinds(comm: Any, raw: Any, op: str, nbytes: int) -> dict[str, Callable[[], object]]:
    """The ``comm``, ``raw`` (non-blocking, polled with Test), ``floor``, ``wait`` (non-blocking
    + Wait) and ``blocking`` calls of ``op`` on float32 buffers of ``nbytes`` (the larger buffer
    of one rank), on gradcomm's ``comm`` and the ``MPI.Comm`` ``raw``."""
    from mpi4py import MPI

    from gradcomm.comm import P2POp

    n, root = comm.world_size, comm.rank == 0
    count = nbytes // 4
    chunk = count // n
    if op in ("all_reduce", "broadcast", "reduce", "all_to_all", "sendrecv"):
        big = torch.zeros(count)
        other = torch.zeros(count) if op in ("all_to_all", "sendrecv") else big
    else:
        big, other = torch.zeros(chunk * n), torch.zeros(chunk)
    b, o = big.numpy(), other.numpy()
    rb = b if root else None
    ip: Any = MPI.IN_PLACE
    s = MPI.SUM
    calls: dict[str, tuple[Callable[[], object], Callable[[], Any], Callable[[], object]]] = {
        "all_reduce": (lambda: comm.all_reduce(big), lambda: raw.Iallreduce(ip, b, s),
                       lambda: raw.Allreduce(ip, b, s)),
        "reduce_scatter": (lambda: comm.reduce_scatter(other, big),
                           lambda: raw.Ireduce_scatter_block(b, o, s),
                           lambda: raw.Reduce_scatter_block(b, o, s)),
        "all_gather": (lambda: comm.all_gather(big, other), lambda: raw.Iallgather(o, b),
                       lambda: raw.Allgather(o, b)),
        "all_to_all": (lambda: comm.all_to_all(big, other), lambda: raw.Ialltoall(o, b),
                       lambda: raw.Alltoall(o, b)),
        "broadcast": (lambda: comm.broadcast(big, 0), lambda: raw.Ibcast(b, 0),
                      lambda: raw.Bcast(b, 0)),
        "reduce": (lambda: comm.reduce(big, 0), lambda: raw.Ireduce(ip if root else b, rb, s, 0),
                   lambda: raw.Reduce(ip if root else b, rb, s, 0)),
        "gather": (lambda: comm.gather(big if root else None, other, 0),
                   lambda: raw.Igather(o, rb, 0), lambda: raw.Gather(o, rb, 0)),
        "scatter": (lambda: comm.scatter(other, big if root else None, 0),
                    lambda: raw.Iscatter(rb, o, 0), lambda: raw.Scatter(rb, o, 0)),
    }
    right, left = (comm.rank + 1) % n, (comm.rank - 1) % n

    def ring() -> list[Any]:
        return [raw.Isend(b, right), raw.Irecv(o, left)]

    def exchange() -> None:  # as torch's docs wait on a batch's works
        for work in comm.batch_isend_irecv([P2POp("send", big, right),
                                            P2POp("recv", other, left)]):
            work.wait()

    calls["sendrecv"] = (exchange, ring, lambda: raw.Sendrecv(b, right, recvbuf=o, source=left))
    ours, post, blocking = calls[op]
    if other is big:
        probed: tuple[torch.Tensor, ...] = (big,)
    elif root or op not in ("gather", "scatter"):
        probed = (big, other)
    else:
        probed = (other,)  # the root's buffer is None elsewhere

    def polled() -> None:
        request = post()
        if isinstance(request, list):  # sendrecv's pair
            while not MPI.Request.Testall(request):
                pass
            return
        while not request.Test():  # as gradcomm's wait polls, without its layer
            pass

    def floor() -> None:
        for t in probed:
            probe(t)
        polled()

    def waited() -> None:
        request = post()
        if isinstance(request, list):
            MPI.Request.Waitall(request)
        else:
            request.Wait()

    return {"comm": ours, "raw": polled, "floor": floor, "wait": waited, "blocking": blocking}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--backend", choices=("gloo", "mpi"), default="gloo")
    p.add_argument("--op", choices=(*OPS, "all"), default="all_reduce",
                   help="the collective (mpi: any, or all of them in turn; gloo: all_reduce)")
    p.add_argument("--bytes", type=int, default=8, help="message size in bytes (float32 data)")
    p.add_argument("--calls", type=int, default=2000, help="calls of each kind (default 2000)")
    p.add_argument("--json", type=Path, help="also write the numbers here (benchmarks/report.py "
                   "prints them as a table); one --op only")
    args = p.parse_args()
    if args.bytes < 4 or args.bytes % 4 or args.calls < 10:
        p.error("need --bytes >= 4, a multiple of 4 (float32 data), and --calls >= 10")
    if args.backend == "gloo" and args.op != "all_reduce":
        p.error("on gloo only --op all_reduce is measured")
    if args.json is not None and args.op == "all":
        p.error("--json takes the numbers of one --op")
    from mpi4py import MPI

    import gradcomm
    from gradcomm.bench.results import run_metadata

    world = MPI.COMM_WORLD
    if world.Get_size() < 2:  # one process, or torchrun (whose ranks are MPI singletons)
        p.error("run under mpiexec with 2 or more ranks, e.g. "
                "mpiexec -n 2 python benchmarks/call_overhead.py")
    if args.bytes < 4 * world.Get_size():
        p.error(f"need --bytes >= {4 * world.Get_size()}: a float32 element per rank")
    comm = gradcomm.init(args.backend, timeout=60)
    meta = run_metadata(["mpiexec", "-n", str(world.Get_size()), "python",
                         "benchmarks/call_overhead.py", *sys.argv[1:]])
    if args.backend == "gloo":
        import torch.distributed as dist

        from gradcomm.comm.backends.torch_dist import TorchWork

        t = torch.zeros(args.bytes // 4)
        pg = comm.process_group  # type: ignore[attr-defined]
        opts = dist.AllreduceOptions()
        opts.reduceOp = dist.ReduceOp(dist.ReduceOp.SUM)
        td = datetime.timedelta(seconds=60)
        runs = {"all_reduce": {
            "comm": lambda: comm.all_reduce(t),
            "raw": lambda: pg.allreduce([t], opts).wait(td),
            "work": lambda: TorchWork(pg.allreduce([t], opts), "x", 60.0).wait(),
        }}
    else:
        raw = world.Dup()
        runs = {op: mpi_kinds(comm, raw, op, args.bytes)
                for op in (OPS if args.op == "all" else (args.op,))}
    for op, kinds in runs.items():
        kinds_us = interleaved_times(world, kinds, args.calls, warmup=20)
        if world.Get_rank() != 0:
            continue
        print(f"{args.backend} {op}, {world.Get_size()} ranks, {args.bytes} B, {args.calls} calls "
              "each, interleaved; median / 25th percentile of the max over ranks, us")
        for k, row in kinds_us.items():
            print(f"  {k:<8} {row['median_us']:8.1f} {row['p25_us']:8.1f}")
        overhead = kinds_us["comm"]["median_us"] - kinds_us["raw"]["median_us"]
        ratio = kinds_us["comm"]["median_us"] / kinds_us["raw"]["median_us"]
        floor = kinds_us["floor"]["median_us"] / kinds_us["raw"]["median_us"] if (
            "floor" in kinds_us) else None
        print(f"  comm - raw: {overhead:+.1f} us, comm / raw: {ratio:.3f}"
              + ("" if floor is None else f", floor / raw: {floor:.3f}"), flush=True)
        if args.json is not None:
            meta.update({"tool": "benchmarks/call_overhead.py", "world_size": world.Get_size(),
                         "backend": args.backend, "op": op, "bytes": args.bytes,
                         "calls": args.calls, "time": "median over calls of the max over ranks",
                         "loadavg_end": list(os.getloadavg())})
            doc = {"meta": meta, "kinds": kinds_us, "overhead_us": overhead,
                   "overhead_ratio": ratio, "floor_ratio": floor}
            args.json.write_text(json.dumps(doc, indent=1) + "\n")
            print(f"wrote {args.json}")
    comm.close()


if __name__ == "__main__":
    main()

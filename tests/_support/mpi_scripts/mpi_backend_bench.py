"""Benchmark (not a test): gradcomm's mpi backend against raw mpi4py, and fp16/bf16 strategies.

Run: ``mpiexec -n 2 python tests/mpi_scripts/mpi_backend_bench.py [--trials 7] [--quick]``.
Rank 0 prints one line per case: median and min of the per-call time over ``trials`` trials
(each the mean of ``iters`` back-to-back calls), in microseconds. Overhead is layer minus raw.

Cases:
  raw-Allreduce      ``MPI.COMM_WORLD.Allreduce(IN_PLACE, array)`` (the bar)
  raw-Iallreduce     ``Iallreduce`` + ``Wait`` on the same buffer
  gradcomm           ``MPICommunicator.all_reduce(tensor)`` (sync), float32
  fp16/bf16 strategies, on tensors of the same element count:
    mpich-fp16       MPICH's built-in MPIX_C_FLOAT16 SUM (raw Allreduce)
    upcast           gradcomm forced to its float32 path: scratch, reduce, round back
    userop           gradcomm forced to its 16-bit user-defined op (torch add in a callback)
    rawuserop        raw Allreduce with the same kind of user op (no gradcomm layer)
    gloo             gradcomm's gloo backend (rendezvous through MPI), same dtype
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from functools import partial

import numpy as np
import torch
from mpi4py import MPI

import gradcomm
import gradcomm.comm.backends.mpi.ops16 as mpi_backend

WORLD = MPI.COMM_WORLD


def timed(cases: dict[str, Callable[[], object]], iters: int, trials: int
          ) -> dict[str, tuple[float, float]]:
    """{name: (median, min)} over trials of the mean time per call, in microseconds.

    The cases are interleaved within each trial, so a burst of load from other processes on the
    machine hits all of them alike; each trial's time is the slowest rank's.
    """
    for fn in cases.values():
        fn()  # warm-up
    per_call: dict[str, list[float]] = {name: [] for name in cases}
    for _ in range(trials):
        for name, fn in cases.items():
            WORLD.Barrier()
            start = time.perf_counter()
            for _ in range(iters):
                fn()
            per_call[name].append((time.perf_counter() - start) / iters * 1e6)
    out = {}
    for name, values in per_call.items():
        mine = np.array(values)
        slowest = np.empty_like(mine)
        WORLD.Allreduce(mine, slowest, op=MPI.MAX)
        out[name] = (statistics.median(slowest.tolist()), float(slowest.min()))
    return out


def _user_op(dtype: torch.dtype) -> MPI.Op:
    """SUM over 16-bit floats in place: torch adds (rounding to ``dtype`` after every add)."""

    def add(inbuf: object, inoutbuf: object, _datatype: MPI.Datatype) -> None:
        acc = torch.frombuffer(inoutbuf, dtype=dtype)
        acc.add_(torch.frombuffer(inbuf, dtype=dtype))

    return MPI.Op.Create(add, commute=True)


def _iallreduce_wait(array: np.ndarray) -> None:
    WORLD.Iallreduce(MPI.IN_PLACE, array).Wait()


def _with_user_op_limit(limit: int, fn: Callable[[], object]) -> object:
    """Run ``fn`` with gradcomm's 16-bit user op allowed up to ``limit`` ranks (0: upcast)."""
    saved = mpi_backend._USER_OP_MAX_WORLD
    mpi_backend._USER_OP_MAX_WORLD = limit
    try:
        return fn()
    finally:
        mpi_backend._USER_OP_MAX_WORLD = saved


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=7)
    parser.add_argument("--quick", action="store_true", help="small sizes and few iterations")
    args = parser.parse_args()
    torch.set_num_threads(1)
    rank = WORLD.Get_rank()
    comm = gradcomm.init("mpi", timeout=120)
    gloo = gradcomm.init("gloo", timeout=120)

    def report(
        name: str, nbytes: int, result: tuple[float, float], raw: tuple[float, float] | None
    ) -> None:
        if rank != 0:
            return
        med, best = result
        extra = ""
        if raw is not None and name != "raw-Allreduce":
            d_med, d_min = med - raw[0], best - raw[1]
            extra = (f"  overhead median {d_med:+8.1f} us ({d_med / raw[0] * 100:+6.1f}%)"
                     f"  min {d_min:+8.1f} us ({d_min / raw[1] * 100:+6.1f}%)")
        print(f"{name:<16} {nbytes:>10} B  median {med:10.1f} us  min {best:10.1f} us{extra}",
              flush=True)

    sizes = [8, 1 << 20] if args.quick else [8, 1 << 20, 16 << 20]
    for nbytes in sizes:
        iters = 2 if args.quick else max(3, min(1000, (32 << 20) // (nbytes * 8)))
        t = torch.ones(nbytes // 4)
        arr = t.numpy()
        res = timed(
            {
                "raw-Allreduce": partial(WORLD.Allreduce, MPI.IN_PLACE, arr),
                "raw-Iallreduce": partial(_iallreduce_wait, arr),
                "gradcomm": partial(comm.all_reduce, t),
                "gloo": partial(gloo.all_reduce, t),
            },
            iters, args.trials,
        )
        for name, result in res.items():
            report(name, nbytes, result, res["raw-Allreduce"])

    half_sizes = [1 << 20] if args.quick else [1 << 20, 16 << 20]
    for nbytes in half_sizes:  # bytes of the 16-bit tensor
        n = nbytes // 2
        iters = 2 if args.quick else max(2, (16 << 20) // (nbytes * 8))
        for dtype in (torch.float16, torch.bfloat16):
            x = torch.full((n,), 0.5, dtype=dtype)
            bits = x.view(torch.int16).numpy()
            name = "fp16" if dtype == torch.float16 else "bf16"
            op = _user_op(dtype)
            cases: dict[str, Callable[[], object]] = {
                f"upcast-{name}": partial(_with_user_op_limit, 0, partial(comm.all_reduce, x)),
                f"userop-{name}": partial(_with_user_op_limit, 2, partial(comm.all_reduce, x)),
                f"rawuserop-{name}":
                    partial(WORLD.Allreduce, MPI.IN_PLACE, [bits, MPI.INT16_T], op),
                f"gloo-{name}": partial(gloo.all_reduce, x),
            }
            if dtype == torch.float16:
                harr = x.numpy()
                cases["mpich-fp16"] = partial(WORLD.Allreduce, MPI.IN_PLACE, harr)
            for case, result in timed(cases, iters, args.trials).items():
                report(case, nbytes, result, None)
            op.Free()
    gloo.close()
    comm.close()


if __name__ == "__main__":
    main()

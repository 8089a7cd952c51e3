"""The collectives beyond all_reduce checked against a single-process torch reference.

Shared by the spawned gloo runs (tests/comm/test_collectives_gloo.py), the mpiexec script
(tests/mpi_scripts/collectives_more.py) and the thread backend's tests: each rank's input is a
known function of (rank, case), so every rank computes the reference from all ranks' inputs
itself. :func:`run_all` runs every case on one communicator and returns how many it checked.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from gradcomm import ReduceOp
from gradcomm.comm import Communicator

FLOATS = [torch.float32, torch.float64]
INTS = [torch.int8, torch.uint8, torch.int32, torch.int64]
HALF = [torch.float16, torch.bfloat16]


def rank_data(rank: int, shape: tuple[int, ...], dtype: torch.dtype, salt: int = 0) -> torch.Tensor:
    """Rank ``rank``'s values: small, so integer sums and products of 4 ranks fit int8."""
    n = 1
    for s in shape:
        n *= s
    idx = torch.arange(n)
    if dtype == torch.bool:
        return ((idx + rank + salt) % 3 == 0).reshape(shape)
    if dtype == torch.uint8:
        return ((idx + rank + salt) % 3 + 1).to(dtype).reshape(shape)
    if not dtype.is_floating_point:
        return ((idx * 7 + 3 * rank + salt) % 5 - 2).to(dtype).reshape(shape)
    gen = torch.Generator().manual_seed(1000 * salt + rank)
    return (torch.rand(n, generator=gen, dtype=torch.float64) * 4 - 2).to(dtype).reshape(shape)


def reduce_ref(parts: list[torch.Tensor], op: ReduceOp, dtype: torch.dtype) -> torch.Tensor:
    """The reduction of ``parts`` in float64 (int64 for integers), cast back to ``dtype``."""
    wide = torch.stack([p.to(torch.float64 if dtype.is_floating_point else torch.int64)
                        for p in parts])
    if op is ReduceOp.SUM:
        out = wide.sum(0) if dtype != torch.bool else wide.amax(0)
    elif op is ReduceOp.AVG:
        out = wide.sum(0) / len(parts)
    elif op is ReduceOp.MIN:
        out = wide.amin(0)
    elif op is ReduceOp.MAX:
        out = wide.amax(0)
    else:
        out = wide.prod(0) if dtype != torch.bool else wide.amin(0)
    return out.to(dtype)


def assert_equal(got: torch.Tensor, want: torch.Tensor, case: str) -> None:
    """Exact for integers and float64/32 sums of few values within rounding; dtype-wide for
    16-bit floats (a transport may round per step)."""
    tol = {torch.float16: 1e-2, torch.bfloat16: 4e-2, torch.float32: 1e-5, torch.float64: 1e-12}
    if got.dtype != want.dtype or got.shape != want.shape:
        raise AssertionError(f"{case}: got {got.dtype}{tuple(got.shape)}, "
                             f"want {want.dtype}{tuple(want.shape)}")
    if got.dtype.is_floating_point:
        t = tol[got.dtype]
        torch.testing.assert_close(got, want, rtol=t, atol=t, msg=lambda m: f"{case}: {m}")
    elif not torch.equal(got, want):
        raise AssertionError(f"{case}: got {got.tolist()}, want {want.tolist()}")


def _ops(dtype: torch.dtype) -> list[ReduceOp]:
    ops = [ReduceOp.SUM, ReduceOp.MIN, ReduceOp.MAX, ReduceOp.PRODUCT]
    return [*ops, ReduceOp.AVG] if dtype.is_floating_point else ops


def _noncontiguous(t: torch.Tensor) -> torch.Tensor:
    """A non-contiguous tensor with ``t``'s shape and values (the transpose of its transpose)."""
    return t.t().contiguous().t() if t.dim() == 2 and t.shape[0] > 1 and t.shape[1] > 1 else t


def check_reduce_scatter(comm: Communicator, dtypes: list[torch.dtype]) -> int:
    """reduce_scatter: every dtype and op, contiguous and not, sync and async."""
    w, r, checks = comm.world_size, comm.rank, 0
    for dtype in dtypes:
        for op in _ops(dtype):
            for layout in ("plain", "strided"):
                rows, cols = 2, 3
                inputs = [rank_data(k, (w * rows, cols), dtype, salt=checks) for k in range(w)]
                want = reduce_ref(inputs, op, dtype)[r * rows:(r + 1) * rows]
                inp = inputs[r].clone()
                out = torch.full((rows, cols), 7, dtype=dtype)
                if layout == "strided":
                    inp, out = _noncontiguous(inp), _noncontiguous(out)
                async_op = layout == "strided"
                work = comm.reduce_scatter(out, inp, op, async_op=async_op)
                work.wait()
                assert_equal(out, want, f"reduce_scatter {dtype} {op.name} {layout}")
                assert_equal(inp, inputs[r], f"reduce_scatter input kept {dtype}")
                checks += 1
    return checks


def check_bad_reduce_scatter(comm: Communicator) -> int:
    """Bad reduce_scatter arguments raise the right error on this rank before any transfer."""
    w = comm.world_size
    cases: list[tuple[type[Exception], Callable[[], object]]] = [
        (ValueError, lambda: comm.reduce_scatter(torch.zeros(2), torch.zeros(2 * w + 1))),
        (ValueError, lambda: comm.reduce_scatter(torch.zeros(3), torch.zeros(2 * w))),
        (TypeError, lambda: comm.reduce_scatter(torch.zeros(2), torch.zeros(2 * w,
                                                                            dtype=torch.float64))),
        (TypeError, lambda: comm.reduce_scatter(torch.zeros(2, dtype=torch.int32),
                                                torch.zeros(2 * w, dtype=torch.int32), "avg")),
        (TypeError, lambda: comm.reduce_scatter(torch.zeros(2, dtype=torch.complex64),
                                                torch.zeros(2 * w, dtype=torch.complex64))),
        (TypeError, lambda: comm.reduce_scatter([0.0], torch.zeros(2 * w))),
        (ValueError, lambda: comm.reduce_scatter(torch.zeros(2), torch.zeros(2 * w), "mean")),
        (ValueError, lambda: comm.reduce_scatter(torch.zeros(1).expand(2), torch.zeros(2 * w))),
        (TypeError, lambda: comm.reduce_scatter(torch.zeros(2), torch.zeros(2 * w),
                                                async_op=1)),  # type: ignore[arg-type]
    ]
    return _expect_all(cases)


def _expect_all(cases: list[tuple[type[Exception], Callable[[], object]]]) -> int:
    for i, (kind, call) in enumerate(cases):
        try:
            call()
        except kind as exc:
            if len(str(exc)) > 200:
                raise AssertionError(f"bad-input case {i}: message over 200 chars: {exc}") from exc
            continue
        except Exception as exc:
            raise AssertionError(f"bad-input case {i}: {type(exc).__name__} instead of "
                                 f"{kind.__name__}: {exc}") from exc
        raise AssertionError(f"bad-input case {i}: no {kind.__name__} raised")
    return len(cases)


def run_all(comm: Communicator, dtypes: list[torch.dtype]) -> dict[str, int]:
    """Every case on ``comm``; returns the number of checks per collective. A bad-input check
    runs between good collectives, so a rank that had issued a transfer would desynchronise."""
    counts = {"bad": check_bad_reduce_scatter(comm)}
    counts["reduce_scatter"] = check_reduce_scatter(comm, dtypes)
    comm.barrier()
    return counts

"""The collectives beyond all_reduce checked against a single-process torch reference.

Each rank's input is a known function of (rank, case), so every rank computes the reference from
all ranks' inputs itself. Each ``check_*`` function runs one collective's cases on one
communicator and returns how many it checked (``tests/comm/suite_collectives.py`` runs them on
every backend); :func:`run_all` runs them all.
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


def check_all_to_all(comm: Communicator, dtypes: list[torch.dtype]) -> int:
    """all_to_all: equal and uneven splits (zeros included), 1-D and 2-D, contiguous and not,
    sync and async, every dtype (moved as bytes)."""
    w, r, checks = comm.world_size, comm.rank, 0

    def count(src: int, dst: int) -> int:
        return (src + 2 * dst + 1) % 3

    for dtype in dtypes:
        for mode in ("equal", "uneven", "strided"):
            cols = 3
            if mode == "equal":
                sends = [[2] * w for _ in range(w)]
            else:
                sends = [[count(i, j) for j in range(w)] for i in range(w)]
            inputs = [rank_data(i, (sum(sends[i]), cols), dtype, salt=checks) for i in range(w)]
            pieces = []
            for i in range(w):
                start = sum(sends[i][:r])
                pieces.append(inputs[i][start:start + sends[i][r]])
            want = torch.cat(pieces)
            recv = [sends[i][r] for i in range(w)]
            inp = inputs[r].clone()
            out = torch.zeros(want.shape, dtype=dtype)
            if mode == "strided":
                inp, out = _noncontiguous(inp), _noncontiguous(out)
            splits = (None, None) if mode == "equal" else (recv, sends[r])
            comm.all_to_all(out, inp, *splits, async_op=mode == "strided").wait()
            assert_equal(out, want, f"all_to_all {dtype} {mode}")
            checks += 1
    # 1-D, and a rank that sends nothing (rank 0) still takes part
    sends = [[0 if i == 0 else j + 1 for j in range(w)] for i in range(w)]
    inp = torch.arange(sum(sends[r]), dtype=torch.float32) + 100 * r
    recv = [sends[i][r] for i in range(w)]
    out = torch.empty(sum(recv))
    comm.all_to_all(out, inp, recv, sends[r])
    want = torch.cat([torch.arange(sum(sends[i][:r]), sum(sends[i][:r + 1]),
                                   dtype=torch.float32) + 100 * i for i in range(w)])
    assert_equal(out, want, "all_to_all 1-D with an empty sender")
    return checks + 1


def check_bad_all_to_all(comm: Communicator) -> int:
    """Bad all_to_all arguments raise on this rank before any transfer."""
    w = comm.world_size
    x = torch.zeros(2 * w, 3)
    cases: list[tuple[type[Exception], Callable[[], object]]] = [
        (ValueError, lambda: comm.all_to_all(torch.zeros(2 * w + 1, 3), x,
                                             [2] * w + [1] if w > 1 else [3], None)),
        (ValueError, lambda: comm.all_to_all(x, torch.zeros(2 * w + 1, 3))),
        (ValueError, lambda: comm.all_to_all(x, x.clone(), [2] * (w + 1), None)),
        (ValueError, lambda: comm.all_to_all(x, x.clone(), None, [-1] + [2] * (w - 1))),
        (ValueError, lambda: comm.all_to_all(x, x.clone(), None, [1] * w)),
        (TypeError, lambda: comm.all_to_all(x, x.clone(), None, [2.0] * w)),
        (ValueError, lambda: comm.all_to_all(torch.zeros(2 * w, 4), x)),
        (ValueError, lambda: comm.all_to_all(torch.zeros(()), torch.zeros(()))),
        (TypeError, lambda: comm.all_to_all(x, x.to(torch.float64))),
        (ValueError, lambda: comm.all_to_all(torch.zeros(1, 3).expand(2 * w, 3), x)),
    ]
    return _expect_all(cases)


def check_rooted(comm: Communicator, dtypes: list[torch.dtype]) -> int:
    """reduce, gather and scatter at every root, contiguous and not, sync and async."""
    w, r, checks = comm.world_size, comm.rank, 0
    for dtype in dtypes:
        for root in range(w):
            strided = (root + checks) % 2 == 1
            shape = (2, 3)
            ins = [rank_data(k, shape, dtype, salt=checks) for k in range(w)]
            for op in _ops(dtype) if root == 0 else [ReduceOp.SUM]:
                t = ins[r].clone()
                t = _noncontiguous(t) if strided else t
                comm.reduce(t, root, op, async_op=strided).wait()
                if r == root:
                    assert_equal(t, reduce_ref(ins, op, dtype), f"reduce {dtype} {op.name} {root}")
            # gather: the root's buffer is world_size chunks of the input's shape along dim 0
            out = torch.zeros(w * 2, 3, dtype=dtype) if r == root else None
            if out is not None and strided:
                out = _noncontiguous(out)
            inp = _noncontiguous(ins[r].clone()) if strided else ins[r].clone()
            comm.gather(out, inp, root, async_op=strided).wait()
            if out is not None:
                assert_equal(out, torch.cat(ins), f"gather {dtype} root {root}")
            # scatter: chunk k of the root's input goes to rank k
            big = torch.cat(ins) if r == root else None
            got = torch.zeros(shape, dtype=dtype)
            got = _noncontiguous(got) if strided else got
            comm.scatter(got, big, root, async_op=strided).wait()
            assert_equal(got, ins[r], f"scatter {dtype} root {root}")
            checks += 1
    return checks


def check_bad_rooted(comm: Communicator) -> int:
    """Bad rooted arguments that every rank can see raise on every rank; the root's buffer is
    checked on the root only (see docs/collectives.md)."""
    w, r = comm.world_size, comm.rank
    x = torch.zeros(2, 3)
    root_out = torch.zeros(2 * w, 3)
    cases: list[tuple[type[Exception], Callable[[], object]]] = [
        (ValueError, lambda: comm.reduce(x.clone(), w)),
        (ValueError, lambda: comm.reduce(x.clone(), -1)),
        (TypeError, lambda: comm.reduce(x.clone(), 0.0)),  # type: ignore[arg-type]
        (TypeError, lambda: comm.reduce(x.clone().int(), 0, "avg")),
        (ValueError, lambda: comm.gather(root_out if r == w else None, x, w)),
        (TypeError, lambda: comm.gather(None, x, True)),  # type: ignore[arg-type]
        (ValueError, lambda: comm.scatter(x.clone(), None, w + 3)),
        (ValueError, lambda: comm.scatter(torch.zeros(1, 3).expand(2, 3), None, 0)),
        (TypeError, lambda: comm.gather(None, [1.0], 0)),  # type: ignore[arg-type]
    ]
    if w == 1:  # every rank is the root: the root-only checks run on every rank
        cases += [
            (ValueError, lambda: comm.gather(torch.zeros(3, 3), x, 0)),
            (TypeError, lambda: comm.gather(None, x, 0)),
            (TypeError, lambda: comm.gather(root_out.double(), x, 0)),
            (ValueError, lambda: comm.scatter(x.clone(), torch.zeros(3, 3), 0)),
            (TypeError, lambda: comm.scatter(x.clone(), None, 0)),
        ]
    return _expect_all(cases)


def check_all_gather_uneven(comm: Communicator, dtypes: list[torch.dtype]) -> int:
    """all_gather with output_split_sizes: rows per rank differ (zero included)."""
    w, r, checks = comm.world_size, comm.rank, 0
    for dtype in dtypes:
        for strided in (False, True):
            rows = [(k + checks) % 3 for k in range(w)]
            ins = [rank_data(k, (rows[k], 2), dtype, salt=checks) for k in range(w)]
            out = torch.zeros(sum(rows), 2, dtype=dtype)
            inp = ins[r].clone()
            if strided:
                out, inp = _noncontiguous(out), _noncontiguous(inp)
            comm.all_gather(out, inp, rows, async_op=strided).wait()
            assert_equal(out, torch.cat(ins), f"all_gather uneven {dtype} {rows}")
            checks += 1
    return checks


def check_bad_all_gather_uneven(comm: Communicator) -> int:
    """Bad uneven all_gather arguments raise on this rank before any transfer."""
    w, r = comm.world_size, comm.rank
    rows = [k + 1 for k in range(w)]
    out, inp = torch.zeros(sum(rows), 2), torch.zeros(r + 1, 2)
    cases: list[tuple[type[Exception], Callable[[], object]]] = [
        (ValueError, lambda: comm.all_gather(out, torch.zeros(r + 2, 2), rows)),
        (ValueError, lambda: comm.all_gather(out, torch.zeros(r + 1, 3), rows)),
        (ValueError, lambda: comm.all_gather(out, inp, [*rows, 0])),
        (ValueError, lambda: comm.all_gather(torch.zeros(sum(rows) + 1, 2), inp, rows)),
        (TypeError, lambda: comm.all_gather(out, inp.double(), rows)),
        (TypeError, lambda: comm.all_gather(out, inp, [float(n) for n in rows])),
    ]
    return _expect_all(cases)


def check_objects(comm: Communicator) -> int:
    """broadcast_object from every root and all_gather_object of objects of different sizes;
    an object that cannot be pickled raises TypeError on every rank."""
    w, r, checks = comm.world_size, comm.rank, 0
    for src in range(w):
        sent = {"src": src, "metrics": [src * 0.5] * (src + 1), "t": torch.arange(src + 2)}
        got = comm.broadcast_object(sent if r == src else None, src)
        assert isinstance(got, dict) and got["src"] == src and got["metrics"] == sent["metrics"]
        assert torch.equal(got["t"], sent["t"])
        checks += 1
    mine = {"rank": r, "text": "x" * (1000 * r + 1)}
    assert comm.all_gather_object(mine) == [{"rank": k, "text": "x" * (1000 * k + 1)}
                                            for k in range(w)]
    bad_rank = w - 1
    try:
        comm.broadcast_object((lambda: 0) if r == bad_rank else None, bad_rank)
    except TypeError as exc:
        assert f"rank {bad_rank}'s object cannot be pickled" in str(exc), exc
    else:
        raise AssertionError("broadcast_object of a lambda did not raise")
    try:
        comm.all_gather_object((lambda: 0) if r == bad_rank else r)
    except TypeError as exc:
        assert f"rank {bad_rank}'s object cannot be pickled" in str(exc), exc
    else:
        raise AssertionError("all_gather_object of a lambda did not raise")
    assert comm.all_gather_object(r) == list(range(w))  # still in step
    return checks + 4


def check_supports(comm: Communicator) -> int:
    """``supports(..., collective=...)`` names what this backend emulates."""
    from gradcomm.comm import Collective, SupportLevel

    ask = comm.supports
    uneven = ask(torch.float32, collective=Collective.ALL_GATHER_V)
    padded = comm.backend in ("gloo", "nccl", "cupy-nccl")
    want = SupportLevel.EMULATED_SLOW if padded else SupportLevel.NATIVE
    assert uneven.level is want, (comm.backend, uneven)
    assert ask(torch.uint16, collective="all_to_all").is_supported  # moved as bytes
    assert not ask(torch.complex64, collective="reduce_scatter").is_supported
    half = ask(torch.float16, collective="reduce_scatter")
    if comm.backend == "mpi":
        assert half.is_slow and half.transfer_dtype == torch.float32, half
    assert ask(torch.float32, collective="reduce").level is SupportLevel.NATIVE
    return 5


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
    counts = {"bad": check_bad_reduce_scatter(comm) + check_bad_all_to_all(comm)
              + check_bad_rooted(comm) + check_bad_all_gather_uneven(comm),
              "supports": check_supports(comm)}
    counts["reduce_scatter"] = check_reduce_scatter(comm, dtypes)
    counts["all_to_all"] = check_all_to_all(comm, dtypes)
    counts["rooted"] = check_rooted(comm, dtypes)
    counts["all_gather_uneven"] = check_all_gather_uneven(comm, dtypes)
    counts["objects"] = check_objects(comm)
    comm.barrier()
    return counts

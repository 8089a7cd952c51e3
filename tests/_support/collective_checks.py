"""Collective checks shared by every backend's suite (threads and gloo in test_communicator.py,
MPI in mpi_backend_collectives.py). Each takes a communicator, asserts values, and returns the
number of checks it made."""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np
import torch
from torch import nn

from gradcomm.comm import Communicator, ReduceOp


def _neg_view(rank: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A float32 view whose sign lives in the tensor's negative bit, not in memory.

    ``z.conj().imag`` of a complex tensor ``z``: shows ``-(rank + 2 + i)`` for ``i < n`` while the
    memory holds ``+(rank + 2 + i)``. With n == 1 it is contiguous, else strided.
    """
    z = torch.tensor([complex(1, rank + 2 + i) for i in range(n)], dtype=torch.complex64)
    t = z.conj().imag
    assert t.is_neg() and t.is_contiguous() == (n == 1)
    return z, t


def check_sign_bits(comm: Communicator) -> int:
    """Negative and conjugate views reduce, broadcast and gather the values they show."""
    rank, ws = comm.rank, comm.world_size
    checks = 0
    for n in (1, 5):
        shown = [[-(r + 2 + i) for i in range(n)] for r in range(ws)]
        columns = list(zip(*shown, strict=True))
        expected = {
            ReduceOp.SUM: [float(sum(c)) for c in columns],
            ReduceOp.MIN: [float(min(c)) for c in columns],
            ReduceOp.MAX: [float(max(c)) for c in columns],
            ReduceOp.PRODUCT: [float(math.prod(c)) for c in columns],
        }
        for op, want in expected.items():
            z, t = _neg_view(rank, n)
            comm.all_reduce(t, op)
            assert t.tolist() == want, f"{op} of a negative view ({n} elements): {t.tolist()}"
            assert z.imag.tolist() == [-v for v in want], "written back without the sign bit"
            checks += 1

        src = ws - 1
        z, t = _neg_view(rank, n)
        comm.broadcast(t, src=src)
        assert t.tolist() == [float(v) for v in shown[src]], f"broadcast of a negative view: {t}"
        checks += 1

        _, t = _neg_view(rank, n)
        out_z = torch.zeros(ws * n, dtype=torch.complex64)
        out = out_z.conj().imag  # the output has the negative bit too
        comm.all_gather(out, t)
        assert out.tolist() == [float(v) for row in shown for v in row], f"all_gather: {out}"
        checks += 1

    # A conjugate complex view, broadcast as raw bytes: receivers see the values src shows.
    z = torch.tensor([complex(rank, 1.0 + rank), complex(-rank, 2.0)], dtype=torch.complex128)
    c = z.conj()
    assert c.is_conj()
    comm.broadcast(c, src=ws - 1)
    s = ws - 1
    assert c.tolist() == [complex(s, -(1.0 + s)), complex(-s, -2.0)], f"broadcast of conj: {c}"
    return checks + 1


# dtypes that no backend reduces but every backend moves (broadcast, all_gather) as raw bytes.
BYTE_DTYPES = [torch.complex64, torch.complex128, torch.uint16, torch.uint32, torch.uint64,
               torch.float8_e4m3fn, torch.float8_e5m2, torch.bool, torch.int16]


def _bytes_of(rank: int, dtype: torch.dtype) -> torch.Tensor:
    return (torch.arange(6) + 7 * rank).to(dtype).view(2, 3)


def check_any_dtype_moves(comm: Communicator) -> int:
    """broadcast and all_gather deliver every dtype byte for byte, on every backend."""
    rank, ws = comm.rank, comm.world_size
    src = ws - 1
    checks = 0
    for dtype in BYTE_DTYPES:
        t = _bytes_of(rank, dtype)
        comm.broadcast(t, src=src)
        assert torch.equal(t.view(torch.uint8), _bytes_of(src, dtype).view(torch.uint8)), (
            f"broadcast {dtype}: {t}")
        out = torch.empty(ws, 2, 3, dtype=dtype)
        comm.all_gather(out, _bytes_of(rank, dtype))
        want = torch.stack([_bytes_of(r, dtype) for r in range(ws)])
        assert torch.equal(out.view(torch.uint8), want.view(torch.uint8)), f"all_gather {dtype}"
        checks += 2
    return checks


def _raises_value_error(call: Callable[[], object], says: str) -> None:
    try:
        call()
    except ValueError as exc:
        assert says in str(exc), str(exc)
    else:
        raise AssertionError(f"no ValueError ({says})")


def check_awkward_targets(comm: Communicator) -> int:
    """Results land in tensors that autograd or inference mode guard, and across separate storages
    over one buffer; targets whose elements share memory are refused before any transfer."""
    rank, ws = comm.rank, comm.world_size
    last = ws - 1
    mean = (ws - 1) / 2
    checks = 0

    # Leaves that require grad: non-contiguous (written back by a copy) and contiguous with AVG
    # (divided after the sum), float32 and float16.
    p = nn.Parameter(torch.full((3, 2), float(rank)).t())
    comm.broadcast(p, src=last)
    assert p.requires_grad and p.detach().tolist() == [[float(last)] * 3] * 2, p
    for dtype in (torch.float32, torch.float16):
        if comm.supports(dtype).is_supported:
            q = nn.Parameter(torch.full((4,), float(rank), dtype=dtype))
            comm.all_reduce(q, "avg")
            assert q.detach().tolist() == [mean] * 4, f"AVG into a {dtype} parameter: {q}"
            checks += 1
    r = nn.Parameter(torch.full((3, 2), float(rank)).t())
    comm.all_reduce(r, "max")
    assert r.detach().tolist() == [[float(last)] * 3] * 2, r
    g = nn.Parameter(torch.zeros(2, ws).t())  # (ws, 2), non-contiguous
    comm.all_gather(g, torch.full((2,), float(rank)))
    assert g.detach().tolist() == [[float(i)] * 2 for i in range(ws)], g
    checks += 3

    # Inference tensors, used outside inference mode.
    with torch.inference_mode():
        a = torch.full((3, 2), float(rank)).t()
        b = torch.full((4,), float(rank))
    comm.all_reduce(a, "sum")
    comm.all_reduce(b, "avg")
    assert a.tolist() == [[float(sum(range(ws)))] * 3] * 2 and b.tolist() == [mean] * 4, (a, b)
    checks += 1

    # Input and output are separate storages over one numpy buffer, the input being this rank's
    # slot of the output (a storage comparison does not see it; MPI rejects aliased buffers).
    shared = np.zeros(2 * ws, dtype=np.float32)
    out = torch.from_numpy(shared)
    inp = torch.from_numpy(shared[2 * rank:2 * rank + 2])
    inp.fill_(rank + 1)
    comm.all_gather(out, inp)
    assert out.tolist() == [float(i + 1) for i in range(ws) for _ in range(2)], out
    checks += 1

    # Elements sharing memory (expand): refused on every rank before any transfer.
    e = torch.zeros(1).expand(3)
    _raises_value_error(lambda: comm.all_reduce(e), "one memory location")
    _raises_value_error(lambda: comm.broadcast(e), "one memory location")
    _raises_value_error(lambda: comm.all_gather(torch.zeros(1).expand(2 * ws), torch.ones(2)),
                        "one memory location")
    t = torch.ones(3)
    comm.all_reduce(t)  # still in step
    assert t.tolist() == [float(ws)] * 3, t
    return checks + 4


def check_complex(comm: Communicator) -> int:
    """SUM and AVG of complex tensors (contiguous, strided, conjugate views), MIN refused."""
    n, r = comm.world_size, comm.rank
    checks = 0
    for dtype in (torch.complex64, torch.complex128):
        mine = torch.tensor([complex(r + 1, -r), complex(0.5, 2.0)], dtype=dtype)
        total = torch.tensor([complex(sum(range(1, n + 1)), -sum(range(n))),
                              complex(0.5 * n, 2.0 * n)], dtype=dtype)
        for op, want in (("sum", total), ("avg", total / n)):
            t = mine.clone()
            comm.all_reduce(t, op)
            assert torch.allclose(t, want), (dtype, op, t, want)
            grid = torch.zeros(2, 2, dtype=dtype)
            grid[:, 1] = mine
            comm.all_reduce(grid[:, 1], op)  # non-contiguous
            assert torch.allclose(grid[:, 1], want) and bool((grid[:, 0] == 0).all()), grid
            conj = mine.conj().clone().conj()  # a conjugate view of conj(mine): reads as mine
            assert conj.is_conj()
            comm.all_reduce(conj, op)
            assert torch.allclose(conj, want), (dtype, op, "conj", conj)
            checks += 3
    try:
        comm.all_reduce(torch.ones(2, dtype=torch.complex64), "max")
    except TypeError as exc:
        assert "SUM or AVG" in str(exc), exc
    else:
        raise AssertionError("MAX of a complex tensor did not raise TypeError")
    # supports() answers for the real view all_reduce uses (it used to say UNSUPPORTED)
    for dtype, real in ((torch.complex64, torch.float32), (torch.complex128, torch.float64)):
        got, part = comm.supports(dtype), comm.supports(real)
        assert (got.level, got.transfer_dtype) == (part.level, part.transfer_dtype), (dtype, got)
        assert got.is_supported and f"as its {real} real view" in got.reason, got
    return checks + 2


def check_callbacks_on_completed_works(comm: Communicator) -> int:
    """A callback added to a work that is already complete runs at once (it used to raise
    RuntimeError): one that issued no collective (an empty tensor), and one completed by a
    later collective (MPI finishes works in order) or by its own wait."""
    ran: list[str] = []
    empty = comm.all_reduce(torch.ones(0), async_op=True)
    empty.add_callback(lambda: ran.append("empty"))
    t = torch.full((3,), float(comm.rank + 1))
    first = comm.all_reduce(t, async_op=True)
    comm.all_reduce(torch.ones(2))  # on MPI this finishes `first` too
    if not first.is_completed():
        first.wait()
    first.add_callback(lambda: ran.append(f"late {t.tolist()}"))
    first.wait()
    total = float(sum(range(1, comm.world_size + 1)))
    assert ran == ["empty", f"late {[total] * 3}"], ran
    # a callback added by a running callback runs after those added before it
    order: list[str] = []
    pending = comm.all_reduce(torch.ones(4), async_op=True)

    def first() -> None:
        order.append("A")
        pending.add_callback(lambda: order.append("B"))

    pending.add_callback(first)
    pending.add_callback(lambda: order.append("C"))
    pending.wait()
    pending.add_callback(lambda: order.append("D"))  # complete: at once
    # at one rank the work is complete when returned, so each callback runs as it is added
    assert order == (["A", "C", "B", "D"] if comm.world_size > 1 else ["A", "B", "C", "D"]), order
    return 2

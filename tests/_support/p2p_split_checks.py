"""Point-to-point and split checks run on every rank of a real communicator (gloo, mpi, threads).

Each rank's data is a known function of (rank, dtype, tag), so every rank computes what it must
receive itself (a single-process torch reference). ``tests/comm/suite_p2p_split.py`` and
``suite_hierarchical.py`` run them on every backend; each returns the number of checks it made.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from gradcomm.comm import Communicator, P2POp

__all__ = ["run_p2p_checks", "run_split_checks", "run_hierarchical_checks", "mpi_checks",
           "check_children_closed", "expect_error"]

DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int8,
          torch.uint8, torch.bool]


def data(rank: int, dtype: torch.dtype, tag: int = 0,
         shape: tuple[int, ...] = (3, 5)) -> torch.Tensor:
    """Rank ``rank``'s message: distinct per rank and tag, exact in every dtype."""
    n = 1
    for s in shape:
        n *= s
    base = (torch.arange(n) * 7 + rank * 3 + tag * 11) % 50
    if dtype is torch.bool:
        return (base % 2 == 1).reshape(shape)
    return base.to(dtype).reshape(shape)


def expect_error(kind: type[Exception], fn: Callable[[], object], text: str = "") -> None:
    """Assert ``fn()`` raises ``kind`` with ``text`` in its message (and a short message)."""
    try:
        fn()
    except kind as exc:
        assert text in str(exc), f"{text!r} not in {exc!r}"
        assert len(str(exc)) <= 200, str(exc)
        return
    raise AssertionError(f"expected {kind.__name__}")


def _bad_inputs(comm: Communicator) -> int:
    r, n = comm.rank, comm.world_size
    t = torch.zeros(4)
    expect_error(ValueError, lambda: comm.send(t, r), "this rank")
    expect_error(ValueError, lambda: comm.recv(t, r), "this rank")
    expect_error(ValueError, lambda: comm.send(t, n), f"[0, {n})")
    expect_error(ValueError, lambda: comm.recv(t, -1), f"[0, {n})")
    expect_error(TypeError, lambda: comm.send(t, 1.0), "int")  # type: ignore[arg-type]
    expect_error(TypeError, lambda: comm.send([1.0], r), "Tensor")  # type: ignore[arg-type]
    expect_error(ValueError, lambda: P2POp("put", t, 0), "op")  # type: ignore[arg-type]
    expect_error(TypeError, lambda: comm.batch_isend_irecv([t]), "P2POp")  # type: ignore[list-item]
    # a batch with one bad op posts nothing
    ok = P2POp("send", t, (r + 1) % n)
    expect_error(ValueError, lambda: comm.batch_isend_irecv([ok, P2POp("send", t, r)]),
                 "this rank")
    if n == 1:
        return 9
    expect_error(ValueError, lambda: comm.send(t, (r + 1) % n, tag=-1), "tag")
    expect_error(TypeError, lambda: comm.send(t, (r + 1) % n, tag="a"), "tag")  # type: ignore[arg-type]
    expect_error(ValueError, lambda: comm.recv(torch.zeros(1).expand(4), (r + 1) % n), "stride")
    return 12


def run_p2p_checks(comm: Communicator) -> int:
    """Ring transfers in every dtype, sync and async, non-contiguous, tagged; return the count."""
    r, n = comm.rank, comm.world_size
    checks = _bad_inputs(comm)
    if n == 1:
        return checks
    right, left = (r + 1) % n, (r - 1) % n
    for dtype in DTYPES:
        # sync: even ranks send first, odd ranks receive first (a blocking ring needs an order)
        out = torch.zeros(3, 5, dtype=dtype)
        if r % 2 == 0:
            comm.send(data(r, dtype), right)
            comm.recv(out, left)
        else:
            comm.recv(out, left)
            comm.send(data(r, dtype), right)
        assert torch.equal(out, data(left, dtype)), (dtype, out)
        checks += 1
    # async, non-contiguous on both sides, two tags received in the opposite order
    for dtype in (torch.float32, torch.int32):
        src = data(r, dtype, shape=(5, 3)).t()  # non-contiguous (3, 5)
        out_a = torch.zeros(5, 3, dtype=dtype).t()
        out_b = torch.zeros(3, 5, dtype=dtype)
        works = [comm.recv(out_b, left, tag=2, async_op=True),
                 comm.recv(out_a, left, tag=1, async_op=True),
                 comm.send(src, right, tag=1, async_op=True),
                 comm.send(data(r, dtype, tag=2), right, tag=2, async_op=True)]
        for w in works:
            w.wait()
        assert torch.equal(out_a, data(left, dtype, shape=(5, 3)).t()), (dtype, out_a)
        assert torch.equal(out_b, data(left, dtype, tag=2)), (dtype, out_b)
        checks += 2
    # batch: both directions of the ring at once, receives listed first
    from_left, from_right = torch.zeros(3, 5), torch.zeros(3, 5)
    ops = [P2POp("recv", from_left, left), P2POp(comm.recv, from_right, right, tag=3),
           P2POp(comm.send, data(r, torch.float32), right),
           P2POp("send", data(r, torch.float32, tag=3), left, tag=3)]
    works = comm.batch_isend_irecv(ops)
    assert len(works) == 4
    for w in works:
        w.wait()
    assert torch.equal(from_left, data(left, torch.float32))
    assert torch.equal(from_right, data(right, torch.float32, tag=3))
    # batch: two sends and two receives with one peer and one tag, interleaved; MPI posts the
    # receives first, yet each kind keeps its order, so messages match in the order sent
    first, second = torch.zeros(3, 5), torch.zeros(3, 5)
    works = comm.batch_isend_irecv([
        P2POp("send", data(r, torch.float32, tag=1), right, tag=5),
        P2POp("recv", first, left, tag=5),
        P2POp("send", data(r, torch.float32, tag=2), right, tag=5),
        P2POp("recv", second, left, tag=5)])
    for w in works:
        w.wait()
    assert torch.equal(first, data(left, torch.float32, tag=1)), first
    assert torch.equal(second, data(left, torch.float32, tag=2)), second
    return checks + 4


def run_split_checks(comm: Communicator) -> int:
    """split (colors, keys, None), bad colors on every rank, split_by_host with faked hosts."""
    r, n = comm.rank, comm.world_size
    checks = 0
    # rank r: color r % 2, key reversed; the last rank (n >= 3) is no member
    none_rank = n - 1 if n >= 3 else -1
    sub = comm.split(None if r == none_rank else r % 2, key=n - r)
    if r == none_rank:
        assert sub is None
    else:
        assert sub is not None
        members = sorted((q for q in range(n) if q % 2 == r % 2 and q != none_rank),
                         key=lambda q: n - q)
        assert (sub.rank, sub.world_size) == (members.index(r), len(members)), (sub, members)
        assert sub.timeout == comm.timeout and sub.profiler is None
        t = torch.full((4,), float(r + 1))
        sub.all_reduce(t)
        assert torch.equal(t, torch.full((4,), float(sum(q + 1 for q in members))))
        gathered = torch.zeros(sub.world_size, dtype=torch.int64)
        sub.all_gather(gathered, torch.tensor([r]))
        assert gathered.tolist() == members
        if sub.world_size > 1:  # point-to-point on the child: its own ranks
            peer = (sub.rank + 1) % sub.world_size
            got = torch.zeros(2)
            w = sub.recv(got, (sub.rank - 1) % sub.world_size, async_op=True)
            sub.send(torch.full((2,), float(r)), peer)
            w.wait()
            assert torch.equal(got, torch.full((2,), float(members[(sub.rank - 1) % len(members)])))
        checks += 3
    # bad colors: one rank's wrong type (or value) raises on every rank, no hang
    expect_error(TypeError, lambda: comm.split("a" if r == n - 1 else 1), f"rank {n - 1}")
    expect_error(TypeError, lambda: comm.split(1.0 if r == 0 else None), "rank 0")
    expect_error(ValueError, lambda: comm.split(-1 if r == 0 else 0), "rank 0")
    expect_error(TypeError, lambda: comm.split(0, key=True if r == 0 else 0), "key")
    checks += 4
    # hosts: 2 ranks per host (n=3: hosts of 2 and 1)
    intra, inter = comm.split_by_host(host=f"host{r // 2}")
    assert (intra.rank, intra.world_size) == (r % 2, min(2, n - (r // 2) * 2))
    assert (inter.rank, inter.world_size) == (r // 2, len(range(r % 2, n, 2)))
    assert intra.local_rank == intra.rank and inter.local_rank == 0
    t = torch.tensor([float(r)])
    inter.all_reduce(t)
    assert t.item() == sum(range(r % 2, n, 2))
    checks += 2
    comm.barrier()
    return checks


def check_children_closed(comm: Communicator) -> int:
    """Closing a parent closes its children."""
    child = comm.split(0)
    assert child is not None and not child.closed
    comm.close()
    assert child.closed
    return 1


def _values(rank: int, dtype: torch.dtype) -> torch.Tensor:
    """35 elements (not a multiple of a host's 2 ranks: the padded path), exact in ``dtype``."""
    base = (torch.arange(35, dtype=torch.float64) * 0.37 + rank * 1.3) % 7 - 3
    if not dtype.is_floating_point:
        base = (base * 10).round()
    return base.to(dtype).reshape(5, 7)


def run_hierarchical_checks(comm: Communicator) -> int:
    """HierarchicalAllReduce over faked hosts against the flat reference; bit-identical ranks."""
    from gradcomm.comm import HierarchicalAllReduce, ReduceOp

    r, n = comm.rank, comm.world_size
    checks = 0
    if n == 3:  # hosts of 2 and 1 ranks: refused on every rank
        expect_error(ValueError, lambda: HierarchicalAllReduce(comm, host=f"host{r // 2}"),
                     "same number of ranks")
        checks += 1
    per_host = 2 if n % 2 == 0 else 1
    hier = HierarchicalAllReduce(comm, host=f"host{r // per_host}")
    assert (hier.intra.world_size, hier.inter.world_size) == (per_host, n // per_host)
    cases = [(torch.float64, ReduceOp.SUM), (torch.float32, ReduceOp.AVG),
             (torch.int64, ReduceOp.SUM), (torch.int32, ReduceOp.MAX),
             (torch.bfloat16, ReduceOp.SUM)]
    for dtype, op in cases:
        for contiguous in (True, False):
            mine = _values(r, dtype)
            if not contiguous:
                mine = mine.t().contiguous().t()
            stack = torch.stack([_values(q, dtype).double() for q in range(n)])
            ref = {ReduceOp.SUM: stack.sum(0), ReduceOp.AVG: stack.mean(0),
                   ReduceOp.MAX: stack.max(0).values}[op]
            hier.all_reduce(mine, op)
            tol = {torch.bfloat16: 0.05, torch.float32: 1e-5}.get(dtype, 1e-12)
            assert torch.allclose(mine.double(), ref, rtol=tol, atol=tol), (dtype, op, mine)
            # bit-identical on every rank
            everyone = torch.empty(n * 35, dtype=dtype)
            comm.all_gather(everyone, mine.contiguous().view(-1))
            rows = everyone.view(n, 35).view(torch.uint8)  # bytes: NaN-safe, bit for bit
            assert all(torch.equal(rows[0], rows[q]) for q in range(n)), (dtype, op)
            checks += 2
    hier.close()
    return checks


def mpi_checks(comm: Communicator) -> int:
    """MPI only: a shorter message is accepted by MPI and refused by the receive's count check;
    then the point-to-point checks through the device-buffer path without a GPU."""
    from tests._support.mpi_adapters import device_adapters

    checks = 0
    if comm.world_size > 1:
        if comm.rank == 0:
            comm.send(torch.zeros(3), 1)
            comm.send(torch.zeros(8), 1)
        elif comm.rank == 1:
            work = comm.recv(torch.zeros(4), 0, async_op=True)
            expect_error(RuntimeError, work.wait, "received 12 bytes")
            expect_error(RuntimeError, work.wait, "received 12 bytes")  # every time
            longer = comm.recv(torch.zeros(4), 0, async_op=True)  # MPI's truncation error
            expect_error(RuntimeError, longer.wait, "recv #")
            expect_error(RuntimeError, longer.wait, "recv #")
        # the failed receives raise from their own wait only: the next collective runs on
        # every rank (raised by it on rank 1 alone, the others would wait for it)
        t = torch.ones(2)
        comm.all_reduce(t)
        assert t.tolist() == [comm.world_size] * 2, t
        # sends whose works are dropped complete all the same, and the progress thread lets go
        # of their requests and buffers
        for i in range(40):
            if comm.rank == 0:
                comm.send(torch.full((64,), float(i)), 1, async_op=True)
            elif comm.rank == 1:
                got = torch.zeros(64)
                comm.recv(got, 0)
                assert got[0].item() == i
        comm.barrier()
        pending: list[object] = comm._progress._transfers  # type: ignore[attr-defined]
        deadline = time.monotonic() + 10
        while pending and time.monotonic() < deadline:
            time.sleep(0.01)
            pending = comm._progress._transfers  # type: ignore[attr-defined]
        assert not pending, pending
        checks += 4
    for adapter in device_adapters():
        comm._adapter = adapter  # type: ignore[attr-defined]
        checks += run_p2p_checks(comm)
    comm._adapter = None  # type: ignore[attr-defined]
    return checks

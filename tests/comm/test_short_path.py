"""The collectives' short path (gradcomm/comm/_issue.py) against their general path.

A collective's or transfer's common call skips the general checks once its tensors' dtype is
cached.
These tests make the same calls on a fresh communicator (nothing cached: the general path) and on
one warmed by good calls of every collective (cached: the short path where it applies), on thread
ranks, and compare what they raise and return; then that the profiler and debug mode still see
calls made after the cache is warm.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from ranks import RankRunner

from gradcomm.comm import Communicator, P2POp, ReduceOp
from gradcomm.comm.backends._threads import ThreadGroup

Call = Callable[[Communicator], object]


def _rooted_and_shard_ops(comm: Communicator, big: torch.Tensor, small: torch.Tensor) -> None:
    """One good call of each collective but all_reduce, in a fixed order (2 ranks: ``big`` holds
    two of ``small``)."""
    comm.broadcast(big, 0)
    comm.all_gather(big, small)
    comm.reduce_scatter(small, big)
    comm.all_to_all(big.clone(), big)
    comm.reduce(big, 0)
    comm.gather(big if comm.rank == 0 else None, small, 0)
    comm.scatter(small, big if comm.rank == 0 else None, 0)


def _transfers(comm: Communicator, sent: torch.Tensor, got: torch.Tensor) -> None:
    """A send/recv exchange with the other rank (2 ranks), then the same as one batch."""
    peer = 1 - comm.rank
    work = comm.recv(got, peer, async_op=True)
    comm.send(sent, peer)
    work.wait()
    for w in comm.batch_isend_irecv([P2POp("send", sent, peer), P2POp("recv", got, peer)]):
        w.wait()


def _warm(comm: Communicator) -> None:
    """One good call of each collective and transfer on float32 and int64: their kinds are then
    cached."""
    for dtype in (torch.float32, torch.int64):
        big, small = torch.ones(4, dtype=dtype), torch.ones(2, dtype=dtype)
        comm.all_reduce(small)
        _rooted_and_shard_ops(comm, big, small)
        _transfers(comm, big, big.clone())


def _bad_calls() -> list[Call]:
    """Calls that raise on every rank (none of them reaches a transport)."""
    f, i = torch.ones(4), torch.ones(4, dtype=torch.int64)
    h = torch.ones(2)
    wide = torch.ones(1).expand(4)  # elements sharing memory
    return [
        lambda c: c.broadcast(f, 2),
        lambda c: c.broadcast(f, True),
        lambda c: c.broadcast(f, 0, async_op="no"),
        lambda c: c.broadcast(wide, 0),
        lambda c: c.broadcast([1.0], 0),
        lambda c: c.all_gather(torch.ones(3), h),
        lambda c: c.all_gather(f, torch.ones(2, dtype=torch.float64)),
        lambda c: c.all_gather(f, h, async_op=1),
        lambda c: c.all_gather(wide, h),
        lambda c: c.reduce_scatter(h, torch.ones(3)),
        lambda c: c.reduce_scatter(torch.ones(2, dtype=torch.int64), i, ReduceOp.AVG),
        lambda c: c.reduce_scatter(h, f, "bogus"),
        lambda c: c.reduce_scatter(h, f, label=5),
        lambda c: c.reduce_scatter(h, i),
        lambda c: c.all_to_all(f.clone(), torch.ones(3)),
        lambda c: c.all_to_all(torch.ones(4, 2), f),
        lambda c: c.all_to_all(f.clone(), i),
        lambda c: c.all_to_all(f.clone(), f, [1, 1], [2]),
        lambda c: c.reduce(f, -1),
        lambda c: c.reduce(f, 1.0),
        lambda c: c.reduce(i, 0, ReduceOp.AVG),
        lambda c: c.reduce(f, 0, label=b"x"),
        lambda c: c.gather(f, h, 5),
        lambda c: c.gather(f, h, "0"),
        lambda c: c.gather(f, h, 0, async_op=None),
        lambda c: c.scatter(h, f, -2),
        lambda c: c.scatter(wide, f, 0),
        lambda c: c.send(f, c.rank),
        lambda c: c.send(f, 2),
        lambda c: c.send(f, True),
        lambda c: c.send(f, 1 - c.rank, tag=-1),
        lambda c: c.send(f, 1 - c.rank, tag=1 << 15),
        lambda c: c.send(f, 1 - c.rank, tag=1.0),
        lambda c: c.send(f, 1 - c.rank, async_op="no"),
        lambda c: c.recv(wide, 1 - c.rank),
        lambda c: c.recv(f, c.rank),
        lambda c: c.recv(f, 1 - c.rank, tag=False),
        lambda c: c.batch_isend_irecv([P2POp("send", f, 1 - c.rank), P2POp("recv", f, c.rank)]),
        lambda c: c.batch_isend_irecv([P2POp("recv", wide, 1 - c.rank)]),
        lambda c: c.batch_isend_irecv((P2POp("send", f, 1 - c.rank), f)),
    ]


def _outcomes(comm: Communicator, calls: list[Call]) -> list[tuple[str, str]]:
    out = []
    for call in calls:
        with pytest.raises(Exception) as info:  # type and text compared below
            call(comm)
        out.append((type(info.value).__name__, str(info.value)))
    return out


def test_bad_calls_raise_the_same_after_the_kinds_are_cached() -> None:
    calls = _bad_calls()

    def cold(comm: Communicator) -> list[tuple[str, str]]:
        return _outcomes(comm, calls)

    def warm(comm: Communicator) -> list[tuple[str, str]]:
        _warm(comm)
        return _outcomes(comm, calls)

    fresh, cached = ThreadGroup(2).run(cold), ThreadGroup(2).run(warm)
    assert fresh == cached
    assert len(fresh[0]) == len(calls)
    assert ("ValueError", "src must be in [0, 2), got 2") in fresh[0]


def test_calls_on_a_closed_communicator_raise_after_the_kinds_are_cached() -> None:
    def run(comm: Communicator) -> list[tuple[str, str]]:
        _warm(comm)
        comm.close()
        f, h = torch.ones(4), torch.ones(2)
        return _outcomes(comm, [
            lambda c: c.broadcast(f, 0), lambda c: c.all_gather(f, h),
            lambda c: c.reduce_scatter(h, f), lambda c: c.all_to_all(f.clone(), f),
            lambda c: c.reduce(f, 0), lambda c: c.gather(f, h, 1), lambda c: c.scatter(h, f, 1),
            lambda c: c.send(f, 1 - c.rank), lambda c: c.recv(f, 1 - c.rank),
            lambda c: c.batch_isend_irecv([P2POp("send", f, 1 - c.rank)]),
        ])

    for outcomes in ThreadGroup(2).run(run):
        assert outcomes == [("RuntimeError", "threads communicator is closed")] * 10


def awkward_calls(comm: Communicator) -> dict[str, list[float]]:
    """Results of warm calls on tensors the short path must leave to the general path: non-
    contiguous, sign-bit views, inputs that overlap outputs."""
    _warm(comm)
    r = float(comm.rank + 1)
    got: dict[str, list[float]] = {}
    out = torch.zeros(4, 2)[:, 0]  # non-contiguous output
    comm.all_gather(out, torch.full((2,), r))
    got["all_gather strided"] = out.tolist()
    buf = torch.zeros(4)
    buf[2 * comm.rank:2 * comm.rank + 2] = r
    comm.all_gather(buf, buf[2 * comm.rank:2 * comm.rank + 2])  # input is the own slot
    got["all_gather overlap"] = buf.tolist()
    inp = torch.full((4,), r)
    comm.reduce_scatter(inp[:2], inp)  # output is part of input
    got["reduce_scatter overlap"] = inp[:2].tolist()
    neg = torch.full((4,), r, dtype=torch.complex64).conj().imag  # a negative-bit view of zeros
    neg_src = torch.full((4,), r).neg()
    comm.broadcast(neg_src, 1)
    got["broadcast neg"] = neg_src.tolist() + neg.tolist()
    a2a = torch.zeros(2, 4)[:, 0:2].t()  # (2, 2) non-contiguous
    comm.all_to_all(a2a, torch.tensor([[r, r], [r * 10, r * 10]]))
    got["all_to_all strided"] = a2a.reshape(-1).tolist()
    red = torch.full((4, 2), r)[:, 1]
    comm.reduce(red, 0)
    got["reduce strided"] = red.tolist() if comm.rank == 0 else []
    gat = torch.zeros(4)
    if comm.rank == 0:
        gat[:2] = r
    comm.gather(gat if comm.rank == 0 else None, gat[:2] if comm.rank == 0 else torch.full(
        (2,), r), 0)
    got["gather overlap"] = gat.tolist() if comm.rank == 0 else []
    sc = torch.zeros(4, 2)[:, 0][:2]
    comm.scatter(sc, torch.arange(4.0) if comm.rank == 0 else None, 0)
    got["scatter strided"] = sc.tolist()
    into = torch.zeros(4, 2)[:, 1]  # a non-contiguous receive buffer
    _transfers(comm, torch.full((4, 2), r)[:, 0], into)  # and a non-contiguous send
    got["transfers strided"] = into.tolist()
    neg_into = torch.zeros(4)
    _transfers(comm, torch.full((4,), r, dtype=torch.complex64).conj().imag, neg_into)
    got["transfers neg"] = neg_into.tolist()
    param = torch.nn.Parameter(torch.zeros(2))  # a leaf that requires grad, written in place
    comm.reduce_scatter(param, torch.full((4,), r))
    got["reduce_scatter parameter"] = param.tolist()
    return got


def test_awkward_tensors_after_the_kinds_are_cached_give_the_right_results(
        comm_runner: RankRunner) -> None:
    """On every backend: MPI rejects aliased buffers, which thread ranks do not see."""
    first, second = comm_runner(awkward_calls, 2)
    assert first["all_gather strided"] == second["all_gather strided"] == [1, 1, 2, 2]
    assert first["all_gather overlap"] == second["all_gather overlap"] == [1, 1, 2, 2]
    assert first["reduce_scatter overlap"] == [3, 3]
    assert second["reduce_scatter overlap"] == [3, 3]
    assert first["broadcast neg"] == second["broadcast neg"] == [-2] * 4 + [-0.0] * 4
    assert first["all_to_all strided"] == [1, 1, 2, 2]
    assert second["all_to_all strided"] == [10, 10, 20, 20]
    assert first["reduce strided"] == [3, 3, 3, 3]
    assert first["gather overlap"] == [1, 1, 2, 2]
    assert first["scatter strided"] == [0, 1] and second["scatter strided"] == [2, 3]
    assert first["transfers strided"] == [2.0] * 4 and second["transfers strided"] == [1.0] * 4
    assert first["transfers neg"] == second["transfers neg"] == [-0.0] * 4
    assert first["reduce_scatter parameter"] == second["reduce_scatter parameter"] == [3.0, 3.0]


def test_profiler_and_debug_see_calls_made_after_the_kinds_are_cached() -> None:
    from gradcomm.profiler import Profiler

    def run(comm: Communicator) -> tuple[list[str], str]:
        _warm(comm)
        prof = Profiler(comm).attach()
        f = torch.ones(4)
        _rooted_and_shard_ops(comm, f, torch.ones(2))
        _transfers(comm, f, f.clone())
        prof.detach()
        comm.debug = "detail"
        with pytest.raises(RuntimeError) as info:
            comm.broadcast(f, comm.rank)  # the ranks disagree on the root
        return [r.op for r in prof.records], str(info.value)

    for ops, error in ThreadGroup(2).run(run):
        assert ops[:7] == ["broadcast", "all_gather", "reduce_scatter", "all_to_all", "reduce",
                           "gather", "scatter"]
        assert sorted(ops[7:]) == ["recv", "recv", "send", "send"]
        assert "first difference in root" in error


def test_good_calls_take_the_short_path_once_the_kinds_are_cached() -> None:
    """What makes the tests above compare two paths: warm calls skip the general checks."""

    def boom(*args: object, **kwargs: object) -> str:
        raise AssertionError("general path taken")

    def run(comm: Communicator) -> list[float]:
        _warm(comm)
        comm._check_tensor = boom  # type: ignore[method-assign]
        f, h = torch.ones(4), torch.ones(2)
        comm.broadcast(f, 0)
        comm.all_gather(f, h)
        comm.reduce_scatter(h, f)
        comm.all_to_all(f.clone(), f)
        comm.reduce(f, 0, ReduceOp.MAX)
        comm.gather(f if comm.rank == 0 else None, h, 0)
        comm.scatter(h, f if comm.rank == 0 else None, 0)
        got = torch.zeros(2)
        _transfers(comm, torch.full((2,), float(comm.rank)), got)
        return h.tolist() + got.tolist()

    # gathered and scattered back; the other rank's values
    assert ThreadGroup(2).run(run) == [[2.0, 2.0, 1.0, 1.0], [2.0, 2.0, 0.0, 0.0]]

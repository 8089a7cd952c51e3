"""ProcessGroupGradcomm on in-process thread ranks: every operation's values against a
one-process reference, the works' futures and errors, timeouts, and shutdown.

The groups are built directly over gradcomm's thread backend (no init_process_group, so no
process is started): each rank is a thread that calls the group's methods as torch's functions do.
"""

from __future__ import annotations

import datetime
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
import torch
import torch.distributed as dist

from gradcomm.comm import CollectiveTimeoutError, Work
from gradcomm.comm.backends.threads import ThreadCommunicator, ThreadGroup
from gradcomm.comm.work import DescriptionLike
from gradcomm.torch_backend import GradcommWork, ProcessGroupGradcomm

N = 3


def on_ranks(fn: Callable[[ProcessGroupGradcomm, int], Any], n: int = N,
             timeout: float = 20.0, group_timeout: float | None = None) -> list[Any]:
    """``fn(group, rank)`` on ``n`` thread ranks; each group shut down afterwards."""
    threads = ThreadGroup(n, timeout=timeout)
    groups = [ProcessGroupGradcomm(r, n, {"cpu": threads.communicator(r)}, f"t{r}",
                                   group_timeout or timeout) for r in range(n)]
    with ThreadPoolExecutor(n) as pool:
        try:
            return list(pool.map(fn, groups, range(n), timeout=timeout * 2))
        finally:
            for g in groups:
                g.shutdown()


def rank_data(rank: int, *shape: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(rank))


def _op(kind: dist.ReduceOp.RedOpType | dist.ReduceOp, cls: type = dist.AllreduceOptions) -> Any:
    opts = cls()
    opts.reduceOp = kind
    return opts


def test_reductions_equal_the_one_process_sums() -> None:
    parts = [rank_data(r, 4, 2) for r in range(N)]
    total = parts[0] + parts[1] + parts[2]

    def body(g: ProcessGroupGradcomm, r: int) -> list[torch.Tensor]:
        out = []
        for kind in (dist.ReduceOp.SUM, dist.ReduceOp.AVG, dist.ReduceOp.PREMUL_SUM(0.5)):
            t = parts[r].clone()
            g.allreduce([t], _op(kind)).wait()
            out.append(t)
        rs = torch.empty(2)
        g.reduce_scatter_single(rs, parts[r].reshape(-1)[:6], _op(dist.ReduceOp.PREMUL_SUM(2.0),
                                                               dist.ReduceScatterOptions)).wait()
        out.append(rs)
        listed = torch.empty(2)
        g.reduce_scatter([listed], [list(parts[r].reshape(-1)[:6].split(2))],
                         _op(dist.ReduceOp.SUM, dist.ReduceScatterOptions)).wait()
        out.append(listed)
        red = parts[r].clone()
        opts = _op(dist.ReduceOp.MAX, dist.ReduceOptions)
        opts.rootRank = 1
        g.reduce([red], opts).wait()
        out.append(red)
        return out

    results = on_ranks(body)
    flat = total.reshape(-1)[:6]
    for r, (s, avg, premul, rs, listed, red) in enumerate(results):
        torch.testing.assert_close(s, total)
        torch.testing.assert_close(avg, total / N)
        torch.testing.assert_close(premul, total * 0.5)
        torch.testing.assert_close(rs, 2.0 * flat[2 * r:2 * r + 2])
        torch.testing.assert_close(listed, flat[2 * r:2 * r + 2])
        if r == 1:
            assert torch.equal(red, torch.stack(parts).amax(0))


def test_data_movement_equals_the_one_process_layout() -> None:
    def body(g: ProcessGroupGradcomm, r: int) -> dict[str, torch.Tensor]:
        got: dict[str, torch.Tensor] = {}
        b = torch.full((3,), float(r))
        opts = dist.BroadcastOptions()
        opts.rootRank = 2
        g.broadcast([b], opts).wait()
        got["broadcast"] = b
        uneven = [torch.empty(i + 1) for i in range(N)]
        g.allgather([uneven], [torch.full((r + 1,), float(r))]).wait()
        got["allgather"] = torch.cat(uneven)
        coalesced = [[torch.empty(2), torch.empty(1, 3)] for _ in range(N)]  # [rank][input]
        g.allgather_coalesced(coalesced, [torch.full((2,), float(r)),
                                          torch.full((1, 3), -float(r))]).wait()
        got["allgather_coalesced"] = torch.cat([torch.cat([a, b.reshape(-1)])
                                                for a, b in coalesced])
        single = torch.empty(N * 2)
        g.all_gather_single(single, torch.full((2,), float(r))).wait()
        got["all_gather_single"] = single
        outs = [torch.empty(1) for _ in range(N)]
        g.alltoall(outs, [torch.tensor([10.0 * r + j]) for j in range(N)]).wait()
        got["alltoall"] = torch.cat(outs)
        out = torch.empty(N)
        g.all_to_all_single(out, torch.arange(float(N)) + 10 * r, [], []).wait()
        got["all_to_all_single"] = out
        gathered = [torch.empty(2) for _ in range(N)]
        gopts = dist.GatherOptions()
        gopts.rootRank = 0
        g.gather([gathered] if r == 0 else [], [torch.full((2,), float(r))], gopts).wait()
        got["gather"] = torch.cat(gathered) if r == 0 else torch.zeros(0)
        sc = torch.empty(2)
        sopts = dist.ScatterOptions()
        sopts.rootRank = 1
        g.scatter([sc], [[torch.full((2,), float(j)) for j in range(N)]] if r == 1 else [],
                  sopts).wait()
        got["scatter"] = sc
        g.barrier().wait()
        return got

    results = on_ranks(body)
    for r, got in enumerate(results):
        assert torch.equal(got["broadcast"], torch.full((3,), 2.0))
        assert torch.equal(got["allgather"], torch.tensor([0.0, 1, 1, 2, 2, 2]))
        assert torch.equal(got["all_gather_single"], torch.tensor([0.0, 0, 1, 1, 2, 2]))
        assert torch.equal(got["allgather_coalesced"], torch.cat(
            [torch.tensor([float(j)] * 2 + [-float(j)] * 3) for j in range(N)]))
        assert torch.equal(got["alltoall"], torch.tensor([float(10 * j + r) for j in range(N)]))
        assert torch.equal(got["all_to_all_single"], torch.tensor([10.0 * j + r for j in range(N)]))
        assert r != 0 or torch.equal(got["gather"], torch.tensor([0.0, 0, 1, 1, 2, 2]))
        assert torch.equal(got["scatter"], torch.full((2,), float(r)))


def test_both_ranks_send_before_receiving_without_blocking() -> None:
    def body(g: ProcessGroupGradcomm, r: int) -> torch.Tensor:
        got = torch.empty(5)
        send = g.send([torch.full((5,), float(r))], 1 - r, 7)
        recv = g.recv([got], 1 - r, 7)
        send.wait()
        recv.wait()
        assert recv.source_rank() == 1 - r
        return got

    assert [t[0].item() for t in on_ranks(body, n=2)] == [1.0, 0.0]


class _GlooTransfer(Work):
    """A gloo send as torch's ProcessGroupGloo has it: done only inside wait(), done for
    is_completed() once a wait has returned in C++, and a second wait() blocks until gloo's
    timeout (here it raises). Its first wait pauses between the two (where Python had not yet
    taken the GIL back) until ``resume`` is set."""

    def __init__(self, description: DescriptionLike, resume: threading.Event) -> None:
        super().__init__(description, None)
        self.resume = resume
        self.transport_done = threading.Event()
        self.waited_twice = False

    def _wait(self, timeout: float | None) -> None:
        if self.transport_done.is_set():
            self.waited_twice = True
            raise RuntimeError("a gloo transfer waited twice blocks until gloo's timeout")
        self.transport_done.set()
        assert self.resume.wait(10)

    def _test(self) -> bool:
        if not self.transport_done.is_set():
            return False
        self._wait(None)  # as TorchWork._test does once torch's work is completed
        return True


class _GlooLikeThreads(ThreadCommunicator):
    """Rank 0 of a thread group, named gloo (so the group waits its works on delivery threads),
    whose sends are :class:`_GlooTransfer`."""

    backend = "gloo"

    def __init__(self) -> None:
        super().__init__(ThreadGroup(2, timeout=10.0), 0)
        self.resume = threading.Event()
        self.sends: list[_GlooTransfer] = []

    def _send(self, tensor: torch.Tensor, dst: int, tag: int, description: DescriptionLike
              ) -> Work:
        self.sends.append(_GlooTransfer(description, self.resume))
        return self.sends[-1]


def test_an_operation_leaves_alone_a_transfer_waited_for_on_a_delivery_thread() -> None:
    """The engine's thread posting the next operation must not test a work that a delivery
    thread is waiting for: on gloo, a send whose wait had just returned was waited for a second
    time there, which blocks until gloo's timeout (30 min by default), and both ranks hung."""
    comm = _GlooLikeThreads()
    g = ProcessGroupGradcomm(0, 2, {"cpu": comm}, "gloo-like", 10.0)
    try:
        first = g.send([torch.ones(2)], 1, 0)
        assert _until(lambda: bool(comm.sends) and comm.sends[0].transport_done.is_set())
        second = g.send([torch.ones(2)], 1, 0)  # posted while the first's wait returns
        assert _until(lambda: len(comm.sends) == 2)
        comm.resume.set()
        first.wait(datetime.timedelta(seconds=10))
        second.wait(datetime.timedelta(seconds=10))
        assert not comm.sends[0].waited_twice
    finally:
        comm.resume.set()
        g.shutdown()


def _until(condition: Callable[[], bool], timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.001)
    return True


def test_future_completes_by_itself_off_the_engine_thread_with_the_tensors() -> None:
    def body(g: ProcessGroupGradcomm, r: int) -> tuple[list[torch.Tensor], str]:
        t = torch.ones(2)
        seen: list[str] = []
        done = threading.Event()
        fut = g.allreduce([t]).get_future()

        def callback(f: torch.futures.Future[list[torch.Tensor]]) -> None:
            seen.append(threading.current_thread().name)
            done.set()

        fut.add_done_callback(callback)
        assert done.wait(10)  # nobody called wait() on the work
        return fut.value(), seen[0]

    for value, thread in on_ranks(body):
        assert isinstance(value, list) and torch.equal(value[0], torch.full((2,), float(N)))
        assert "deliver" in thread, thread


def test_a_callback_may_wait_for_a_later_operation() -> None:
    """torch's PowerSGD hook waits for one all-reduce inside the callback of another."""
    def body(g: ProcessGroupGradcomm, r: int) -> float:
        p, q = torch.ones(1), torch.ones(1)

        def then(f: torch.futures.Future[list[torch.Tensor]]) -> torch.Tensor:
            return g.allreduce([q]).get_future().wait()[0] + f.value()[0]

        return float(g.allreduce([p]).get_future().then(then).wait().item())

    assert on_ranks(body) == [2.0 * N] * N


def test_a_failed_operation_fails_its_work_its_future_and_what_chains_on_it() -> None:
    def body(g: ProcessGroupGradcomm, r: int) -> list[str]:
        work = g.allreduce([torch.ones(2).to_sparse()])  # gradcomm refuses sparse tensors
        chained = work.get_future().then(lambda f: f.value())
        errors = []
        for waiter in (work.wait, work.get_future().wait, chained.wait):
            with pytest.raises(Exception) as info:
                waiter()
            errors.append(str(info.value))
        assert work.is_completed() and not work.is_success()
        assert work.exception() is not None
        t = torch.ones(1)
        g.allreduce([t]).wait()  # the group still works
        assert t.item() == N
        return errors

    for errors in on_ranks(body):
        assert all("sparse" in e for e in errors), errors


def test_unsupported_reduce_op_and_device_raise_at_once() -> None:
    threads = ThreadGroup(1)
    g = ProcessGroupGradcomm(0, 1, {"cpu": threads.communicator(0)}, "one", 5.0)
    try:
        with pytest.raises(ValueError, match="BXOR"):
            g.allreduce([torch.ones(1, dtype=torch.int32)], _op(dist.ReduceOp.BXOR))
        with pytest.raises(ValueError, match="no transport for meta tensors"):
            g.allreduce([torch.ones(1, device="meta")])
        with pytest.raises(NotImplementedError, match="named rank"):
            g.recv_anysource([torch.ones(1)], 0)
    finally:
        g.shutdown()


def test_a_peer_that_never_comes_is_an_error_within_the_group_timeout() -> None:
    def body(g: ProcessGroupGradcomm, r: int) -> float:
        if r == 1:
            return 0.0
        start = time.monotonic()
        work = g.allreduce([torch.ones(1)])
        with pytest.raises(CollectiveTimeoutError, match="wait timed out"):
            work.wait(datetime.timedelta(milliseconds=100))  # the wait's own limit
        with pytest.raises(CollectiveTimeoutError):
            work.wait()  # the group's timeout ends the operation itself
        return time.monotonic() - start

    took = on_ranks(body, n=2, timeout=20.0, group_timeout=1.0)[0]
    assert 0.9 < took < 10, took


def test_a_receive_whose_sender_never_comes_fails_at_the_group_timeout() -> None:
    def body(g: ProcessGroupGradcomm, r: int) -> float:
        if r == 1:
            return 0.0
        start = time.monotonic()
        work = g.recv([torch.empty(3)], 1, 0)
        with pytest.raises(CollectiveTimeoutError,
                           match=r"^recv .* within 1.0 s \(the process group's timeout\)"):
            work.wait()
        return time.monotonic() - start

    took = on_ranks(body, n=2, timeout=20.0, group_timeout=1.0)[0]
    assert 0.9 < took < 10, took


def test_shutdown_joins_every_thread_and_later_calls_raise() -> None:
    before = {t.name for t in threading.enumerate()}
    threads = ThreadGroup(1)
    g = ProcessGroupGradcomm(0, 1, {"cpu": threads.communicator(0)}, "solo", 5.0)
    t = torch.ones(1)
    g.allreduce([t]).wait()
    g.shutdown()
    g.shutdown()  # idempotent
    left = [t.name for t in threading.enumerate()
            if t.name not in before and t.name.startswith("gradcomm-solo")]
    assert left == []
    with pytest.raises(RuntimeError, match="shut down"):
        g.allreduce([t])


def test_work_repr_and_result() -> None:
    work = GradcommWork([torch.ones(1)], "allreduce of 1 torch.float32 on cpu")
    assert "pending" in repr(work) and not work.is_completed()
    work.complete(None)
    assert "completed" in repr(work) and work.result()[0].item() == 1.0

"""The collective interface's edges on each backend: thread ranks (bad input issues no collective,
timeouts, callbacks, work descriptions), world size one, and gloo processes whose peer stops,
closes or joins late. The conformance suite every backend passes is the module tier's
(``tests/comm/suite_collectives.py``, run by ``test_rank_suites.py``).
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch

import gradcomm
from gradcomm.comm import CollectiveTimeoutError, Communicator, ReduceOp
from gradcomm.comm.backends.threads import ThreadGroup
from gradcomm.comm.work import Description

from tests._support.dist_utils import run_processes
from tests.comm.suite_collectives import check_bad_input


def _wait_for(flag: Path, limit: float = 60.0) -> None:
    """Wait until another rank creates ``flag`` (at most ``limit`` seconds)."""
    deadline = time.monotonic() + limit
    while not flag.exists() and time.monotonic() < deadline:
        time.sleep(0.01)


# ----------------------------------------------------------------------------- thread backend


def test_thread_backend_bad_input_issues_no_collective() -> None:
    group = ThreadGroup(2, timeout=10)

    def body(comm: Communicator) -> None:
        check_bad_input(comm)
        with pytest.raises(TypeError, match="AVG"):
            comm.all_reduce(torch.arange(3), ReduceOp.AVG)

    group.run(body)
    assert group.calls == [0, 0]


def test_world_size_one_issues_no_collective() -> None:
    group = ThreadGroup(1)
    comm = group.communicator(0)
    t = torch.arange(5.0)
    for op in ReduceOp:
        assert comm.all_reduce(t, op).is_completed()
    comm.all_reduce(t[::2], ReduceOp.AVG, async_op=True).wait()
    comm.broadcast(t, src=0)
    out = torch.empty(5)
    comm.all_gather(out, t)
    comm.barrier()
    assert torch.equal(t, torch.arange(5.0)) and torch.equal(out, t)
    with pytest.raises(TypeError, match="AVG"):
        comm.all_reduce(torch.arange(3), ReduceOp.AVG)  # still validated at world_size 1
    with pytest.raises(ValueError, match="src"):
        comm.broadcast(t, src=1)
    assert group.calls == [0]
    comm.close()


def test_thread_backend_timeout() -> None:
    group = ThreadGroup(2, timeout=1.0)

    def body(comm: Communicator) -> str:
        if comm.rank == 1:
            return "idle"  # never joins the collective
        with pytest.raises(CollectiveTimeoutError, match="all_reduce"):
            comm.all_reduce(torch.ones(3))
        return "timed out"

    assert group.run(body) == ["timed out", "idle"]


def test_a_raising_callback_does_not_drop_the_others_and_wait_keeps_raising() -> None:
    group = ThreadGroup(2, timeout=30)

    def body(comm: Communicator) -> object:
        t = torch.ones(2, 3)[:, 0]  # non-contiguous: its copy-back is a callback added first
        work = comm.all_reduce(t, async_op=True)
        ran: list[str] = []

        def bad() -> None:
            raise ValueError("deliberate callback failure")

        work.add_callback(bad)
        work.add_callback(lambda: ran.append("later"))
        errors = []
        for _ in range(2):
            with pytest.raises(ValueError, match="deliberate") as info:
                work.wait()
            errors.append(info.value)
        assert errors[0] is errors[1]
        assert work.is_completed()
        return ran, t.tolist()

    assert group.run(body) == [(["later"], [2.0, 2.0])] * 2


def test_barrier_timeout_names_the_rank() -> None:
    group = ThreadGroup(2, timeout=1.0)

    def body(comm: Communicator) -> str:
        if comm.rank == 1:
            return "idle"
        with pytest.raises(CollectiveTimeoutError, match=r"barrier #0 \(threads, rank 0/2\)"):
            comm.barrier()
        return "timed out"

    assert group.run(body) == ["timed out", "idle"]


def test_work_descriptions_name_each_collective_and_are_formatted_only_when_read() -> None:
    reads: list[int] = []

    class CountingOp:
        @property
        def name(self) -> str:
            reads.append(1)
            return "SUM"

    d = Description("all_reduce", 3, 1024, " torch.float32 on cpu (mpi, rank 0/2)",
                    CountingOp(), "bucket 0")
    assert reads == []  # building one formats nothing
    text = "all_reduce #3 SUM bucket 0 of 1024 torch.float32 on cpu (mpi, rank 0/2)"
    assert str(d) == text and str(d) == text and repr(d) == repr(text)
    assert reads == [1]  # formatted once
    assert str(Description("broadcast", 0, 5, " torch.int64 on cpu", "src=1")) == (
        "broadcast #0 src=1 of 5 torch.int64 on cpu")

    group = ThreadGroup(2, timeout=30)

    def body(comm: Communicator) -> list[str]:
        works = [comm.all_reduce(torch.ones(4), ReduceOp.MAX, async_op=True, label="bucket 7"),
                 comm.broadcast(torch.ones(3), src=1, async_op=True),
                 comm.all_gather(torch.empty(4), torch.ones(2), async_op=True),
                 comm.all_reduce(torch.ones(2, 3)[:, 0], async_op=True)]
        for w in works:
            w.wait()
        return [w.description for w in works]

    for rank, descriptions in enumerate(group.run(body)):
        tail = f" torch.float32 on cpu (threads, rank {rank}/2)"
        assert descriptions == [f"all_reduce #0 MAX bucket 7 of 4{tail}",
                                f"broadcast #1 src=1 of 3{tail}",
                                f"all_gather #2 of 2{tail}",
                                f"all_reduce #3 SUM of 2{tail}"]
        assert all(type(d) is str for d in descriptions)


def test_reduce_op_coerce() -> None:
    assert ReduceOp.coerce("AVG") is ReduceOp.AVG
    assert ReduceOp.coerce(" product ") is ReduceOp.PRODUCT
    assert ReduceOp.coerce(ReduceOp.MIN) is ReduceOp.MIN


# ----------------------------------------------------------------------------- gloo processes
def test_gloo_world_size_one() -> None:
    with gradcomm.init("gloo", rank=0, world_size=1, timeout=10) as comm:
        assert comm.process_group is None  # type: ignore[attr-defined]  # no transport at all
        t = torch.arange(6.0).view(2, 3)
        for op in ReduceOp:
            comm.all_reduce(t, op)
        comm.broadcast(t, src=0)
        out = torch.empty(6)
        comm.all_gather(out, t)
        comm.barrier()
        assert torch.equal(t, torch.arange(6.0).view(2, 3)) and torch.equal(out, t.view(-1))


def _gloo_timeout(rank: int, world_size: int, timeout: float, flag: str) -> float | str:
    done = Path(flag)
    with gradcomm.init("gloo", timeout=timeout) as comm:
        comm.barrier()  # both ranks are connected
        if rank == 1:
            # Stop calling collectives; leave only once rank 0 has seen its error (or after 60 s).
            _wait_for(done)
            return "idle"
        start = time.monotonic()
        try:
            comm.all_reduce(torch.ones(100), label="bucket 0")
        except CollectiveTimeoutError as exc:
            elapsed = time.monotonic() - start
            assert "all_reduce" in str(exc) and "bucket 0" in str(exc), str(exc)
            return elapsed
        finally:
            done.touch()
        return "no error"


@pytest.mark.slow
@pytest.mark.multiprocess
def test_gloo_rank_that_stops_calling_times_out_the_others(tmp_path: Path) -> None:
    timeout = 3.0
    elapsed, idle = run_processes(
        _gloo_timeout, 2, timeout, str(tmp_path / "done"), timeout=90
    )
    assert idle == "idle"
    assert isinstance(elapsed, float), elapsed
    # It waited for the timeout, and raised within it plus a generous margin (no hang).
    assert timeout * 0.8 <= elapsed <= timeout + 20, elapsed


def _gloo_wait_timeout(rank: int, world_size: int, flag: str) -> object:
    late = Path(flag)
    with gradcomm.init("gloo", timeout=60) as comm:
        comm.barrier()
        t = torch.full((5,), float(rank + 1))
        if rank == 1:  # joins only after rank 0's short wait has timed out
            _wait_for(late)
            comm.all_reduce(t)
            after = torch.ones(2)
            comm.all_reduce(after)
            return t.tolist(), after.tolist()
        work = comm.all_reduce(t, async_op=True)
        try:
            with pytest.raises(CollectiveTimeoutError, match=r"within 1\.0 s"):
                work.wait(timeout=1.0)  # shorter than the communicator's 60 s
            assert not work.is_completed()
            # While it is pending, a new collective would queue behind it: refused at once.
            start = time.monotonic()
            with pytest.raises(RuntimeError, match=r"unusable while all_reduce #1 .* pending"):
                comm.all_reduce(torch.ones(2))
            assert time.monotonic() - start < 5
        finally:
            late.touch()
        work.wait()  # the collective itself is intact: it completes once rank 1 joins
        assert work.is_completed()
        after = torch.ones(2)
        comm.all_reduce(after)  # and the communicator is usable again
        return t.tolist(), after.tolist()


def _gloo_longer_wait(rank: int, world_size: int, flag: str) -> object:
    done = Path(flag)
    with gradcomm.init("gloo", timeout=1.0) as comm:
        comm.barrier()
        if rank == 1:  # never joins; leaves once rank 0 has its error
            _wait_for(done)
            return "idle"
        work = comm.all_reduce(torch.ones(2), async_op=True)
        start = time.monotonic()
        try:
            work.wait(timeout=float("inf"))
        except CollectiveTimeoutError as exc:
            return time.monotonic() - start, str(exc)
        finally:
            done.touch()
        return "no error"


@pytest.mark.slow
@pytest.mark.multiprocess
def test_gloo_wait_cannot_outlast_the_group_timeout_and_says_so(tmp_path: Path) -> None:
    # gloo ends the collective at the process group's timeout (init's) whatever the wait asks.
    (elapsed, message), idle = run_processes(_gloo_longer_wait, 2, str(tmp_path / "f"), timeout=90)
    assert idle == "idle"
    assert elapsed < 30, elapsed
    assert "within 1.0 s (the communicator's; the wait asked for no limit)" in message, message
    assert "the wait asked for no limit" in message, message


@pytest.mark.slow
@pytest.mark.multiprocess
def test_gloo_work_wait_timeout_then_complete(tmp_path: Path) -> None:
    out = run_processes(_gloo_wait_timeout, 2, str(tmp_path / "late"), timeout=90)
    assert out == [([3.0] * 5, [2.0, 2.0])] * 2


def _gloo_peer_closes(rank: int, world_size: int, flag: str) -> object:
    seen = Path(flag)
    with gradcomm.init("gloo", timeout=30) as comm:
        comm.barrier()
        if rank == 1:  # closes its connections instead of joining the all-reduce
            time.sleep(0.5)
            comm.close()
            _wait_for(seen)
            return "closed"
        t = torch.full((10,), 5.0)
        work = comm.all_reduce(t, async_op=True, label="probe")
        try:
            deadline = time.monotonic() + 25
            while time.monotonic() < deadline:
                try:
                    done = work.is_completed()
                except RuntimeError as exc:
                    # the failure is not reported as completion; wait() raises it again
                    with pytest.raises(RuntimeError, match="probe"):
                        work.wait()
                    return f"{type(exc).__name__}: {exc}"
                if done:
                    return f"reported complete, tensor {t.tolist()}"
                time.sleep(0.01)
            return "still pending"
        finally:
            seen.touch()


@pytest.mark.slow
@pytest.mark.multiprocess
def test_gloo_failed_collective_is_never_reported_complete(tmp_path: Path) -> None:
    # torch's Work.is_completed() is True for a failed collective too; ours must raise instead,
    # or a caller polling it would take the unreduced tensor as the result.
    error, closed = run_processes(_gloo_peer_closes, 2, str(tmp_path / "seen"), timeout=90)
    assert closed == "closed"
    assert error.startswith("RuntimeError: all_reduce #1 SUM probe of 10"), error
    assert "failed" in error, error


def test_wait_rejects_a_negative_timeout_even_when_complete() -> None:
    from gradcomm.comm.work import CompletedWork

    for bad in (-1, float("nan")):
        with pytest.raises(ValueError, match="timeout must be >= 0"):
            CompletedWork().wait(timeout=bad)
    CompletedWork().wait(timeout=float("inf"))  # forever: fine


def test_wait_with_infinite_timeout_waits_and_nan_is_refused() -> None:
    group = ThreadGroup(2, timeout=30)

    def body(comm: Communicator) -> list[float]:
        t = torch.ones(2)
        work = comm.all_reduce(t, async_op=True)
        with pytest.raises(ValueError, match="timeout must be >= 0"):
            work.wait(timeout=float("nan"))
        work.wait(timeout=float("inf"))
        return t.tolist()

    assert group.run(body) == [[2.0, 2.0]] * 2


def test_supports_takes_a_dtype_and_init_a_string_mapping() -> None:
    comm = ThreadGroup(1).communicator(0)
    with pytest.raises(TypeError, match=r"torch\.dtype"):
        comm.supports("float32")  # type: ignore[arg-type]
    assert comm.supports(torch.float32).is_supported
    for env in ([], {"RANK": 0, "WORLD_SIZE": "1"}):
        with pytest.raises(TypeError, match="env must be a mapping of str to str"):
            gradcomm.init("gloo", env=env)  # type: ignore[arg-type]


def test_async_op_label_and_wait_timeout_are_type_checked() -> None:
    # A truthy string used to make the call asynchronous silently; a string timeout failed
    # inside a comparison without naming the argument.
    comm = ThreadGroup(1).communicator(0)
    t = torch.ones(2)
    for call in (lambda: comm.all_reduce(t, async_op="no"),  # type: ignore[arg-type]
                 lambda: comm.broadcast(t, async_op=1),  # type: ignore[arg-type]
                 lambda: comm.all_gather(torch.empty(2), t, async_op=None)):  # type: ignore
        with pytest.raises(TypeError, match="async_op must be a Python bool"):
            call()
    with pytest.raises(TypeError, match="label must be a str or None"):
        comm.all_reduce(t, label=5)  # type: ignore[arg-type]
    work = comm.all_reduce(t, async_op=True, label="ok")
    for bad in ("1", True, [1]):
        with pytest.raises(TypeError, match="timeout must be a number of seconds or None"):
            work.wait(timeout=bad)  # type: ignore[arg-type]
    work.wait(timeout=1)
    assert torch.equal(t, torch.ones(2))


def test_callbacks_at_world_size_one_run_at_once_and_keep_inference_mode() -> None:
    # no collective is issued at world_size 1: the work is complete when it is returned
    with gradcomm.init("gloo", env={}) as comm:
        with torch.inference_mode():
            t = torch.ones(3)
        work = comm.all_reduce(t, async_op=True)
        work.add_callback(lambda: t.mul_(2))
        assert t.tolist() == [2.0, 2.0, 2.0]

        def bad() -> None:
            raise RuntimeError("deliberate")

        work.add_callback(bad)  # raised by wait(), as at world_size > 1
        with pytest.raises(RuntimeError, match="deliberate"):
            work.wait()

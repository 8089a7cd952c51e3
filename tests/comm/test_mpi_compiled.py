"""The MPI backend's compiled calls (gradcomm/comm/backends/mpi/compiled.py, _compiled*).

Under real ``mpiexec``: every blocking collective and ``batch_isend_irecv`` of plain tensors goes
through the compiled calls (the Python methods they would fall back to are made to raise) and
gives the reference values at 2-4 ranks; every call they must decline reaches the Python path;
a collective still pending after the compiled poll's budget, or whose peer never comes, is
handed to the Python path's wait; the works a compiled batch makes are those the Python path
makes. The set-up (switch, warning, build) is in test_mpi_compiled_setup.py.
"""

from __future__ import annotations

import contextlib
import re
import time
from collections.abc import Iterator
from typing import Any

import pytest
import ranks
import torch

from gradcomm import CollectiveTimeoutError
from gradcomm.comm import Communicator, P2POp, ReduceOp
from gradcomm.comm._p2p import PointToPoint
from gradcomm.comm.work import CompletedWork

pytest.importorskip("mpi4py")  # imported by the tests that need it: importing starts MPI

MPI_ONLY = pytest.mark.parametrize("comm_runner", [ranks.MPI], indirect=True)

#: The public methods with a compiled form, each with the Python method that runs when the
#: compiled one declines: the overridden method for CompiledCalls' collectives; the posting step
#: of the Python batch_isend_irecv (a patch of batch_isend_irecv itself would be called instead
#: of the compiled one, which honours patches and overrides).
COMPILED = {"all_reduce": "all_reduce", "reduce_scatter": "reduce_scatter",
            "all_gather": "all_gather", "all_to_all": "all_to_all", "broadcast": "broadcast",
            "reduce": "reduce", "gather": "gather", "scatter": "scatter",
            "batch_isend_irecv": "_post_batch"}


@contextlib.contextmanager
def python_path(comm: Communicator, record: list[str] | None = None) -> Iterator[None]:
    """Replace the Python methods the compiled calls fall back to: with ``record`` None each
    raises (so a call that returns went through the compiled calls); else each appends the name
    of the public method to ``record`` and runs."""
    from gradcomm.comm.backends.mpi.compiled_calls import CompiledCalls

    mro = type(comm).__mro__
    saved = []
    for name, patched in COMPILED.items():
        owner = next(c for c in mro[mro.index(CompiledCalls) + 1:] if patched in vars(c))
        original = vars(owner)[patched]

        def fallback(*args: Any, _name: str = name, _original: Any = original,
                     **kwargs: Any) -> Any:
            if record is None:
                raise AssertionError(f"{_name} took the Python path")
            record.append(_name)
            return _original(*args, **kwargs)

        saved.append((owner, patched, original))
        setattr(owner, patched, fallback)
    try:
        yield
    finally:
        for owner, name, original in saved:
            setattr(owner, name, original)


def every_op(comm: Communicator) -> dict[str, Any]:
    """One blocking call of each collective and a ring batch, through the compiled calls only."""
    n, r = comm.world_size, comm.rank
    out: dict[str, Any] = {"compiled": comm._compiled is not None}  # type: ignore[attr-defined]
    right, left = (r + 1) % n, (r - 1) % n
    for dtype in (torch.float32, torch.float64, torch.int64, torch.int32):
        comm.all_reduce(torch.zeros(1, dtype=dtype))  # the Python path checks and caches dtypes
    works = []
    with python_path(comm):
        for dtype in (torch.float32, torch.float64, torch.int64, torch.int32):
            t = torch.arange(6, dtype=dtype).reshape(2, 3) * (r + 1)
            works.append(comm.all_reduce(t))
            out[f"all_reduce {dtype}"] = t
        big = torch.arange(2 * n, dtype=torch.float64) + 100 * r
        out["reduce_scatter"] = torch.zeros(2, dtype=torch.float64)
        works.append(comm.reduce_scatter(out["reduce_scatter"], big))
        out["all_gather"] = torch.zeros(n, 3)
        works.append(comm.all_gather(out["all_gather"], torch.full((3,), float(r))))
        out["all_to_all"] = torch.zeros(2 * n, dtype=torch.int32)
        works.append(comm.all_to_all(out["all_to_all"],
                                     torch.arange(2 * n, dtype=torch.int32) + 10 * r))
        out["broadcast"] = torch.full((4,), float(r))
        works.append(comm.broadcast(out["broadcast"], n - 1))
        out["reduce"] = torch.full((3,), r + 1, dtype=torch.int64)
        works.append(comm.reduce(out["reduce"], 1 % n))
        out["gather"] = torch.zeros(2 * n) if r == 0 else None
        works.append(comm.gather(out["gather"], torch.full((2,), float(r)), 0))
        out["scatter"] = torch.zeros(2)
        works.append(comm.scatter(out["scatter"], torch.arange(2.0 * n) if r == 0 else None, 0))
        got = torch.zeros(3, dtype=torch.int64)
        ring = comm.batch_isend_irecv([P2POp("send", torch.full((3,), r, dtype=torch.int64),
                                             right), P2POp("recv", got, left)])
        out["ring kinds"] = [type(w).__name__ for w in ring]
        for w in ring:
            w.wait()
        out["ring"] = got
    out["works"] = [type(w) is CompletedWork and w.is_completed() for w in works]
    called: list[int] = []
    works[0].add_callback(lambda: called.append(1))  # a completed work runs it at once
    out["callback ran"] = called == [1]
    out["pending"] = len(comm._inflight)  # type: ignore[attr-defined]
    return out


@MPI_ONLY
@pytest.mark.parametrize("n", [2, 3, 4])
def test_every_compiled_call_gives_the_reference_values(comm_runner: ranks.RankRunner,
                                                        n: int) -> None:
    results = comm_runner(every_op, n, timeout=120)
    for r, got in enumerate(results):
        assert got["compiled"], "the compiled calls are off in this environment"
        for dtype in (torch.float32, torch.float64, torch.int64, torch.int32):
            ref = torch.arange(6, dtype=dtype).reshape(2, 3) * (n * (n + 1) // 2)
            assert torch.equal(got[f"all_reduce {dtype}"], ref)
        chunk = torch.arange(2 * r, 2 * r + 2, dtype=torch.float64)
        assert torch.equal(got["reduce_scatter"], chunk * n + 100 * sum(range(n)))
        assert torch.equal(got["all_gather"],
                           torch.arange(n, dtype=torch.float32)[:, None].expand(n, 3))
        ref_a2a = torch.cat([torch.arange(2 * r, 2 * r + 2, dtype=torch.int32) + 10 * k
                             for k in range(n)])
        assert torch.equal(got["all_to_all"], ref_a2a)
        assert torch.equal(got["broadcast"], torch.full((4,), float(n - 1)))
        if r == 1 % n:
            assert torch.equal(got["reduce"], torch.full((3,), n * (n + 1) // 2))
        if r == 0:
            assert torch.equal(got["gather"], torch.arange(n).repeat_interleave(2).float())
        assert torch.equal(got["scatter"], torch.tensor([2.0 * r, 2.0 * r + 1]))
        assert got["ring kinds"] == ["TransferWork", "TransferWork"]
        assert torch.equal(got["ring"], torch.full((3,), (r - 1) % n))
        assert all(got["works"]) and got["callback ran"] and got["pending"] == 0


def sub_communicators(comm: Communicator) -> dict[str, Any]:
    """4 ranks split in two pairs: a pair's compiled calls reduce over the pair; once the pair is
    closed, or gone, its calls decline (they hold the communicator weakly)."""
    import gc

    out: dict[str, Any] = {}
    sub = comm.split(comm.rank % 2)
    assert sub is not None
    t = torch.full((3,), float(comm.rank))
    sub.all_reduce(torch.zeros(1))  # the Python path checks float32 for the pair
    with python_path(sub):
        sub.all_reduce(t)
    out["sum"] = t
    calls = sub._compiled  # type: ignore[attr-defined]
    sub.close()
    out["closed"] = calls.all_reduce(t, None)
    del sub
    gc.collect()
    out["gone"] = calls.all_reduce(t, None)
    return out


@MPI_ONLY
def test_a_sub_communicator_has_its_own_compiled_calls(comm_runner: ranks.RankRunner) -> None:
    for r, got in enumerate(comm_runner(sub_communicators, 4, timeout=90)):
        assert torch.equal(got["sum"], torch.full((3,), float(r % 2 + r % 2 + 2)))
        assert got["closed"] is None and got["gone"] is None


class _Sub(torch.Tensor):
    pass


class _Op(P2POp):
    __slots__ = ()


def declined(comm: Communicator) -> list[str]:
    """Calls the compiled calls must decline (2 ranks); the Python methods that ran."""
    record: list[str] = []
    r, peer = comm.rank, 1 - comm.rank
    f = torch.ones(8)
    with python_path(comm, record):
        comm.all_reduce(torch.ones(4, dtype=torch.uint8))  # a dtype not checked before
        comm.all_reduce(f[::2])  # not contiguous
        comm.all_reduce(torch.ones(4, dtype=torch.float16))  # a dtype MPI does not sum
        comm.all_reduce(torch.ones(4, dtype=torch.bool))
        comm.all_reduce(f, async_op=True).wait()
        comm.all_reduce(f, ReduceOp.MAX)
        comm.all_reduce(f, "sum")  # a name: converted by the Python path
        comm.all_reduce(torch.ones(0))  # empty
        comm.all_reduce(f.as_subclass(_Sub))
        with pytest.raises(ValueError):
            comm.reduce_scatter(torch.zeros(3), f)  # wrong sizes
        comm.all_gather(f, f[4 * r:4 * r + 4])  # the input is a chunk of the output
        with pytest.raises(TypeError):
            comm.broadcast(f, True)  # type: ignore[arg-type]
        comm.gather(torch.zeros(8), torch.ones(4), 0)  # a buffer on the non-root rank too
        comm.all_to_all(torch.zeros(8), f, [4, 4], [4, 4])
        pending = comm.all_reduce(torch.ones(2), async_op=True)
        comm.broadcast(f, 0)  # something is pending
        pending.wait()
        comm.debug = "DETAIL"
        comm.all_reduce(f)
        comm.debug = "OFF"
        with pytest.raises(ValueError):
            comm.batch_isend_irecv([P2POp("send", f, r)])  # to self
        for w in comm.batch_isend_irecv([_Op("send", f, peer, tag=1),
                                         P2POp("recv", torch.zeros(8), peer, tag=1)]):
            w.wait()  # a subclass of P2POp
        with pytest.raises(ValueError):
            comm.batch_isend_irecv([P2POp("send", f, peer, tag=1 << 20)])
        for w in comm.batch_isend_irecv((P2POp("send", f, peer), P2POp("recv", f.clone(), peer))):
            w.wait()  # a tuple, not a list
        before = len(record)
        comm.all_reduce(f)  # taken: nothing recorded
        comm.all_reduce(torch.ones(4, dtype=torch.uint8))  # checked and cached by the first
        assert len(record) == before
    return record


@MPI_ONLY
def test_calls_the_compiled_path_declines_take_the_python_path(
        comm_runner: ranks.RankRunner) -> None:
    def expected(gather: list[str]) -> list[str]:
        return (["all_reduce"] * 9 + ["reduce_scatter", "all_gather", "broadcast", *gather,
                                      "all_to_all", "all_reduce", "broadcast", "all_reduce"]
                + ["batch_isend_irecv"] * 2)  # a subclass of P2POp, a tuple

    # gather's buffer is the root's (taken there); rank 1 gives one too (declined)
    assert comm_runner(declined, 2, timeout=90) == [expected([]), expected(["gather"])]


def late_peer(comm: Communicator) -> dict[str, Any]:
    """Rank 1 joins each collective 0.4 s late: rank 0's compiled poll runs out of budget and
    hands the request to the Python path's wait."""
    out: dict[str, Any] = {}
    t = torch.full((5,), comm.rank + 1.0)
    if comm.rank == 1:
        time.sleep(0.4)
    out["kind"] = type(comm.all_reduce(t)).__name__
    out["all_reduce"] = t
    chunks = torch.zeros(4) if comm.rank == 0 else None
    if comm.rank == 1:
        time.sleep(0.4)
    out["gather kind"] = type(comm.gather(chunks, torch.full((2,), float(comm.rank)), 0)).__name__
    out["gather"] = chunks
    out["pending"] = len(comm._inflight)  # type: ignore[attr-defined]
    return out


@MPI_ONLY
def test_a_collective_pending_past_the_budget_is_waited_for_by_the_python_path(
        comm_runner: ranks.RankRunner) -> None:
    from gradcomm.comm.backends.mpi import compiled

    assert compiled.BUDGET_S < 0.4
    first, second = comm_runner(late_peer, 2, timeout=90)
    assert first["kind"] == "MPIWork" and first["gather kind"] == "MPIWork"
    for got in (first, second):
        assert torch.equal(got["all_reduce"], torch.full((5,), 3.0)) and got["pending"] == 0
    assert torch.equal(first["gather"], torch.tensor([0.0, 0.0, 1.0, 1.0]))


def _timeout_case(comm: Communicator) -> dict[str, Any]:
    """Rank 0 all-reduces with a 1 s timeout; rank 1 joins 3 s later."""
    out: dict[str, Any] = {}
    t = torch.ones(4)
    if comm.rank == 0:
        start = time.monotonic()
        with pytest.raises(CollectiveTimeoutError):
            comm.all_reduce(t)
        out["took"] = time.monotonic() - start
    else:
        time.sleep(3.0)
        comm.all_reduce(t)
    return out


@MPI_ONLY
def test_a_peer_that_never_comes_times_out_within_the_timeout(
        comm_runner: ranks.RankRunner) -> None:
    from gradcomm.comm.backends.mpi import compiled

    first, _ = comm_runner(_timeout_case, 2, timeout=90, comm_timeout=1.0)
    assert 1.0 <= first["took"] < 1.0 + compiled.BUDGET_S + 2.0


def _work_state(comm: Communicator, work: Any, base: int) -> dict[str, Any]:
    """What a transfer's work holds, as the Python path's MPIWork and the compiled path's
    TransferWork both hold it; its number counted from ``base``."""
    keep = work._keepalive
    text = re.sub(r"#(\d+)", lambda m: f"#{int(m.group(1)) - base}", work.description)
    return {"text": text, "timeout": work.timeout,
            "inflight": work._inflight is comm._inflight,  # type: ignore[attr-defined]
            "on_timeout": work._on_timeout == comm._stall_note,  # type: ignore[attr-defined]
            "target": None if work._target is None else work._target.data_ptr(),
            "expect_bytes": work._expect_bytes, "keeps": (keep[0].data_ptr(), keep[1].data_ptr()),
            "done": work._done, "failure": work._failure, "callbacks": work._callbacks,
            "error": work._error, "running": work._running}


def _first(works: list[Any]) -> int:
    """The lowest number in the descriptions of ``works``."""
    return min(int(re.findall(r"#(\d+)", w.description)[0]) for w in works)


def batch_works(comm: Communicator) -> dict[str, Any]:
    """The works of a compiled batch against those the Python path makes for the same ops, and a
    receive of the wrong size (2 ranks)."""
    from gradcomm.comm.backends.mpi.work import MPIWork

    peer = 1 - comm.rank
    sent, got = torch.arange(6.0), torch.zeros(6)

    def ops() -> list[P2POp]:
        return [P2POp("send", sent, peer), P2POp("recv", got, peer)]

    python = PointToPoint.batch_isend_irecv(comm, ops())  # caches float32's description
    out: dict[str, Any] = {"python": [_work_state(comm, w, _first(python)) for w in python]}
    for w in python:
        w.wait()
    with python_path(comm):
        works = comm.batch_isend_irecv(ops())
    out["compiled"] = [_work_state(comm, w, _first(works)) for w in works]
    out["kinds"] = [(type(w).__name__, isinstance(w, MPIWork)) for w in works]
    # pending in posting order, the receive first, as the Python path adds them
    out["order"] = [w.description.split()[0] for w in comm._inflight]  # type: ignore[attr-defined]
    for w in works:
        w.wait()
    out["got"] = got.clone()
    short = torch.zeros(4)
    with python_path(comm):
        works = comm.batch_isend_irecv([P2POp("send", short, peer, tag=2),
                                        P2POp("recv", got, peer, tag=2)])
    works[0].wait()
    with pytest.raises(RuntimeError, match="received 16 bytes, the buffer holds 24"):
        works[1].wait()
    out["pending"] = len(comm._inflight)  # type: ignore[attr-defined]
    return out


@MPI_ONLY
def test_a_compiled_batch_makes_the_works_the_python_path_makes(
        comm_runner: ranks.RankRunner) -> None:
    for r, got in enumerate(comm_runner(batch_works, 2, timeout=90)):
        assert got["compiled"] == got["python"]
        assert got["kinds"] == [("TransferWork", True)] * 2 and got["order"] == ["recv", "send"]
        texts = [state["text"] for state in got["python"]]
        assert texts[0].startswith(f"send #0 dst={1 - r} tag=0 of 6")  # numbered in list order
        assert texts[1].startswith(f"recv #1 src={1 - r} tag=0 of 6")
        assert torch.equal(got["got"], torch.arange(6.0)) and got["pending"] == 0


def switched_off(comm: Communicator) -> bool:
    """Whether this rank's communicator has no compiled calls (and still reduces right)."""
    t = torch.ones(3)
    comm.all_reduce(t)
    assert torch.equal(t, torch.full((3,), float(comm.world_size)))
    return comm._compiled is None  # type: ignore[attr-defined, no-any-return]


@MPI_ONLY
def test_gradcomm_mpi_compiled_0_turns_them_off(comm_runner: ranks.RankRunner,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GRADCOMM_MPI_COMPILED", "0")
    assert comm_runner(switched_off, 2, timeout=60) == [True, True]


def interrupted(comm: Communicator) -> dict[str, Any]:
    """Rank 0 gets SIGINT 30 ms into a compiled all-reduce that rank 1 joins 1 s late: the
    KeyboardInterrupt comes once the compiled poll hands the pending collective over, which the
    communicator keeps (and its tensor alive), as it keeps any work whose caller dropped it."""
    import os
    import signal
    import threading

    out: dict[str, Any] = {}
    t = torch.full((4,), comm.rank + 1.0)
    comm.all_reduce(torch.zeros(1))  # the Python path checks float32
    if comm.rank == 0:
        threading.Timer(0.03, os.kill, (os.getpid(), signal.SIGINT)).start()
        try:
            comm.all_reduce(t)
            out["interrupted"] = False
        except KeyboardInterrupt:
            out["interrupted"] = True
        out["pending"] = len(comm._inflight)  # type: ignore[attr-defined]
        out["text"] = comm._inflight[0].description  # type: ignore[attr-defined]
        comm._inflight[0].wait()  # type: ignore[attr-defined]  # the work the caller lost
    else:
        time.sleep(1.0)
        comm.all_reduce(t)
    comm.barrier()
    out["t"] = t
    out["after"] = len(comm._inflight)  # type: ignore[attr-defined]
    return out


@MPI_ONLY
def test_an_interrupt_during_a_compiled_call_leaves_its_collective_pending(
        comm_runner: ranks.RankRunner) -> None:
    first, second = comm_runner(interrupted, 2, timeout=90)
    assert first["interrupted"] and first["pending"] == 1
    assert first["text"].startswith("all_reduce #1 SUM of 4 torch.float32")
    for got in (first, second):
        assert torch.equal(got["t"], torch.full((4,), 3.0)) and got["after"] == 0

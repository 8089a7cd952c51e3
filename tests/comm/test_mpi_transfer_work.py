"""The works of a compiled ``batch_isend_irecv`` on MPI (``TransferWork``: compiled wait, _wait
and _test; gradcomm/comm/backends/mpi/_compiled_transfer_work.cpp), under real ``mpiexec`` with
2-4 ranks: callbacks, timeouts, polling with is_completed, two threads waiting on one work, an
interrupt during a wait, an MPI error, the methods on a foreign object, the instance-bound
``batch_isend_irecv`` (keywords, patches, overrides), and batches to every peer up to and past
the compiled limit. Values are checked against what the peers sent.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from typing import Any

import pytest
import ranks
import torch

from gradcomm import CollectiveTimeoutError
from gradcomm.comm import Communicator, P2POp

pytest.importorskip("mpi4py")

MPI_ONLY = pytest.mark.parametrize("comm_runner", [ranks.MPI], indirect=True)


def _ring(comm: Communicator, n: int, tag: int = 0) -> tuple[list[Any], torch.Tensor]:
    """Post a pair exchange of ``n`` float32 (this rank's number plus 0..n-1, tag ``tag``);
    the works and the receive buffer."""
    peer = 1 - comm.rank
    got = torch.zeros(n)
    sent = torch.arange(float(n)) + 10 * comm.rank
    ops = [P2POp("send", sent, peer, tag), P2POp("recv", got, peer, tag)]
    return comm.batch_isend_irecv(ops), got


def _ops(comm: Communicator, got: torch.Tensor) -> list[P2POp]:
    peer = 1 - comm.rank
    return [P2POp("send", torch.ones_like(got), peer), P2POp("recv", got, peer)]


def waits(comm: Communicator) -> dict[str, Any]:
    """Callbacks, a callback's error, is_completed polling and the class of the works."""
    out: dict[str, Any] = {}
    comm.all_reduce(torch.zeros(1))  # the Python path checks and caches float32
    works, got = _ring(comm, 5)
    out["class"] = type(works[1]).__name__
    ran: list[str] = []
    works[1].add_callback(lambda: ran.append(f"first {got[0].item()}"))
    works[1].add_callback(lambda: ran.append("second"))
    for w in works:
        w.wait()
    out["ran"], out["got"] = ran, got.clone()
    works, got = _ring(comm, 5, tag=3)
    works[0].add_callback(lambda: 1 / 0)
    for _ in range(2):  # raised by every wait, as on the Python path
        with pytest.raises(ZeroDivisionError):
            works[0].wait()
    works[1].wait()
    works, got = _ring(comm, 1 << 16)
    polls = 0
    while not all(w.is_completed() for w in works):
        polls += 1
    out["polled"] = got[-1].item()
    out["done"] = [w.is_completed() and w._handle is None and w._keepalive is None  # type: ignore[attr-defined]
                   for w in works]
    # the compiled batch_isend_irecv is bound to the instance; a call it declines (a tuple) is
    # its class's; once closed the class's raises
    out["bound"] = "batch_isend_irecv" in vars(comm)
    with pytest.raises(TypeError, match=r"batch_isend_irecv\(\) takes one argument, ops"):
        comm.batch_isend_irecv()  # type: ignore[call-arg]
    works = comm.batch_isend_irecv(tuple(_ops(comm, got)))
    out["declined kinds"] = [type(w).__name__ for w in works]
    for w in works:
        w.wait()
    sub = comm.split(0)
    assert sub is not None
    sub.close()
    out["unbound"] = "batch_isend_irecv" not in vars(sub)
    with pytest.raises(RuntimeError, match="closed"):
        sub.batch_isend_irecv(_ops(sub, got))
    out["pending"] = len(comm._inflight)  # type: ignore[attr-defined]
    return out


@MPI_ONLY
def test_transfer_works_run_callbacks_and_complete_by_polling(
        comm_runner: ranks.RankRunner) -> None:
    for r, got in enumerate(comm_runner(waits, 2, timeout=90)):
        peer = 1 - r
        assert got["class"] == "TransferWork", "the compiled calls are off in this environment"
        assert got["ran"] == [f"first {10.0 * peer}", "second"]
        assert torch.equal(got["got"], torch.arange(5.0) + 10 * peer)
        assert got["polled"] == (1 << 16) - 1 + 10 * peer
        assert got["done"] == [True, True] and got["pending"] == 0
        assert got["bound"] and got["unbound"] and got["declined kinds"] == ["MPIWork"] * 2


def late(comm: Communicator) -> dict[str, Any]:
    """Rank 1 sends 1.5 s late: rank 0's wait(timeout=0.3) times out, a later wait() gets the
    data; then an exchange with SIGINT 30 ms into rank 0's wait while rank 1 is 1 s late."""
    out: dict[str, Any] = {}
    comm.all_reduce(torch.zeros(1))
    if comm.rank == 1:
        time.sleep(1.5)
    works, got = _ring(comm, 4, tag=1)
    if comm.rank == 0:
        start = time.monotonic()
        with pytest.raises(CollectiveTimeoutError, match=r"recv #\d+ src=1 tag=1 of 4"):
            works[1].wait(timeout=0.3)
        out["took"] = time.monotonic() - start
    for w in works:
        w.wait()
    out["got"] = got.clone()
    comm.barrier()
    if comm.rank == 1:
        time.sleep(1.0)
    works, got = _ring(comm, 4, tag=2)
    if comm.rank == 0:
        threading.Timer(0.03, os.kill, (os.getpid(), signal.SIGINT)).start()
        try:
            works[1].wait()
            out["interrupted"] = False
        except KeyboardInterrupt:
            out["interrupted"] = True
        out["still pending"] = not works[1].is_completed()  # the send is small: sent eagerly
    for w in works:
        w.wait()
    out["after"] = got.clone()
    out["pending"] = len(comm._inflight)  # type: ignore[attr-defined]
    return out


@MPI_ONLY
def test_a_transfer_wait_times_out_and_answers_signals(comm_runner: ranks.RankRunner) -> None:
    first, second = comm_runner(late, 2, timeout=90)
    assert 0.3 <= first["took"] < 1.0
    assert first["interrupted"] and first["still pending"]
    for r, got in enumerate((first, second)):
        assert torch.equal(got["got"], torch.arange(4.0) + 10 * (1 - r))
        assert torch.equal(got["after"], torch.arange(4.0) + 10 * (1 - r))
        assert got["pending"] == 0


def shared(comm: Communicator) -> dict[str, Any]:
    """Two threads wait on one receive (rank 1 sends 0.5 s late): both return, its callback runs
    once. Then a message longer than the receive buffer, and a method called on another object."""
    out: dict[str, Any] = {}
    comm.all_reduce(torch.zeros(1))
    if comm.rank == 1:
        time.sleep(0.5)
    works, got = _ring(comm, 1 << 14)
    ran: list[int] = []
    works[1].add_callback(lambda: ran.append(1))
    errors: list[BaseException] = []

    def wait() -> None:
        try:
            works[1].wait()
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=wait) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    works[0].wait()
    out["threads"] = (errors, ran, got[-1].item())
    peer = 1 - comm.rank
    long = comm.batch_isend_irecv([P2POp("send", torch.ones(8), peer, 4),
                                   P2POp("recv", torch.zeros(4), peer, 4)])
    long[0].wait()
    for _ in range(2):
        with pytest.raises(RuntimeError, match=r"recv #\d+ src=\d tag=4 of 4 .*: Message trunc"):
            long[1].wait()
    with pytest.raises(TypeError, match="not a work made by a compiled batch_isend_irecv"):
        type(long[1]).wait(object())  # type: ignore[arg-type]
    out["pending"] = len(comm._inflight)  # type: ignore[attr-defined]
    return out


@MPI_ONLY
def test_two_threads_wait_on_one_transfer_and_errors_are_kept(
        comm_runner: ranks.RankRunner) -> None:
    for r, got in enumerate(comm_runner(shared, 2, timeout=90)):
        errors, ran, last = got["threads"]
        assert errors == [] and ran == [1] and last == (1 << 14) - 1 + 10 * (1 - r)
        assert got["pending"] == 0


def api(comm: Communicator) -> dict[str, Any]:
    """The bound batch_isend_irecv takes ops= by keyword and holds its communicator; a patch of
    the class's method is called as Python would call it (and unbinds the compiled one); a
    subclass that overrides the method is not bound at all."""
    from unittest import mock

    from gradcomm.comm.backends.mpi import compiled

    out: dict[str, Any] = {}
    comm.all_reduce(torch.zeros(1))
    got = torch.zeros(4)

    def kinds(works: list[Any]) -> list[str]:
        for w in works:
            w.wait()
        return [type(w).__name__ for w in works]

    out["keyword"] = kinds(comm.batch_isend_irecv(ops=_ops(comm, got)))
    out["holds"] = comm.batch_isend_irecv.__self__ is comm  # type: ignore[attr-defined]
    ops = _ops(comm, got)
    with mock.patch.object(type(comm), "batch_isend_irecv") as patched:
        patched.return_value = []
        comm.batch_isend_irecv(ops, note="x")  # type: ignore[call-arg]
    patched.assert_called_once_with(ops, note="x")
    out["unbound by the patch"] = "batch_isend_irecv" not in vars(comm)
    out["python path"] = kinds(comm.batch_isend_irecv(_ops(comm, got)))
    base = type(comm)

    class Traced(base):  # type: ignore[valid-type, misc]
        @staticmethod
        def batch_isend_irecv(ops: Any) -> list[Any]:
            return base.batch_isend_irecv(comm, ops)  # type: ignore[no-any-return]

    comm.__class__ = Traced
    compiled.bind_batch(comm)
    out["override bound"] = "batch_isend_irecv" in vars(comm)
    out["override"] = kinds(comm.batch_isend_irecv(_ops(comm, got)))
    comm.__class__ = base
    compiled.bind_batch(comm)
    out["rebound"] = kinds(comm.batch_isend_irecv(_ops(comm, got)))
    out["got"] = got.clone()
    return out


@MPI_ONLY
def test_the_bound_batch_honours_keywords_patches_and_overrides(
        comm_runner: ranks.RankRunner) -> None:
    for got in comm_runner(api, 2, timeout=90):
        assert got["keyword"] == ["TransferWork"] * 2 and got["holds"]
        assert got["unbound by the patch"] and got["python path"] == ["MPIWork"] * 2
        assert not got["override bound"] and got["override"] == ["MPIWork"] * 2
        assert got["rebound"] == ["TransferWork"] * 2 and torch.equal(got["got"], torch.ones(4))


def many(comm: Communicator) -> dict[int, Any]:
    """Batches to and from every other rank on several tags, in a mixed order: at most 64 ops
    through the compiled batch, a few more through the Python path; every receive's values."""
    comm.all_reduce(torch.zeros(1))
    n, r = comm.world_size, comm.rank
    peers = [p for p in range(n) if p != r]
    out: dict[int, Any] = {}
    most = 64 // (2 * (n - 1))
    for tags in (most, most + 1):
        sends = [P2POp("send", torch.full((3,), 1000.0 * r + 10 * p + t), p, t)
                 for p in peers for t in range(tags)]
        boxes = {(q, t): torch.zeros(3) for q in peers for t in range(tags)}
        recvs = [P2POp("recv", box, q, t) for (q, t), box in boxes.items()]
        ops = [op for pair in zip(recvs[::-1], sends, strict=True) for op in pair]
        works = comm.batch_isend_irecv(ops)
        kinds = sorted({type(w).__name__ for w in works})
        for w in works:
            w.wait()
        right = all(torch.equal(box, torch.full((3,), 1000.0 * q + 10 * r + t))
                    for (q, t), box in boxes.items())
        out[len(ops)] = (kinds, right)
    return out


@MPI_ONLY
@pytest.mark.parametrize("n", [3, 4])
def test_batches_to_every_peer_up_to_and_past_the_compiled_limit(
        comm_runner: ranks.RankRunner, n: int) -> None:
    most = 64 // (2 * (n - 1))
    small, large = 2 * (n - 1) * most, 2 * (n - 1) * (most + 1)
    assert small <= 64 < large
    for got in comm_runner(many, n, timeout=120):
        assert got == {small: (["TransferWork"], True), large: (["MPIWork"], True)}

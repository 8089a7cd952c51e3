"""send/recv/batch_isend_irecv and split/split_by_host against a single-process reference, as
rank-agnostic tests (the module tier, :mod:`tests._support.rank_suite`; run by
``tests/comm/test_rank_suites.py``). The checks live in ``tests/_support/p2p_split_checks.py``.
"""

from __future__ import annotations

import threading
import time

import pytest
import torch

from gradcomm.comm import Communicator

from tests._support import p2p_split_checks as checks
from tests._support import rank_suite


def test_point_to_point(comm: Communicator) -> None:
    assert checks.run_p2p_checks(comm) >= 9


def test_split_and_split_by_host(comm: Communicator) -> None:
    assert checks.run_split_checks(comm) >= 6


@rank_suite.only(lambda run: run.backend == "mpi")
def test_mpi_transfers_short_messages_dropped_works_device_path(comm: Communicator) -> None:
    """A shorter message is refused by the receive's count check, a longer one by MPI; dropped
    sends complete; then point-to-point through the device-buffer path without a GPU."""
    assert checks.mpi_checks(comm) > 0


@rank_suite.only(lambda run: run.backend == "gloo" and run.world_size == 2)
def test_a_group_closed_right_after_its_split_fails_no_peer(comm: Communicator) -> None:
    """gloo's connect is not a barrier: a rank that closed its new group at once, while a busy
    peer still completed its side of the connect, failed that peer ("Connection closed by
    peer"; 5 of 6 such runs failed before split waited for every rank). Two ranks suffice."""
    stop = threading.Event()

    def burn() -> None:  # keeps the cores busy, outside the GIL, so that ranks get preempted
        a = torch.randn(400, 400)
        while not stop.is_set():
            a @ a

    burners = [threading.Thread(target=burn, daemon=True) for _ in range(2)]
    for b in burners:
        b.start()
    try:
        for _ in range(100):
            child = comm.split(0)
            assert child is not None
            child.close()
    finally:
        stop.set()
        for b in burners:
            b.join()
    t = torch.ones(3)
    comm.all_reduce(t)
    assert t.tolist() == [comm.world_size] * 3


def test_closing_a_parent_closes_its_children(comm: Communicator) -> None:
    parent = comm.split(0)  # the run's communicator stays open for the tests after this one
    assert parent is not None
    assert checks.check_children_closed(parent) == 1


@rank_suite.only(lambda run: run.backend in ("gloo", "mpi"))
def test_subgroup_is_built_by_its_members_alone(comm: Communicator) -> None:
    """Members call subgroup, the others go straight on (gloo: a prefixed store; mpi:
    Comm.Create_group); ranks come in the listed order; a second group of the same ranks is
    another group; bad member lists raise before any transport call."""
    w, r = comm.world_size, comm.rank
    members = [w - 1, 0] if w > 1 else [0]
    if r in members:
        sub = comm.subgroup(members)
        again = comm.subgroup(members)
        t = torch.tensor([float(r)])
        sub.all_reduce(t)
        u = torch.tensor([float(r + 1)])
        again.all_reduce(u, op="max")
        assert (sub.rank, sub.world_size) == (members.index(r), len(members))
        assert (t.item(), u.item()) == (float(sum(members)), float(max(members) + 1))
        sub.close()
        again.close()
    comm.barrier()  # the members' groups are theirs alone: the others never waited for them
    with pytest.raises(ValueError, match=f"include this rank {r}"):
        comm.subgroup([x for x in range(w) if x != r] or [w])
    with pytest.raises(ValueError, match="distinct and not empty"):
        comm.subgroup([r, r])
    with pytest.raises(ValueError, match="distinct and not empty"):
        comm.subgroup([])
    with pytest.raises(TypeError, match="sequence of ints"):
        comm.subgroup("0")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="sequence of ints"):
        comm.subgroup([0.0])  # type: ignore[list-item]


@rank_suite.only(lambda run: run.backend in ("gloo", "mpi"))
def test_recv_from_any_rank(comm: Communicator) -> None:
    """recv(src=None) takes the first message with its tag from any rank; the work's source
    names the sender (and a named receive's source is its src)."""
    w, r = comm.world_size, comm.rank
    assert comm.receives_from_any_source
    if w == 1:
        with pytest.raises(ValueError, match="no other rank"):
            comm.recv(torch.empty(1), None)
        return
    if r == 0:
        senders = []
        for _ in range(w - 1):
            t = torch.empty(4)
            work = comm.recv(t, None, tag=7, async_op=True)
            work.wait()
            assert work.source is not None and torch.equal(t, torch.full((4,), work.source))
            senders.append(work.source)
        assert sorted(senders) == list(range(1, w))
        named = comm.recv(torch.empty(1), w - 1, tag=8)
        assert named.source == w - 1
    else:
        comm.send(torch.full((4,), float(r)), 0, tag=7)
        if r == w - 1:
            comm.send(torch.ones(1), 0, tag=8)
    comm.barrier()


@rank_suite.only(lambda run: run.backend == "threads")
def test_recv_from_any_rank_where_the_backend_cannot(comm: Communicator) -> None:
    assert not comm.receives_from_any_source
    with pytest.raises(NotImplementedError, match="named rank only"):
        comm.recv(torch.empty(1), None)


def test_a_send_waits_for_a_receiver_half_a_second_late(comm: Communicator) -> None:
    """A transfer's wait ends when the transfer does: gloo's failed once a timed wait slice
    (0.1 s, to see abort()) elapsed before the peer posted its receive."""
    if comm.world_size == 1:
        return
    if comm.rank == 1:
        comm.send(torch.full((3,), 7.0), 0, tag=9)
    elif comm.rank == 0:
        time.sleep(0.5)
        t = torch.empty(3)
        comm.recv(t, 1, tag=9)
        assert torch.equal(t, torch.full((3,), 7.0)), t
    comm.barrier()

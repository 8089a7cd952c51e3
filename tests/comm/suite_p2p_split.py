"""send/recv/batch_isend_irecv and split/split_by_host against a single-process reference, as
rank-agnostic tests (the module tier, :mod:`tests._support.rank_suite`; run by
``tests/comm/test_rank_suites.py``). The checks live in ``tests/_support/p2p_split_checks.py``.
"""

from __future__ import annotations

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


def test_closing_a_parent_closes_its_children(comm: Communicator) -> None:
    parent = comm.split(0)  # the run's communicator stays open for the tests after this one
    assert parent is not None
    assert checks.check_children_closed(parent) == 1

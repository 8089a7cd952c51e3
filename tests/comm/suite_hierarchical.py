"""The hierarchical all-reduce over faked hosts against the flat reference, bit-identical on every
rank (the module tier, :mod:`tests._support.rank_suite`; run by ``tests/comm/test_rank_suites.py``
at 2 and 3 ranks, and at 4: two hosts of two ranks, the one size where both levels have more
than one rank). Hosts of unequal size are refused on every rank.
"""

from __future__ import annotations

from gradcomm.comm import Communicator

from tests._support import p2p_split_checks as checks


def test_hierarchical_all_reduce(comm: Communicator) -> None:
    assert checks.run_hierarchical_checks(comm) >= 20

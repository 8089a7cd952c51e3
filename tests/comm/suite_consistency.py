"""The cross-rank collective check (``GRADCOMM_DEBUG=detail``) as rank-agnostic tests (the module
tier, :mod:`tests._support.rank_suite`; run by ``tests/comm/test_rank_suites.py``): mismatched
calls raise the same RuntimeError on every rank, naming the first difference, and matching calls
give the values they give without the check. The cases live in
``tests/_support/consistency_cases.py`` (rank 1 is the odd one out: two ranks or more).
"""

from __future__ import annotations

from gradcomm.comm import Communicator

from tests._support import consistency_cases as cc
from tests._support import rank_suite


@rank_suite.only(lambda run: run.world_size >= 2)
@rank_suite.parametrize("case", list(cc.CASES))
def test_consistency_check(comm: Communicator, case: str) -> None:
    (outcome,) = cc.run_cases(comm, [case])
    everyone = comm.all_gather_object(outcome)  # the verdict needs every rank's outcome
    assert cc.verify(case, everyone, comm.world_size) == []

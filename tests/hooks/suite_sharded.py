"""ShardedOptimizer (ZeRO stages 1 and 2), as rank-agnostic tests (the module tier,
:mod:`tests._support.rank_suite`; run by ``tests/hooks/test_rank_suites.py`` on gloo and mpi at 2
and 3 ranks): parameters equal unsharded training, gradient state, a skipped backward, bad input
raising on every rank (see ``tests/_support/sharded_checks.py``). Three ranks shard the 12 samples
and the parameters unevenly; four would add no new case.
"""

from __future__ import annotations

import gradcomm

from tests._support import rank_suite
from tests._support import sharded_checks as sc


def _processes(run: rank_suite.Run) -> bool:
    return run.backend in ("gloo", "mpi") and run.world_size >= 2


@rank_suite.only(_processes)
def test_sharded_equals_unsharded(comm: gradcomm.Communicator) -> None:
    assert len(sc.value_cases(comm)) == 10


@rank_suite.only(_processes)
def test_gradient_state(comm: gradcomm.Communicator) -> None:
    assert len(sc.grad_state_cases(comm)) == 10


@rank_suite.only(_processes)
def test_a_skipped_backward(comm: gradcomm.Communicator) -> None:
    assert len(sc.skipped_backward_cases(comm)) == 2


# bad input does not depend on the world size: gloo at 2 ranks, and mpi
@rank_suite.only(lambda run: _processes(run) and (run.backend == "mpi" or run.world_size == 2))
def test_bad_input_raises_on_every_rank(comm: gradcomm.Communicator) -> None:
    assert len(sc.bad_input_cases(comm)) == 6

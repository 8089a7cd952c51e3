"""The step consistency check and ``GradientReducer.join()``, as rank-agnostic tests (the module
tier, :mod:`tests._support.rank_suite`; run by ``tests/hooks/test_rank_suites.py`` at 2 and 3
ranks of every backend): a rank that skips a backward makes every rank raise the same
RuntimeError with the gradients and parameters untouched (with copies, in-place buckets, bucket
views, fp16 and PowerSGD compression, no_sync and two forwards per backward), no false alarm
(evaluation under no_grad on one rank, two reducers on one communicator, remove()), a graph
recorded before the reducer is refused on every rank, and join() with 1, 2 and 5 extra batches on
one rank gives the single-process reference gradients and final parameters. The cases live in
``tests/_support/step_join_cases.py``.
"""

from __future__ import annotations

import gradcomm

from tests._support import rank_suite
from tests._support import step_join_cases as sj
from tests.hooks.suite_reducer import verified


@rank_suite.only(lambda run: run.world_size >= 2)
@rank_suite.parametrize("case", list(sj.CASES))
def test_step_check_and_join(comm: gradcomm.Communicator, case: str) -> None:
    verified(comm, case, sj.CASES)

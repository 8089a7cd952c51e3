"""The module tier of ``tests/comm``: the rank-agnostic suite modules, one launch per backend and
world size (:mod:`tests._support.rank_suite`), every test one pytest item per run.

``threads`` ranks and a one-rank ``gloo`` communicator run in this process (the fast tier);
``gloo`` at 2 and 3 ranks is one spawned group each, ``mpi`` at 1, 2 and 3 ranks one ``mpiexec``
each. Three ranks cover what depends on the rank count (uneven splits, a rank that is no member,
hosts of unequal size); the hierarchical all-reduce also runs at 4 ranks, two hosts of two, the
one size where both of its levels have more than one rank.
"""

from __future__ import annotations

import pytest

from tests._support import rank_suite
from tests.comm import (
    suite_collectives,
    suite_consistency,
    suite_fake_device,
    suite_hierarchical,
    suite_init,
    suite_p2p_split,
)

SUITE = rank_suite.Suite(
    [suite_collectives, suite_p2p_split, suite_hierarchical, suite_consistency, suite_init,
     suite_fake_device],
    rank_suite.runs("threads-2", "threads-3", "gloo-1", "gloo-2", "gloo-3", "mpi-1", "mpi-2",
                    "mpi-3"),
    timeout=300)
FOUR_RANKS = rank_suite.Suite([suite_hierarchical], rank_suite.runs("mpi-4"), timeout=120)


@pytest.mark.timeout(SUITE.item_timeout)
@pytest.mark.parametrize(("run", "test_id"), SUITE.params())
def test_rank_suite(run: rank_suite.Run, test_id: str,
                   tmp_path_factory: pytest.TempPathFactory) -> None:
    SUITE.check(run, test_id, tmp_path_factory)


@pytest.mark.timeout(FOUR_RANKS.item_timeout)
@pytest.mark.parametrize(("run", "test_id"), FOUR_RANKS.params())
def test_four_ranks_as_two_hosts(run: rank_suite.Run, test_id: str,
                                 tmp_path_factory: pytest.TempPathFactory) -> None:
    FOUR_RANKS.check(run, test_id, tmp_path_factory)

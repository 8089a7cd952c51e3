"""Backward passes the reducer must follow: ``no_sync()`` accumulation, several backward passes per
step (``retain_graph``, two losses), activation checkpointing (reentrant and not), and a backward
that raised on one rank only, after some of its buckets were sent.

Each case of ``reducer_cases`` runs once per backend and world size (``ranks.RankRunner``); each
test compares the reduced gradients with one process's gradients on the global batch, and checks
that all ranks hold bit-identical gradients.
"""

from __future__ import annotations

from tests._support import reducer_cases as rc
from tests._support.ranks import RankRunner

CASES = ["no_sync", "several_backwards", "checkpointing", "raised_on_one_rank"]
RUNS: rc.Runs = [("threads", 2, CASES), ("threads", 3, CASES), ("gloo", 2, CASES),
                 ("mpi", 2, CASES), ("mpi", 3, ["no_sync", "raised_on_one_rank"]),
                 ("mpi", 1, ["no_sync"])]


@rc.over_backends(RUNS)
def test_case(comm_runner: RankRunner, world_size: int, case: str) -> None:
    results = rc.results_of(comm_runner, world_size, RUNS)
    assert rc.verify_case(case, results, world_size) == []

"""The reducer's model guard: the model differs across ranks (a fingerprint names what differs),
tied weights, and parameters, buffers or submodules replaced after wrapping.

Each case of ``reducer_cases`` runs once per backend and world size (``ranks.RankRunner``); each
test checks one case's values or exact errors against single-process references.
"""

from __future__ import annotations

from tests._support import reducer_cases as rc
from tests._support.ranks import RankRunner

CASES = ["fingerprint", "tied", "replaced"]
RUNS: rc.Runs = [("threads", 2, CASES), ("threads", 3, CASES), ("gloo", 2, CASES),
                 ("mpi", 2, CASES), ("mpi", 3, ["fingerprint"])]


@rc.over_backends(RUNS)
def test_case(comm_runner: RankRunner, world_size: int, case: str) -> None:
    results = rc.results_of(comm_runner, world_size, RUNS)
    assert rc.verify_case(case, results, world_size) == []

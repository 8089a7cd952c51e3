"""The step consistency check and ``GradientReducer.join()`` on every backend.

One run per backend and world size (2 and 3 ranks; threads, spawned gloo, ``mpiexec``) runs
every case of ``tests/step_join_cases.py``: a rank that skips a backward makes every rank raise
the same RuntimeError with the gradients and parameters untouched (with copies, in-place buckets,
bucket views, fp16 and PowerSGD compression, no_sync and two forwards per backward), no false
alarm (evaluation under no_grad on one rank, two reducers on one communicator, remove()), a graph
recorded before the reducer is refused on every rank, and join() with 1, 2 and 5 extra batches on
one rank gives the single-process reference gradients and final parameters.
"""

from __future__ import annotations

from tests._support import reducer_cases as rc
from tests._support import step_join_cases as sj
from tests._support.ranks import RankRunner

CASES = list(sj.CASES)
RUNS: rc.Runs = [(backend, world, CASES) for backend in ("threads", "gloo", "mpi")
                 for world in (2, 3)]


@rc.over_backends(RUNS, timeout=450)
def test_case(comm_runner: RankRunner, world_size: int, case: str) -> None:
    results = rc.results_of(comm_runner, world_size, RUNS, timeout=400, cases=sj.CASES,
                            comm_timeout=60.0)
    assert rc.verify_case(case, results, world_size, sj.CASES) == []

"""Module state and degenerate models: buffers (``broadcast_buffers``, int64 counters, modules
with no buffers, empty modules, non-tensor state) and degenerate models (empty, no trainable
parameter, zero-size parameter), on every backend and at world size 1.
"""

from __future__ import annotations

import pytest

import gradcomm

from tests._support import reducer_cases as rc
from tests._support.ranks import RankRunner

CASES = ["buffers", "degenerate"]
RUNS: rc.Runs = [("threads", 2, CASES), ("threads", 3, CASES), ("gloo", 2, CASES),
                 ("mpi", 2, CASES), ("mpi", 1, CASES)]


@rc.over_backends(RUNS)
def test_case(comm_runner: RankRunner, world_size: int, case: str) -> None:
    results = rc.results_of(comm_runner, world_size, RUNS)
    assert rc.verify_case(case, results, world_size) == []


# Cases that mean something with one rank (a fingerprint cannot differ from itself).
SINGLE = ["no_sync", "several_backwards", "checkpointing", "tied", "layouts", "half", "buffers",
          "degenerate"]


@pytest.mark.slow
def test_gloo_world_size_one_every_case_without_a_collective() -> None:
    comm = gradcomm.init("gloo", rank=0, world_size=1, env={})
    calls: list[str] = []
    for name in ("_all_reduce", "_broadcast", "_all_gather", "_barrier"):
        setattr(comm, name, lambda *a, _n=name, **k: calls.append(_n))
    try:
        out = rc.run_cases(comm, SINGLE)
    finally:
        comm.close()
    assert calls == []
    for case in SINGLE:
        problems = rc.verify_case(case, [out], 1)
        # at world size 1 there is nothing to compare across ranks
        assert [p for p in problems if "(test is vacuous)" not in p and "reduced?" not in p] == []

"""Module state and degenerate models at world size 1 on gloo: every case that means something
with one rank runs without a collective. (On every backend at 1-3 ranks, ``buffers`` and
``degenerate`` are the module tier's: ``tests/hooks/suite_reducer.py``.)
"""

from __future__ import annotations

import pytest

import gradcomm

from tests._support import reducer_cases as rc

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

"""Issue 5, items 8 and 9: buffers (``broadcast_buffers``, int64 counters, modules with no
buffers, empty modules, non-tensor state) and degenerate models (empty, no trainable parameter,
zero-size parameter), over real gloo processes and at world size 1.
"""

from __future__ import annotations

import sys

import pytest

import gradcomm

from dist_utils import TESTS_DIR

sys.path.insert(0, str(TESTS_DIR / "mpi_scripts"))
import failure_common as fc

CASES = ["buffers", "degenerate"]
WORLD = 2

results, test_gloo = fc.make_gloo_tests(CASES, WORLD)


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
        out = fc.run_cases(comm, SINGLE)
    finally:
        comm.close()
    assert calls == []
    for case in SINGLE:
        problems = fc.verify_case(case, [out], 1)
        # at world size 1 there is nothing to compare across ranks
        assert [p for p in problems if "(test is vacuous)" not in p and "reduced?" not in p] == []

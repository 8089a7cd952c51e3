"""reduce_scatter, all_to_all, the rooted and the object collectives on real gloo groups.

One spawned job per world size runs every case (tests/coll_cases.py) against the torch
reference; bad inputs are checked on every rank between good collectives.
"""

from __future__ import annotations

import pytest
from coll_cases import FLOATS, HALF, INTS, run_all

import gradcomm

from dist_utils import run_processes


def _all_cases(rank: int, world_size: int) -> dict[str, int]:
    with gradcomm.init("gloo", timeout=60) as comm:
        return run_all(comm, FLOATS + INTS + HALF)


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_every_collective_matches_the_reference_on_gloo(world_size: int) -> None:
    counts = run_processes(_all_cases, world_size, timeout=240)
    assert all(c == counts[0] for c in counts)
    assert counts[0]["reduce_scatter"] > 0

"""reduce_scatter, all_to_all, the rooted and the object collectives under real mpiexec."""

from __future__ import annotations

import re

import pytest

from dist_utils import TESTS_DIR, run_mpi


@pytest.mark.slow
@pytest.mark.mpi
@pytest.mark.parametrize("n", [1, 2, 3, 4])
def test_every_collective_matches_the_reference_on_mpi(n: int) -> None:
    out = run_mpi(TESTS_DIR / "mpi_scripts" / "collectives_more.py", n, timeout=240).stdout
    # ranks share mpiexec's pipe: one rank's line may run into the next, so match fields only
    found = re.findall(r"RESULT ok rank=(\d+) world=(\d+) ((?:[a-z_]+=\d+ ?)+)", out)
    lines = sorted((r, w, c.strip()) for r, w, c in found)
    assert [int(r) for r, _, _ in lines] == list(range(n)), out
    assert {w for _, w, _ in lines} == {str(n)}, out
    assert len({c for _, _, c in lines}) == 1 and "reduce_scatter=" in lines[0][2], out

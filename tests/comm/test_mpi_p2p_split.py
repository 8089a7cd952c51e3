"""send/recv, batch_isend_irecv, split and split_by_host on the MPI backend under real mpiexec
(the script ``tests/mpi_scripts/p2p_split.py`` runs every case; one job per world size)."""

from __future__ import annotations

import re

import pytest

from dist_utils import TESTS_DIR, run_mpi


@pytest.mark.slow
@pytest.mark.mpi
@pytest.mark.timeout(200)
@pytest.mark.parametrize("n", [1, 2, 3, 4])
def test_mpi_every_case(n: int) -> None:
    out = run_mpi(TESTS_DIR / "mpi_scripts" / "p2p_split.py", n, timeout=150).stdout
    ranks = sorted(int(r) for r in re.findall(rf"RESULT p2p_split ok rank=(\d+) world={n}", out))
    assert ranks == list(range(n)), out

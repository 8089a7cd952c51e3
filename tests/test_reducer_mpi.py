"""GradientReducer under real ``mpiexec`` with the MPI backend, against one-process references."""

from __future__ import annotations

import pytest

from dist_utils import TESTS_DIR, run_mpi

SCRIPT = TESTS_DIR / "mpi_scripts" / "reducer_grads.py"


@pytest.mark.parametrize("n", [2, 3])
def test_reducer_mpi_matches_reference(n: int) -> None:
    proc = run_mpi(SCRIPT, n, timeout=150, env={"GRADCOMM_BACKEND": "mpi"})
    for rank in range(n):
        assert f"RESULT ok rank={rank} world={n} backend=mpi" in proc.stdout, proc.stdout

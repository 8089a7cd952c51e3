"""GradientReducer under real ``mpiexec`` with the MPI backend, against one-process references."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from dist_utils import TESTS_DIR, run_mpi

SCRIPT = TESTS_DIR / "mpi_scripts" / "reducer_grads.py"


@pytest.mark.slow
@pytest.mark.mpi
@pytest.mark.parametrize("n", [2, 3])
def test_reducer_mpi_matches_reference(n: int) -> None:
    proc = run_mpi(SCRIPT, n, timeout=150, env={"GRADCOMM_BACKEND": "mpi"})
    for rank in range(n):
        assert f"RESULT ok rank={rank} world={n} backend=mpi" in proc.stdout, proc.stdout


@pytest.mark.slow
@pytest.mark.mpi
@pytest.mark.parametrize("backend", ["mpi", "gloo"])
def test_a_step_that_timed_out_is_never_followed_by_silent_success(
    backend: str, tmp_path: Path
) -> None:
    # On MPI a late rank completes the collective that timed out on its peer, so without the
    # reducer's refusal the two ranks would go on one step apart, averaging different steps.
    proc = run_mpi(TESTS_DIR / "mpi_scripts" / "reducer_late_step.py", 2,
                   [backend, str(tmp_path)], timeout=90)
    got = dict(re.findall(r"RESULT late rank=(\d) steps=(\S+)", proc.stdout))
    assert sorted(got) == ["0", "1"], proc.stdout
    for rank, steps in got.items():
        outcomes = steps.split(",")
        assert outcomes[0] == "ok", (rank, outcomes)
        failed = [i for i, o in enumerate(outcomes) if o != "ok"]
        assert failed, (rank, outcomes)  # every rank sees the failure, sooner or later
        assert all(o != "ok" for o in outcomes[failed[0]:]), (rank, outcomes)
    assert got["0"].split(",")[1] == "timeout", got

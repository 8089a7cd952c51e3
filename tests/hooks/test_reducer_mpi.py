"""A reducer step that timed out under real ``mpiexec`` is never followed by silent success. (The
reducer's values against one-process references on every backend are the module tier's:
``tests/hooks/suite_reducer.py``.)"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests._support.dist_utils import MPI_SCRIPTS, run_mpi


@pytest.mark.slow
@pytest.mark.mpi
@pytest.mark.parametrize("backend", ["mpi", "gloo"])
def test_a_step_that_timed_out_is_never_followed_by_silent_success(
    backend: str, tmp_path: Path
) -> None:
    # On MPI a late rank completes the collective that timed out on its peer, so without the
    # reducer's refusal the two ranks would go on one step apart, averaging different steps.
    proc = run_mpi(MPI_SCRIPTS / "reducer_late_step.py", 2,
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

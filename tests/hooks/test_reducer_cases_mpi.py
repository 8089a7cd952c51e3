"""Issue 5's failure-case matrix on the MPI backend under real ``mpiexec`` (items 1 and 3-9).

``mpi_scripts/failure_values.py`` runs the cases of ``mpi_scripts/failure_common.py`` -- the same
code and the same verification as the gloo tests -- and prints one ``RESULT`` line per case.
"""

from __future__ import annotations

import os
import re

import pytest

from dist_utils import REPO_ROOT, TESTS_DIR, run_mpi

SCRIPT = TESTS_DIR / "mpi_scripts" / "failure_values.py"
PATHS = [str(REPO_ROOT), str(TESTS_DIR), str(TESTS_DIR / "mpi_scripts")]
ENV = {"PYTHONPATH": os.pathsep.join(PATHS)}

RUNS = {
    # world size: cases (a fingerprint cannot differ at world size 1)
    2: ["fingerprint", "no_sync", "several_backwards", "checkpointing", "tied", "replaced",
        "layouts", "sparse_and_int", "half", "buffers", "degenerate", "raised_on_one_rank"],
    # 3 ranks: the fp32 upcast path, and a failure seen by two other ranks
    3: ["fingerprint", "half", "no_sync", "sparse_and_int", "raised_on_one_rank"],
    1: ["no_sync", "half", "buffers", "degenerate"],
}


@pytest.mark.slow
@pytest.mark.mpi
@pytest.mark.timeout(200)
@pytest.mark.parametrize("n", sorted(RUNS))
def test_mpi_failure_cases(n: int) -> None:
    out = run_mpi(SCRIPT, n, RUNS[n], timeout=180, env=ENV).stdout
    lines = {m.group(1): m.group(2) for m in
             re.finditer(rf"RESULT case=(\w+) world={n} (.*?)(?=RESULT |\n|$)", out)}
    assert sorted(lines) == sorted(RUNS[n]), out
    assert {case: status for case, status in lines.items() if status != "ok"} == {}, out

"""scripts/gpu_check.sh --dry-run, as CI runs it: every check listed with its budget, what the
machine has, and ``total: N s`` = the sum of the budgets, at most the 540 s of one device run."""

from __future__ import annotations

import os
import re
import sys

import pytest

from tests._support.dist_utils import REPO_ROOT, run_command

CHECKS = ("env", "mpi-setup", "nccl-1", "nccl-2-one-gpu", "cupy-nccl-1", "mpi-cuda-staged",
          "mpi-cuda-aware", "reducer-mpi-cuda", "bench-nccl", "bench-cupy-nccl", "bench-mpi",
          "digits-nccl-1", "digits-mpi-cuda-2")


@pytest.mark.timeout(180)
def test_gpu_check_dry_run_lists_checks_budgets_environment_and_total() -> None:
    env = {**os.environ, "GPU_CHECK_PYTHON": sys.executable}
    proc = run_command(["bash", str(REPO_ROOT / "scripts" / "gpu_check.sh"), "--dry-run"],
                       timeout=150, env=env)
    lines = proc.stdout.strip().splitlines()
    budgets = dict(re.findall(r"^  (\S+) +(\d+) s$", proc.stdout, flags=re.M))
    assert tuple(budgets) == CHECKS, proc.stdout
    total = sum(int(b) for b in budgets.values())
    assert lines[-1] == f"total: {total} s" and total <= 540, proc.stdout
    assert all(int(b) > 0 for b in budgets.values())
    for key in ("python:", "torch:", "cupy:", "mpi4py:", "mpiexec:", "wheels ("):
        assert any(line.strip().startswith(key) for line in lines), (key, proc.stdout)
    assert f"python: {sys.executable}" in proc.stdout


@pytest.mark.timeout(60)
def test_gpu_check_refuses_unknown_arguments() -> None:
    proc = run_command(["bash", str(REPO_ROOT / "scripts" / "gpu_check.sh"), "--bogus"],
                       timeout=50, check=False)
    assert proc.returncode == 64 and "unknown argument --bogus" in proc.stdout

"""The torch DDP and FSDP2 examples, unchanged, under torchrun and under mpiexec (gloo and mpi
transports): they train (loss falls, held-out accuracy >= 0.9 after 3 epochs) and end with the same
parameters on every rank. srun's variables are covered by test_torch_backend.py's launch modes."""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path

import pytest

from tests._support.dist_utils import REPO_ROOT, free_port, run_command, run_mpi

RUN_TIMEOUT = 150.0
_LAUNCH_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
                "MASTER_PORT", "GRADCOMM_BACKEND")


def _check(out: str, world_size: int) -> None:
    final = re.findall(r"final held-out accuracy: ([0-9.]+)", out)
    assert len(final) == 1 and float(final[0]) >= 0.9, out
    losses = [float(x) for x in re.findall(r"epoch +\d+/3 +loss ([0-9.]+)", out)]
    assert len(losses) == 3 and losses[-1] < 0.5 * losses[0], out
    assert f"parameters identical on all {world_size} ranks" in out, out


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.timeout(RUN_TIMEOUT + 30)
def test_ddp_example_under_torchrun() -> None:
    env = {k: v for k, v in os.environ.items() if k not in _LAUNCH_VARS}
    env.update(OMP_NUM_THREADS="1", GRADCOMM_BACKEND="gloo")
    torchrun = Path(sys.executable).parent / "torchrun"
    out = run_command([str(torchrun), "--nproc_per_node", "2", "--master_port", str(free_port()),
                       str(REPO_ROOT / "examples" / "torch_ddp_digits.py"), "--epochs", "3"],
                      timeout=RUN_TIMEOUT, env=env, cwd=REPO_ROOT).stdout
    _check(out, 2)


@pytest.mark.slow
@pytest.mark.mpi
@pytest.mark.timeout(RUN_TIMEOUT + 30)
def test_fsdp2_example_under_mpiexec_over_mpi() -> None:
    out = run_mpi(REPO_ROOT / "examples" / "torch_fsdp2_digits.py", 2, ["--epochs", "3"],
                  env={"GRADCOMM_BACKEND": "mpi"}, timeout=RUN_TIMEOUT).stdout
    _check(out, 2)

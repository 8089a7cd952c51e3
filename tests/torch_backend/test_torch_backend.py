"""init_process_group("gradcomm") in real jobs: torch's functions, DDP, FSDP2, DTensor and
ZeroRedundancyOptimizer against torch's gloo (backend_checks.py), over the gloo and mpi
transports at 2, 3 and 4 ranks, under torchrun's variables and under mpiexec without them; and
every way of making the default group (launch_modes.py)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests._support.dist_utils import free_port, popen_rank, run_mpi, run_processes

HERE = Path(__file__).resolve().parent


def _checks(rank: int, world_size: int) -> list[str]:
    from tests.torch_backend import backend_checks

    return backend_checks.check_all(rank, world_size)


EXPECTED = ["collectives", "point_to_point_and_objects", "sustained_point_to_point",
            "works_and_errors", "ddp",
            "zero_redundancy_optimizer", "fsdp2_mixed_precision", "dtensor_redistribute",
            "two_dim_mesh", "new_group_of_some_ranks"]
#: At 4 ranks these run again on sub-groups of 3 ranks (backend_checks.in_subgroups).
AT_THREE = ["ddp@3", "zero_redundancy_optimizer@3", "fsdp2_mixed_precision@3",
            "dtensor_redistribute@3"]


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.timeout(180)
def test_gloo_transport_under_torchrun_variables_at_2_ranks() -> None:
    got = run_processes(_checks, 2, timeout=150, env={"GRADCOMM_BACKEND": "gloo"})
    assert got == [EXPECTED, EXPECTED]


@pytest.mark.slow
@pytest.mark.mpi
@pytest.mark.timeout(240)
@pytest.mark.parametrize(("transport", "n"), [("gloo", 4), ("mpi", 2), ("mpi", 4)])
def test_under_mpiexec_without_torchrun_variables(transport: str, n: int) -> None:
    """2 and 4 ranks, and 3 (sub-groups of the 4-rank job), over each transport."""
    out = run_mpi(HERE / "backend_checks.py", n, timeout=210,
                  env={"GRADCOMM_BACKEND": transport}).stdout
    expected = EXPECTED + AT_THREE * (n == 4)
    assert [line.split()[1] for line in out.splitlines() if line.startswith("CHECK ")] == expected
    assert out.count(f"RESULT ok {len(expected)} checks") == n, out


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_every_way_of_making_the_default_group(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "GRADCOMM_BACKEND")}
    env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), SLURM_NTASKS="2",
               OMP_NUM_THREADS="1", PYTHONPATH=str(HERE.parent.parent))
    args = [sys.executable, str(HERE / "launch_modes.py"), str(free_port()),
            str(tmp_path / "store"), str(free_port()), str(free_port()), str(free_port())]
    procs = [popen_rank(args, env={**env, "SLURM_PROCID": str(r), "SLURM_LOCALID": str(r)},
                        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for r in range(2)]
    try:
        outs = [p.communicate(timeout=100)[0] for p in procs]
    finally:
        for p in procs:
            p.kill()
    for rank, (p, out) in enumerate(zip(procs, outs, strict=True)):
        assert p.returncode == 0, out
        modes = [line.split()[1] for line in out.splitlines() if line.startswith("MODE ")]
        assert modes == ["srun-env", "explicit-store", "tcp-init-method", "per-device-options",
                         "debug-and-profile", "trace"] + ["abort", "peer-death"] * (rank == 0), out

"""Leaving MPI: a rank that exits while its progress thread is still in an MPI call that timed out
aborts the job with a line naming the call, instead of running MPI_Finalize beside it (which
corrupted MPICH's heap); a rank whose calls all completed exits normally."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from dist_utils import run_mpi

_SCRIPT = '''
import sys, torch, gradcomm
comm = gradcomm.init("mpi", timeout=float(sys.argv[2]))
comm.all_reduce(torch.ones(2))                 # both ranks: the communicator works
if sys.argv[1] == "skip" and comm.rank == 1:
    print("RESULT rank 1 leaves", flush=True)  # skips the next all_reduce and exits
    sys.exit(0)
try:
    t = torch.ones(4)
    comm.all_reduce(t)
    print(f"RESULT rank {comm.rank} sum {t[0].item()}", flush=True)
except gradcomm.CollectiveTimeoutError as exc:
    print(f"RESULT rank {comm.rank} timed out: {exc}", flush=True)
'''


def _run(tmp_path: Path, case: str, timeout: float) -> tuple[int, str, float]:
    script = tmp_path / "exit_case.py"
    script.write_text(_SCRIPT)
    start = time.monotonic()
    proc = run_mpi(script, 2, [case, str(timeout)], timeout=90, check=False,
                   env={"GRADCOMM_MPI_ABORT_ON_ERROR": "1"})
    return proc.returncode, proc.stdout, time.monotonic() - start


@pytest.mark.slow
@pytest.mark.mpi
def test_exit_with_a_timed_out_collective_in_mpi_aborts_the_job_naming_it(tmp_path: Path) -> None:
    code, out, took = _run(tmp_path, "skip", 1.0)
    assert "RESULT rank 0 timed out: all_reduce #1" in out, out
    assert ("gradcomm: rank 0 exits while MPI still runs all_reduce #1 SUM of 4 torch.float32"
            in out), out
    assert code != 0, out
    assert "corrupted" not in out and "double free" not in out, out
    assert took < 60, took  # no wait for the call that timed out


@pytest.mark.slow
@pytest.mark.mpi
def test_exit_after_every_call_completed_is_clean(tmp_path: Path) -> None:
    code, out, _ = _run(tmp_path, "all", 30.0)
    assert code == 0, out
    assert sorted(line for line in out.splitlines() if line.startswith("RESULT")) == [
        "RESULT rank 0 sum 2.0", "RESULT rank 1 sum 2.0"], out
    assert "exits while MPI still runs" not in out, out

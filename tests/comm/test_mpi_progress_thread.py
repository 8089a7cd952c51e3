"""The mpi backend's progress thread, under the real mpiexec: a collective advances while the caller
computes and nobody calls into gradcomm; Ctrl-C interrupts a wait at once and leaves the call to
complete; a rank that exits while its thread is still in an MPI call that timed out aborts the job
with a line naming the call, instead of running MPI_Finalize beside it (which corrupted MPICH's
heap); a rank whose calls all completed exits normally."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from tests._support.dist_utils import run_mpi

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
    # One write per line: the ranks share mpiexec's pipe, and print's separate newline write
    # lets the other rank's line land in between.
    sys.stdout.write(f"RESULT rank {comm.rank} sum {t[0].item()}\\n")
    sys.stdout.flush()
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


_BACKGROUND = '''
import os, signal, threading, time, torch, gradcomm
comm = gradcomm.init("mpi", timeout=30)
comm.barrier()
t, late = torch.ones(1 << 16), torch.ones(4)
if comm.rank == 1:
    time.sleep(0.5)  # joins while rank 0 computes
    comm.all_reduce(t)
    time.sleep(2.5)  # rank 0 waits for this one (from 1.5 s on), and is interrupted meanwhile
    comm.all_reduce(late)
else:
    work = comm.all_reduce(t, async_op=True)
    end = time.monotonic() + 1.5
    while time.monotonic() < end:  # computes; calls nothing of gradcomm's
        torch.mm(torch.ones(64, 64), torch.ones(64, 64))
    # done in the background: is_completed() looks at a flag, it does not wait
    print(f"RESULT rank 0 completed_while_computing={work.is_completed()} sum={t[0].item()}",
          flush=True)
    work = comm.all_reduce(late, async_op=True)
    threading.Timer(0.3, os.kill, (os.getpid(), signal.SIGINT)).start()
    start = time.monotonic()
    try:
        work.wait()
        print("RESULT rank 0 wait returned", flush=True)
    except KeyboardInterrupt:
        print(f"RESULT rank 0 interrupted after {time.monotonic() - start:.2f} s", flush=True)
    work.wait()  # the collective stayed with the thread: it completes when rank 1 comes
    print(f"RESULT rank 0 late sum={late[0].item()}", flush=True)
comm.barrier()
print(f"RESULT rank {comm.rank} ok", flush=True)
'''


@pytest.mark.slow
@pytest.mark.mpi
def test_a_collective_completes_while_the_caller_computes_and_ctrl_c_interrupts_a_wait(
        tmp_path: Path) -> None:
    script = tmp_path / "background.py"
    script.write_text(_BACKGROUND)
    out = run_mpi(script, 2, timeout=90).stdout
    assert "RESULT rank 0 completed_while_computing=True sum=2.0" in out, out
    (line,) = [ln for ln in out.splitlines() if "interrupted after" in ln]
    assert float(line.split()[-2]) < 0.7, line  # the signal came at 0.3 s
    assert "RESULT rank 0 late sum=2.0" in out, out
    assert "RESULT rank 0 ok" in out and "RESULT rank 1 ok" in out, out

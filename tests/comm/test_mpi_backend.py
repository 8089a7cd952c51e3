"""The MPI backend's launches of their own: what needs a fresh process (world size one, mpi4py
imported before init, no mpi4py), a job that must end (a timeout, an uncaught error, the abort
hook), another launcher (gloo rendezvous through MPI, torchrun inside mpiexec), and an init that
times out. Scripts in ``tests/_support/mpi_scripts/`` check values themselves and print
``RESULT ...`` lines that these tests parse; every run is bounded by ``run_mpi``'s timeout, which
kills the whole job. The backend's rank-agnostic tests (collectives, settings agreement) are the
module tier's (``tests/comm/suite_*.py``, run by ``test_rank_suites.py``).
"""

from __future__ import annotations

import re
import sys
import time

import pytest

from tests._support.dist_utils import (
    MPI_SCRIPTS,
    _mpiexec_flags,
    child_env,
    free_port,
    plain_python,
    require_mpi,
    run_command,
    run_mpi,
)

SCRIPTS = MPI_SCRIPTS


def _results(output: str, prefix: str) -> list[str]:
    """The ``RESULT <prefix>...`` records in ``output`` (ranks' lines may be interleaved)."""
    found = re.findall(rf"RESULT {prefix}.*?(?=RESULT |\n|$)", output)
    return [line.rstrip() for line in found]


@pytest.mark.slow
def test_world_size_one_plain_python_issues_no_collective() -> None:
    require_mpi()
    proc = plain_python(
        f"import runpy; runpy.run_path({str(SCRIPTS / 'mpi_backend_single.py')!r}, "
        "run_name='__main__')"
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert _results(proc.stdout, "single") == ["RESULT single calls=0 launcher=single"], proc.stdout


@pytest.mark.slow
@pytest.mark.mpi
def test_world_size_one_mpiexec_issues_no_collective() -> None:
    import torch

    out = run_mpi(SCRIPTS / "mpi_backend_single.py", 1, timeout=60).stdout
    (line,) = _results(out, "single")
    assert line.startswith("RESULT single calls=0 launcher="), out
    assert not line.endswith("launcher=single"), f"mpiexec -n 1 was not detected: {line}"
    # The same script checks that device="cuda" without CUDA raises BackendUnavailableError.
    if not torch.cuda.is_available():
        (cuda,) = _results(out, "cuda-unavailable")
        assert "torch.cuda.is_available() is False" in cuda, cuda


@pytest.mark.slow
@pytest.mark.mpi
def test_timeout_raises_and_job_ends_non_zero() -> None:
    # Rank 1 sleeps 600 s after skipping the collective; only the abort hook ends it in time.
    proc = run_mpi(SCRIPTS / "mpi_backend_timeout.py", 2, ["1"], timeout=40, check=False)
    out = proc.stdout
    assert proc.returncode != 0, out
    (line,) = _results(out, "timeout")
    assert "all_reduce #1 SUM bucket 0 of 8 torch.float32" in line, line
    elapsed = float(re.search(r"elapsed=([0-9.]+)", line).group(1))  # type: ignore[union-attr]
    assert elapsed >= 1.0, f"timed out before the 1 s limit: {line}"
    assert "CollectiveTimeoutError" in out, out
    (broken,) = _results(out, "broken")
    assert "unusable" in broken and "timed out" in broken, broken


@pytest.mark.slow
@pytest.mark.mpi
def test_gloo_under_mpiexec_stalled_rank_ends_the_job() -> None:
    # The gloo rendezvous initialised MPI; without the abort hook rank 0 would time out, then
    # hang in MPI_Finalize at exit waiting for rank 1 (asleep for 600 s).
    start = time.monotonic()
    proc = run_mpi(SCRIPTS / "mpi_backend_timeout.py", 2, ["1", "gloo"], timeout=60, check=False)
    elapsed = time.monotonic() - start
    out = proc.stdout
    assert proc.returncode != 0, out
    (line,) = _results(out, "timeout")
    assert "all_reduce #1 SUM bucket 0 of 8 torch.float32" in line and "gloo" in line, line
    assert float(re.search(r"elapsed=([0-9.]+)", line).group(1)) >= 1.0, line  # type: ignore[union-attr]
    assert elapsed < 40, (elapsed, out)  # the job ended long before rank 1 woke up


@pytest.mark.slow
@pytest.mark.mpi
@pytest.mark.parametrize("api", ["gradcomm", "torch"])
def test_uncaught_error_aborts_the_job_with_its_traceback(api: str) -> None:
    # Rank 0 would wait 300 s in its barrier; the abort hook ends the job when rank 1 raises.
    # Through torch, torch's excepthook holds the traceback in a buffer until the hooks it wraps
    # return: the abort must not lose it.
    proc = run_mpi(SCRIPTS / "mpi_backend_abort.py", 2, ["300", api], timeout=40, check=False,
                   env={"GRADCOMM_BACKEND": "mpi"})
    out = proc.stdout
    assert proc.returncode != 0, out
    assert re.search(r"Traceback \(most recent call last\):\n(.*\n)*ValueError: deliberate "
                     r"failure on rank 1\ngradcomm: uncaught", out), out
    assert out.count("ValueError: deliberate failure on rank 1") == 1, out
    # gradcomm's own line (the launcher's "application called MPI_Abort" can be lost in teardown).
    assert "gradcomm: uncaught ValueError on rank 1: aborting the MPI job" in out, out
    assert not _results(out, "barrier-timeout"), out


@pytest.mark.slow
@pytest.mark.mpi
def test_abort_hook_opt_out() -> None:
    # Without the hook, rank 0 is left in its barrier until the (short) timeout; it then exits
    # with the barrier still in MPI, which aborts the job at exit (MPI_Finalize cannot run beside
    # it), naming the barrier -- not rank 1's error.
    proc = run_mpi(
        SCRIPTS / "mpi_backend_abort.py", 2, ["1"], timeout=40, check=False,
        env={"GRADCOMM_MPI_ABORT_ON_ERROR": "0"},
    )
    out = proc.stdout
    assert proc.returncode != 0, out
    assert "deliberate failure on rank 1" in out, out
    assert _results(out, "barrier-timeout"), out
    assert "MPI_Abort" not in out.split("RESULT barrier-timeout")[0], out
    assert "uncaught ValueError on rank 1" not in out, out
    assert "rank 0 exits while MPI still runs barrier #1" in out, out


@pytest.mark.slow
@pytest.mark.mpi
def test_gloo_rendezvous_through_mpi() -> None:
    out = run_mpi(
        SCRIPTS / "mpi_backend_gloo_rendezvous.py", 2, timeout=60,
        env={"GRADCOMM_BACKEND": "gloo"},
    ).stdout
    assert sorted(_results(out, "gloo")) == [
        "RESULT gloo rank=0 world=2 sum=36.0", "RESULT gloo rank=1 world=2 sum=36.0"
    ], out


@pytest.mark.slow
def test_missing_mpi4py_names_pip_install() -> None:
    # Both through gradcomm.init (the registry's check) and importing the backend module directly.
    proc = plain_python(
        "import sys\n"
        "sys.modules['mpi4py'] = None\n"
        "import gradcomm\n"
        "try:\n"
        "    gradcomm.init('mpi')\n"
        "except ImportError as exc:\n"
        "    print('INIT', exc)\n"
        "try:\n"
        "    import gradcomm.comm.backends.mpi.communicator\n"
        "except ImportError as exc:\n"
        "    print('MODULE', exc)\n"
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = proc.stdout.splitlines()
    assert [line.split()[0] for line in lines] == ["INIT", "MODULE"], proc.stdout
    assert all("pip install mpi4py" in line for line in lines), proc.stdout


@pytest.mark.slow
@pytest.mark.mpi
def test_init_after_mpi4py_was_imported_without_mpi_init() -> None:
    port = str(free_port())
    out = run_mpi(SCRIPTS / "init_without_agreement.py", 2, ["info_first", port], timeout=60).stdout
    assert sorted(_results(out, "noagree")) == [
        f"RESULT noagree info_first rank={r} [3.0, 3.0, 3.0]" for r in range(2)], out


@pytest.mark.slow
@pytest.mark.mpi
@pytest.mark.multiprocess
def test_torchrun_started_by_mpiexec_does_not_initialise_mpi() -> None:
    # torchrun's variables win; its workers were not started by MPI, where PMI_Init fails
    exe = require_mpi()
    env = child_env({"OMP_NUM_THREADS": "1"})
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    cmd = [exe, *_mpiexec_flags(exe), "-n", "1", sys.executable, "-m", "torch.distributed.run",
           "--nproc-per-node", "2", "--master-port", str(free_port()),
           str(SCRIPTS / "init_without_agreement.py"), "torchrun_inside"]
    out = run_command(cmd, timeout=120, env=env).stdout
    assert sorted(_results(out, "noagree")) == [
        f"RESULT noagree torchrun_inside rank={r} [3.0, 3.0, 3.0] mpi4py=False"
        for r in range(2)], out


@pytest.mark.slow
@pytest.mark.mpi
def test_a_rank_that_never_joins_the_settings_check_is_a_timeout_not_a_hang() -> None:
    start = time.monotonic()
    out = run_mpi(SCRIPTS / "init_without_agreement.py", 2, ["local_vs_global"], timeout=60,
                  check=False).stdout
    lines = sorted(_results(out, "noagree"))
    assert lines[0].startswith("RESULT noagree local_vs_global rank=0 CollectiveTimeoutError: "
                               "gradcomm.init: not every rank reached the settings check "
                               "within 1.5 s"), out
    assert lines[1] == "RESULT noagree local_vs_global rank=1 world=1", out
    assert time.monotonic() - start < 45, out


@pytest.mark.slow
@pytest.mark.mpi
def test_init_after_a_timed_out_settings_check_is_refused_not_garbled() -> None:
    out = run_mpi(SCRIPTS / "init_without_agreement.py", 2, ["retry_after_timeout"], timeout=60,
                  check=False).stdout
    # rank 0: a 1 s check that times out, then one refused at once; rank 1, 3 s late: its 1 s
    # check times out too
    got = {line.split(" ", 4)[3] + " " + line.split(" ", 5)[4]: line.split(" ", 5)[5]
           for line in _results(out, "noagree")}
    assert sorted(got) == ["rank=0 t=1", "rank=0 t=10", "rank=1 t=1"], out
    assert got["rank=0 t=10"].startswith("RuntimeError: gradcomm.init: an earlier settings "
                                         "check"), out
    for key in ("rank=0 t=1", "rank=1 t=1"):
        assert got[key].startswith("CollectiveTimeoutError: gradcomm.init: not every rank"), out

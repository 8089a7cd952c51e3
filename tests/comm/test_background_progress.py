"""``Communicator.background_progress``: which transports move data while backward computes."""

from __future__ import annotations

import pytest

from gradcomm.comm import Launcher, LaunchInfo
from gradcomm.comm.backends.gloo import GlooCommunicator

from dist_utils import plain_python, require_mpi


@pytest.mark.parametrize(("cores", "local_world_size", "want"),
                         [(2, 2, False), (4, 2, True), (2, 1, True), (1, 1, False)])
def test_gloo_needs_a_spare_core_per_process(
    monkeypatch: pytest.MonkeyPatch, cores: int, local_world_size: int, want: bool
) -> None:
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: set(range(cores)), raising=False)
    launch = LaunchInfo(0, 1, 0, local_world_size, Launcher.EXPLICIT)
    with GlooCommunicator(launch, timeout=10) as comm:
        assert comm.background_progress is want


@pytest.mark.slow
@pytest.mark.parametrize(("env", "cores", "want"), [
    ({}, 8, False),                                   # no progress thread: only our polls
    ({"MPIR_CVAR_ASYNC_PROGRESS": "1"}, 8, True),
    ({"MPICH_ASYNC_PROGRESS": "1"}, 8, True),
    ({"I_MPI_ASYNC_PROGRESS": "yes"}, 8, True),
    ({"MPIR_CVAR_ASYNC_PROGRESS": "1"}, 1, False),    # the thread has no core of its own
])
def test_mpi_needs_a_progress_thread_and_a_core(env: dict[str, str], cores: int,
                                                want: bool) -> None:
    require_mpi()
    for name in ("MPIR_CVAR_ASYNC_PROGRESS", "MPICH_ASYNC_PROGRESS", "I_MPI_ASYNC_PROGRESS"):
        env.setdefault(name, "")
    # The property reads the variables when asked, so MPI itself need not start its thread here.
    script = (
        "import os, gradcomm\n"
        f"os.sched_getaffinity = lambda pid: set(range({cores}))\n"
        "comm = gradcomm.init('mpi')\n"
        f"for k, v in {env!r}.items(): os.environ[k] = v\n"
        "print('RESULT', comm.background_progress)\n"
    )
    proc = plain_python(script)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"RESULT {want}" in proc.stdout, proc.stdout + proc.stderr

"""``Communicator.background_progress``: which transports move data while backward computes."""

from __future__ import annotations

import pytest

from gradcomm.comm import Launcher, LaunchInfo
from gradcomm.comm.backends.gloo import GlooCommunicator

from tests._support.dist_utils import plain_python, require_mpi


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
def test_mpi_progress_thread_needs_a_core_of_its_own() -> None:
    # The communicator's progress thread sits in MPI for a collective while the caller computes:
    # background progress needs a core for it beside the training thread's.
    require_mpi()
    script = (
        "import os, gradcomm\n"
        "comm = gradcomm.init('mpi')\n"
        "for cores in (1, 2, 8):\n"
        "    os.sched_getaffinity = lambda pid, n=cores: set(range(n))\n"
        "    print('RESULT', cores, comm.background_progress)\n"
    )
    proc = plain_python(script)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    for cores, want in ((1, False), (2, True), (8, True)):
        assert f"RESULT {cores} {want}" in proc.stdout, proc.stdout + proc.stderr

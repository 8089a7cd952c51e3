"""Every test that starts processes carries its markers: ``mpi`` (mpiexec) or ``multiprocess``
(spawned ranks, torchrun), and ``slow``, so the fast tier (``-m "not slow"``) starts none.

conftest.py checks what each test launched through ``dist_utils`` (run_processes, run_mpi,
run_command, popen_rank, fork_rank); this module checks that tests launch only through those,
and that the check itself finds a missing marker.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from tests._support.dist_utils import TESTS_DIR, command_kinds, missing_markers, note_launch

# Ways to start a process that bypass dist_utils' records.
_DIRECT = {"Popen", "Process", "get_context", "spawnv", "fork", "posix_spawn", "system"}


def _direct_launches(path: Path) -> list[str]:
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Call):
            fn = node.func
            name = fn.attr if isinstance(fn, ast.Attribute) else getattr(fn, "id", "")
            if name in _DIRECT:
                found.append(f"{path.name}:{node.lineno} {name}")
    return found


def test_tests_start_processes_only_through_dist_utils() -> None:
    # subprocess.run of one plain Python process is fine: it is no multi-process test.
    # the harness (tests/_support/, dist_utils itself aside) included; its scripts run inside
    # the processes dist_utils started
    helpers = [p for p in sorted((TESTS_DIR / "_support").glob("*.py"))
               if p.name != "dist_utils.py"]
    modules = [*sorted(TESTS_DIR.rglob("test_*.py")), *helpers]
    found = [hit for path in modules for hit in _direct_launches(path)]
    assert found == [], ("start ranks with dist_utils (run_processes, run_mpi, popen_rank, "
                         "fork_rank)")


def test_missing_markers_are_found() -> None:
    assert missing_markers(["mpi", "mpi"], ["parametrize"]) == ["mpi", "slow"]
    assert missing_markers(["mpi", "multiprocess"], ["mpi", "slow"]) == ["multiprocess"]
    assert missing_markers(["mpi"], ["mpi"]) == ["slow"]
    assert missing_markers(["multiprocess"], ["multiprocess", "slow"]) == []
    assert missing_markers([], []) == []


def test_command_kinds() -> None:
    assert command_kinds(["/venv/bin/mpiexec", "-n", "2", "python", "x.py"]) == ["mpi"]
    assert command_kinds(["/venv/bin/torchrun", "--nproc_per_node", "2", "x.py"]) == [
        "multiprocess"]
    assert command_kinds(["mpiexec", "-n", "1", "python", "-m", "torch.distributed.run",
                          "x.py"]) == ["mpi", "multiprocess"]
    assert command_kinds(["python", "-c", "print(1)"]) == []


def test_an_unknown_launch_kind_is_refused() -> None:
    with pytest.raises(ValueError, match="unknown launch kind"):
        note_launch("threads")

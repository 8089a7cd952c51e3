"""The step consistency check and ``GradientReducer.join()`` over real processes.

One spawned gloo job per world size (2 and 3 ranks) and one ``mpiexec`` job per world size run
every case of ``mpi_scripts/step_join_common.py``: a rank that skips a backward makes every rank
raise the same RuntimeError with the gradients and parameters untouched (with copies, in-place
buckets, bucket views, fp16 and PowerSGD compression, no_sync and two forwards per backward), no
false alarm (evaluation under no_grad on one rank, two reducers on one communicator, remove()),
a graph recorded before the reducer is refused on every rank, and join() with 1, 2 and 5 extra
batches on one rank gives the single-process reference gradients and final parameters.
"""

from __future__ import annotations

import os
import re
import sys

import pytest

from dist_utils import REPO_ROOT, TESTS_DIR, run_mpi, run_processes

sys.path.insert(0, str(TESTS_DIR / "mpi_scripts"))
import step_join_common as sj

CASES = list(sj.CASES)
WORLDS = (2, 3)
_gloo: dict[int, list[dict[str, object]]] = {}


def _gloo_results(world_size: int) -> list[dict[str, object]]:
    if world_size not in _gloo:  # one job per world size runs every case
        raw = run_processes(sj.gloo_child, world_size, CASES, 60.0, timeout=400)
        _gloo[world_size] = sj.load_results(raw)
    return _gloo[world_size]


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.timeout(450)
@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("world_size", WORLDS)
def test_gloo(world_size: int, case: str) -> None:
    assert sj.verify_case(case, _gloo_results(world_size), world_size) == []


SCRIPT = TESTS_DIR / "mpi_scripts" / "step_join_values.py"
ENV = {"PYTHONPATH": os.pathsep.join([str(REPO_ROOT), str(TESTS_DIR),
                                      str(TESTS_DIR / "mpi_scripts")])}


@pytest.mark.slow
@pytest.mark.mpi
@pytest.mark.timeout(450)
@pytest.mark.parametrize("world_size", WORLDS)
def test_mpi(world_size: int) -> None:
    out = run_mpi(SCRIPT, world_size, CASES, timeout=400, env=ENV).stdout
    lines = {m.group(1): m.group(2) for m in
             re.finditer(rf"RESULT case=(\w+) world={world_size} (.*?)(?=RESULT |\n|$)", out)}
    assert sorted(lines) == sorted(CASES), out
    assert {case: status for case, status in lines.items() if status != "ok"} == {}, out

"""The main job, examples/train_digits.py, under each launcher it must run under unchanged.

Each launch must exit 0, reach >= 95 % held-out accuracy, and report identical parameters on every
rank; the 2-rank runs must train like the 1-process run (same global batch, so the first epoch's
loss agrees up to float rounding).
"""

from __future__ import annotations

import importlib.util
import os
import re
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from tests._support.dist_utils import REPO_ROOT, free_port, run_command, run_mpi, run_processes

SCRIPT = REPO_ROOT / "examples" / "train_digits.py"
RUN_TIMEOUT = 150.0  # seconds per launch (a run takes about 5-20 s on 2 cores)
_LAUNCH_VARS = (
    "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
    "GRADCOMM_BACKEND",
)

pytestmark = pytest.mark.timeout(RUN_TIMEOUT + 30)


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in _LAUNCH_VARS}
    env["OMP_NUM_THREADS"] = "1"
    return env


def _run(cmd: list[str]) -> str:
    """Run ``cmd`` (must exit 0); the whole process group is killed after RUN_TIMEOUT s."""
    return run_command(cmd, timeout=RUN_TIMEOUT, env=_env(), cwd=REPO_ROOT).stdout


def _check_output(out: str, world_size: int) -> tuple[float, list[float]]:
    """Assert the job's promises; return (final accuracy, per-epoch losses)."""
    # Under mpiexec, stdout and the progress bar's stderr share one pipe and may interleave
    # within a line, so the patterns are not anchored at line starts.
    final = re.findall(r"final held-out accuracy: ([0-9.]+)", out)
    assert len(final) == 1, out  # printed by rank 0 only
    assert float(final[0]) >= 0.95, out
    if world_size == 1:
        assert "parameters sha256 " in out and "identical on all" not in out, out
    else:
        assert f"parameters identical on all {world_size} ranks" in out, out
    epochs = re.findall(r"epoch +(\d+)/10 +loss ([0-9.]+)", out)
    assert [int(e) for e, _ in epochs] == list(range(1, 11)), out  # one line each, rank 0 only
    losses = [float(loss) for _, loss in epochs]
    assert losses[-1] < 0.5 * losses[0], f"loss did not fall: {losses}"
    # Every rank logged, and its records carry its rank.
    for rank in range(world_size):
        assert f"[rank {rank}] train_digits INFO" in out, out
    return float(final[0]), losses


@pytest.fixture(scope="module")
def single_process_losses() -> list[float]:
    out = _run([sys.executable, str(SCRIPT)])
    return _check_output(out, 1)[1]


@pytest.mark.slow  # trains the example for its ten epochs
def test_single_process(single_process_losses: list[float]) -> None:
    assert single_process_losses[0] > single_process_losses[-1]


def _same_training(losses: list[float], reference: list[float]) -> None:
    # The same global batches and averaged gradients: only float rounding may differ.
    assert losses[0] == pytest.approx(reference[0], rel=1e-3), (losses, reference)


@pytest.mark.slow
@pytest.mark.multiprocess
def test_torchrun(single_process_losses: list[float]) -> None:
    torchrun = Path(sys.executable).parent / "torchrun"
    launcher = [str(torchrun)] if torchrun.exists() else [sys.executable, "-m",
                                                          "torch.distributed.run"]
    # A free port, so concurrent runs on one machine do not collide on the default 29500.
    out = _run([*launcher, "--nproc_per_node", "2", "--master_port", str(free_port()),
                str(SCRIPT)])
    _same_training(_check_output(out, 2)[1], single_process_losses)


@pytest.mark.slow
@pytest.mark.mpi
@pytest.mark.parametrize("backend", ["mpi"])  # gloo under mpiexec: tests/comm/test_multihost.py
def test_mpiexec(backend: str, single_process_losses: list[float]) -> None:
    # run_mpi skips, with the pip command, when mpi4py or mpiexec is missing.
    result = run_mpi(SCRIPT, 2, env={"GRADCOMM_BACKEND": backend}, timeout=RUN_TIMEOUT)
    out = result.stdout
    assert f"backend {backend}, 2 rank(s)" in out, out
    _same_training(_check_output(out, 2)[1], single_process_losses)


# ----------------------------------------------------------------------------- digest check
def _load_example() -> Any:
    spec = importlib.util.spec_from_file_location("train_digits", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _diverging_run(rank: int) -> int:
    example = _load_example()
    honest = example.parameter_digest

    def digest(model: torch.nn.Module) -> torch.Tensor:
        out: torch.Tensor = honest(model)
        if rank == 1:
            out[0] += 1  # as if rank 1's parameters had drifted
        return out

    example.parameter_digest = digest
    return int(example.main(["--epochs", "1", "--log-level", "WARNING"]))


def _example_run(args: list[str]) -> Callable[[int], int]:
    return lambda rank: int(_load_example().main(args))


#: Runs of the example in one spawned group of two ranks, in turn, each with its own rendezvous
#: port: name -> (the run on each rank, the exit status every rank must end with).
SPAWNED_RUNS: dict[str, tuple[Callable[[int], int], int]] = {
    # a rank whose parameters differ from the others' must not report success
    "differing-parameters": (_diverging_run, 1),
    # a run whose parameters went non-finite must not report success
    "diverged-training": (_example_run(["--epochs", "2", "--log-level", "ERROR", "--lr", "50"]), 1),
    # a global batch smaller than the world size would leave ranks with empty shards
    "batch-smaller-than-world": (
        _example_run(["--epochs", "2", "--log-level", "ERROR", "--batch-size", "1"]), 2),
    "explicit-cpu-device": (
        _example_run(["--epochs", "1", "--log-level", "WARNING", "--device", "cpu"]), 0),
}


def _spawned_runs(rank: int, world_size: int, ports: list[int]) -> dict[str, int]:
    codes = {}
    for (name, (run, _)), port in zip(SPAWNED_RUNS.items(), ports, strict=True):
        os.environ["MASTER_PORT"] = str(port)  # a rendezvous of its own: the last one has ended
        codes[name] = run(rank)
    return codes


@pytest.fixture(scope="module")
def spawned_exit_codes() -> list[dict[str, int]]:
    """Every rank's exit status of each of :data:`SPAWNED_RUNS` (one launch for them all)."""
    ports = [free_port() for _ in SPAWNED_RUNS]
    return run_processes(_spawned_runs, 2, ports, timeout=RUN_TIMEOUT)


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.parametrize("name", list(SPAWNED_RUNS))
def test_spawned_runs_exit_with_their_status(name: str,
                                             spawned_exit_codes: list[dict[str, int]]) -> None:
    want = SPAWNED_RUNS[name][1]
    assert [codes[name] for codes in spawned_exit_codes] == [want, want]


@pytest.mark.slow
@pytest.mark.parametrize("device", ["nosuch", "cuda:x"])
def test_bad_device_is_a_usage_error(device: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        _load_example().parse_args(["--device", device])
    assert info.value.code == 2
    assert "--device" in capsys.readouterr().err


@pytest.mark.parametrize("lr", ["nan", "inf", "-0.1", "0"])
def test_learning_rate_must_be_finite_and_positive(
    lr: str, capsys: pytest.CaptureFixture[str]
) -> None:
    # --lr nan used to pass the check and end as "training diverged"
    with pytest.raises(SystemExit) as info:
        _load_example().main(["--lr", lr])
    assert info.value.code == 2
    assert "--lr a finite number > 0" in capsys.readouterr().err

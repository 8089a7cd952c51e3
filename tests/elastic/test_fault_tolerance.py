"""Fault tolerance with real processes: gloo workers killed (SIGKILL) in forward, in backward with
buckets in flight and in the optimizer step, two at once, while serving a joining worker; a
worker stopped (SIGSTOP) past the timeout; a worker joining during a step; fewer workers than
the minimum.

Each worker (tests/_support/elastic_worker.py) kills or stops itself at the place the test names,
which is the only way to place a ``kill -9`` inside a given phase of a step; the coordinator is
served by the test process, which is not a worker. Every run compares each survivor's final
parameters with the uninterrupted one-process run (relative 1e-5, the same number of applied
steps), checks that the survivors are bit-identical, and bounds the time of every re-formation.
Several faults share one run to keep the suite short. One run holds the model and every
collective on the fake device of tests/_support/fake_device.py (the CPU proof of the GPU backends'
design: nccl and cupy-nccl are built and aborted the same way, see test_transports.py).
"""

from __future__ import annotations

import signal
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from gradcomm.elastic.coordinator import serve

from tests._support.dist_utils import ForkedRank, child_env, fork_rank
from tests._support.elastic_case import max_rel_diff, reference

WORKER = "tests._support.elastic_worker"
STEPS = 16
HEARTBEAT_TIMEOUT = 1.0
#: A re-formation after a kill takes about the heartbeat timeout; this leaves room for a loaded
#: machine (workers re-forming while others are still starting up).
FORMATION_BOUND_S = HEARTBEAT_TIMEOUT + 6.0

#: Each run's own waits fail it sooner, with the workers' logs; this is the backstop.
pytestmark = [pytest.mark.slow, pytest.mark.multiprocess, pytest.mark.timeout(150)]


class Job:
    """Workers of one fault-tolerant job, with the coordinator served by this process."""

    def __init__(self, tmp_path: Path, flags: tuple[str, ...] = (), **options: Any) -> None:
        self.store = serve("127.0.0.1", 0)
        self.flags = flags
        self.address = f"127.0.0.1:{self.store.port}"
        self.dir = tmp_path
        self.options = {"steps": STEPS, "heartbeat-timeout": HEARTBEAT_TIMEOUT, **options}
        self.procs: dict[str, ForkedRank] = {}

    def start(self, name: str, *args: str) -> None:
        opts = [f"--{k}={v}" for k, v in self.options.items()] + list(self.flags)
        self.procs[name] = fork_rank(
            WORKER, ["--coordinator", self.address, "--out", str(self.dir / f"{name}.pt"),
                     *opts, *args],
            stderr=self.dir / f"{name}.log", env=child_env())

    def step(self) -> int:
        return int(self.store.get("test/step")) if self.store.check(["test/step"]) else -1

    def wait_for_step(self, step: int, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while self.step() < step:
            if time.monotonic() > deadline or all(p.poll() is not None
                                                   for p in self.procs.values()):
                pytest.fail(f"the job did not reach step {step} within {timeout} s\n{self.logs()}")
            time.sleep(0.02)

    def finish(self, timeout: float, stopped: tuple[str, ...] = ()) -> dict[str, Any]:
        """Wait for every worker but ``stopped`` (killed here); return the results by name."""
        deadline = time.monotonic() + timeout
        try:
            for name, proc in self.procs.items():
                if name not in stopped:
                    proc.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            pytest.fail(f"workers did not finish within {timeout} s\n{self.logs()}")
        finally:
            for proc in self.procs.values():
                if proc.poll() is None:
                    proc.kill()
                    proc.wait()
        out = {}
        for name, proc in self.procs.items():
            path = self.dir / f"{name}.pt"
            out[name] = {"exit": proc.returncode,
                         **(torch.load(path) if path.exists() else {})}
        return out

    def logs(self) -> str:
        return "\n".join(f"--- {p.stem}\n{p.read_text()[-3000:]}"
                         for p in sorted(self.dir.glob("*.log")))


def check_survivors(job: Job, results: dict[str, Any], survivors: list[str], dead: list[str],
                    steps: int = STEPS, exit_code: int = 0) -> None:
    """Survivors exited with ``exit_code`` at ``steps`` applied steps, bit-identical and equal
    to the one-process run; the dead were killed; every re-formation within the bound."""
    logs = job.logs()
    for name in dead:
        assert results[name]["exit"] == -signal.SIGKILL, (name, results[name]["exit"], logs)
    ref = reference(steps)
    first = results[survivors[0]]
    for name in survivors:
        r = results[name]
        assert r["exit"] == exit_code, (name, r, logs)
        assert r["step"] == steps, (name, r["step"])
        assert max_rel_diff(r["params"], ref) < 1e-5
        assert all(torch.equal(a, b) for a, b in zip(r["params"], first["params"], strict=True))
        for number, _, seconds in r["generations"][1:]:
            assert seconds < FORMATION_BOUND_S, (name, number, seconds, logs)


def test_kills_in_forward_backward_and_optimizer_and_a_join_during_a_step(
        tmp_path: Path) -> None:
    """4 workers: one killed in forward (step 3), a worker joins during step 5, one killed in
    backward with buckets in flight (step 7), one in the optimizer step (step 11): 4, 3, 4, 3, 2
    workers; the last two end with the one-process run's parameters. The buckets are summed by
    a comm hook whose state holds its communicator: each generation's ``build`` made a new one,
    and each served its own generation only."""
    job = Job(tmp_path, flags=("--hook-state",),
              **{"min-world-size": 2, "world-size": 4, "timeout": 10})
    job.start("w0", "--hold=5")
    job.start("w1", "--fault=forward@3")
    job.start("w2", "--fault=backward@7", "--hold=5")
    job.start("w3", "--fault=optimizer@11", "--hold=5")
    job.wait_for_step(4, timeout=90)
    job.start("joiner")
    results = job.finish(timeout=90)
    check_survivors(job, results, ["w0", "joiner"], ["w1", "w2", "w3"])
    sizes = [size for _, size, _ in results["w0"]["generations"]]
    assert sizes == [4, 3, 4, 3, 2], sizes
    assert [size for _, size, _ in results["joiner"]["generations"]] == [4, 3, 2]
    for name in ("w0", "joiner"):
        states = results[name]["hook_states"]
        numbers = [number for number, _, _ in states]
        assert numbers == sorted(set(numbers)), states  # one state per generation
        trained = {number: size for number, size, _ in results[name]["generations"]}
        assert set(trained) <= set(numbers), states
        assert all(size == trained[number] and calls > 0
                   for number, size, calls in states if number in trained), states


def test_two_killed_at_once_then_the_worker_serving_a_joiner_killed_on_a_fake_device(
        tmp_path: Path) -> None:
    """4 workers, two killed in the same backward (step 4); a worker joins at step 8 and the
    worker sending it the state is killed after its first tensor: the other survivor serves.
    Everything runs on the fake device (tests/_support/fake_device.py) over gloo, as nccl and
    cupy-nccl hold CUDA tensors: re-formation and state transfer are device-correct."""
    job = Job(tmp_path, **{"min-world-size": 2, "world-size": 4, "timeout": 10})
    job.start("w0", "--fault=serve@0", "--hold=8", "--fake-device")
    job.start("w1", "--fault=backward@4", "--fake-device")
    job.start("w2", "--fault=backward@4", "--fake-device")
    job.start("w3", "--fault=serve@0", "--hold=8", "--fake-device")
    job.wait_for_step(7, timeout=90)
    job.start("joiner", "--fake-device")
    results = job.finish(timeout=90)
    served = [n for n in ("w0", "w3") if results[n]["exit"] == -signal.SIGKILL]
    assert len(served) == 1, {n: results[n]["exit"] for n in results}
    survivor = "w3" if served == ["w0"] else "w0"
    check_survivors(job, results, [survivor, "joiner"], ["w1", "w2", *served])
    assert results["joiner"]["generations"][0][1] == 2  # it trained with the other survivor


def test_a_stalled_worker_is_left_out_a_joiner_gets_the_snapshot_and_too_few_raise_zero2(
        tmp_path: Path) -> None:
    """4 workers with a ShardedOptimizer (ZeRO stage 2), min_world_size 3: one stops (SIGSTOP)
    in step 3 and is left out once the timeout passes (its shard of the optimizer state comes
    back from the snapshot); a worker joins during step 6 (the others wait in it) and receives
    the snapshot from a live one; one is killed in step 8's optimizer step, after its shard's
    update and while the others gather the parameters; one is killed in step 12's forward,
    which leaves 2: both survivors, the joiner among them, raise ElasticError with the same
    message, holding the parameters of the 12 steps applied (the snapshot's)."""
    job = Job(tmp_path, **{"min-world-size": 3, "world-size": 4, "timeout": 3,
                           "join-timeout": 2, "zero": 2})
    job.start("w0", "--hold=6")
    job.start("w1", "--fault=stall@3")
    job.start("w2", "--fault=optimizer@8", "--hold=6")
    job.start("w3", "--fault=forward@12", "--hold=6")
    started = time.monotonic()
    job.wait_for_step(5, timeout=90)
    job.start("joiner")
    results = job.finish(timeout=90, stopped=("w1",))
    check_survivors(job, results, ["w0", "joiner"], ["w1", "w2", "w3"], steps=12, exit_code=3)
    errors = {results[n]["error"] for n in ("w0", "joiner")}
    assert errors == {"2 worker(s) alive after generation 4 ended, fewer than min_world_size=3; "
                      "none joined within 2 s"}, errors
    assert [size for _, size, _ in results["w0"]["generations"]] == [4, 3, 4, 3]
    assert [size for _, size, _ in results["joiner"]["generations"]] == [4, 3]
    assert time.monotonic() - started < 120

"""ElasticGroup in one process: its arguments, the step loop of a single worker, a script error
that propagates (the worker leaves), a step that is not entered, and a worker that comes after
the job finished."""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from torch import nn

import gradcomm
from gradcomm import elastic
from gradcomm.elastic.coordinator import parse_address, serve

from tests._support.dist_utils import popen_rank


@pytest.fixture
def coordinator() -> Iterator[tuple[str, object]]:
    store = serve("127.0.0.1", 0)
    yield f"127.0.0.1:{store.port}", store


def _state() -> elastic.State:
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    return elastic.State(model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))


def _build(comm: gradcomm.Communicator, state: elastic.State) -> gradcomm.GradientReducer:
    return gradcomm.GradientReducer(state.model, comm)


def _loss(model: nn.Module, step: int) -> torch.Tensor:
    x = torch.full((3, 4), float(step + 1))
    return model(x).square().mean()


@pytest.mark.parametrize(("kwargs", "error", "message"), [
    (dict(state=None), TypeError, "state must be a gradcomm.elastic.State, got NoneType"),
    (dict(build=3), TypeError, "build must be callable or None, got int"),
    (dict(min_world_size=0), ValueError, "min_world_size must be an int >= 1, got 0"),
    (dict(min_world_size=3, world_size=2), ValueError,
     "world_size (2) must be >= min_world_size (3)"),
    (dict(timeout=0), ValueError, "timeout must be a positive, finite number of seconds, got 0"),
    (dict(heartbeat_timeout="1"), TypeError,
     "heartbeat_timeout must be a number of seconds, got str"),
    (dict(join_timeout=float("inf")), ValueError,
     "join_timeout must be a positive, finite number of seconds, got inf"),
    (dict(job_id="a/b"), ValueError, "job_id must be a non-empty str without '/', got 'a/b'"),
    (dict(backend="mpi"), ValueError, "fault tolerance needs a group that can be re-formed"),
    (dict(device="cuda"), ValueError, "the gloo backend works on cpu tensors, not cuda"),
    (dict(coordinator="nohost"), ValueError,
     "coordinator address must be 'host:port' with a port in 1..65535, got 'nohost'"),
])
def test_bad_arguments_raise_early(kwargs: dict[str, object], error: type[Exception],
                                   message: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    args: dict[str, object] = {"state": _state(), "build": _build, "backend": "gloo",
                               "coordinator": "127.0.0.1:1", **kwargs}
    state = args.pop("state")
    with pytest.raises(error) as info:
        elastic.ElasticGroup(state, **args)  # type: ignore[arg-type]
    assert str(info.value).startswith(message), str(info.value)
    assert len(str(info.value)) <= 200


@pytest.mark.parametrize("stage", [1, 2])
def test_a_sharded_optimizer_is_rebuilt_and_snapshotted_every_step(
        coordinator: tuple[str, object], stage: int) -> None:
    address, _ = coordinator
    state, ref = _state(), _state()
    state.optimizer = None

    def sharded(comm: gradcomm.Communicator, st: elastic.State) -> gradcomm.GradientReducer:
        reducer = gradcomm.GradientReducer(st.model, comm)
        st.optimizer = gradcomm.ShardedOptimizer(reducer, torch.optim.SGD, stage=stage, lr=0.1,
                                                 momentum=0.9)
        return reducer

    with elastic.ElasticGroup(state, sharded, coordinator=address, backend="gloo",
                              snapshot_every=2, job_id=f"zero{stage}") as group:
        snapshots = []
        for step in group.steps(5):
            with step:
                state.optimizer.zero_grad()  # type: ignore[union-attr]
                _loss(state.model, step.index).backward()
                state.optimizer.step()  # type: ignore[union-attr]
            assert state.snapshot is not None
            snapshots.append(state.snapshot["step"])
        assert isinstance(state.optimizer, gradcomm.ShardedOptimizer)
    assert snapshots == [0, 2, 2, 4, 4]  # taken at the formation, then every 2 steps
    for step in range(5):
        ref.optimizer.zero_grad()  # type: ignore[union-attr]
        _loss(ref.model, step).backward()
        ref.optimizer.step()  # type: ignore[union-attr]
    assert all(torch.allclose(a, b, rtol=1e-6) for a, b in zip(
        state.model.parameters(), ref.model.parameters(), strict=True))
    # the snapshot holds the full optimizer state, in torch's format, on the host
    assert state.snapshot is not None
    momentum = state.snapshot["optimizer"]["state"][0]["momentum_buffer"]
    assert momentum.device.type == "cpu" and momentum.shape == (2, 4)


def test_no_coordinator_and_an_unreachable_one(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(elastic.COORDINATOR_ENV, raising=False)
    with pytest.raises(ValueError, match="no coordinator: pass coordinator='host:port' or set "
                                         "GRADCOMM_COORDINATOR"):
        elastic.ElasticGroup(_state(), _build, backend="gloo")
    with pytest.raises(RuntimeError, match=r"no elastic coordinator answered at 127\.0\.0\.1:1 "):
        elastic.ElasticGroup(_state(), _build, backend="gloo", coordinator="127.0.0.1:1",
                             timeout=0.5)
    assert parse_address("[::1]:29400") == ("::1", 29400)


def test_one_worker_trains_commits_each_step_and_finishes(
        coordinator: tuple[str, object]) -> None:
    address, _ = coordinator
    state = _state()
    ref = _state()
    with elastic.ElasticGroup(state, _build, coordinator=address, backend="gloo",
                              world_size=1) as group:
        assert "not formed" in repr(group)
        with pytest.raises(RuntimeError, match="no generation is formed yet"):
            _ = group.comm
        seen = []
        for step in group.steps(3):
            with step as comm:
                seen.append((step.index, comm.world_size, group.generation))
                state.optimizer.zero_grad()  # type: ignore[union-attr]
                _loss(state.model, step.index).backward()
                state.optimizer.step()  # type: ignore[union-attr]
        assert seen == [(0, 1, 1), (1, 1, 1), (2, 1, 1)] and state.step == 3
        assert isinstance(group.reducer, gradcomm.GradientReducer)
        assert list(group.steps(3)) == []  # already there: nothing more to do
    for step in range(3):
        ref.optimizer.zero_grad()  # type: ignore[union-attr]
        _loss(ref.model, step).backward()
        ref.optimizer.step()  # type: ignore[union-attr]
    assert all(torch.equal(a, b) for a, b in zip(state.model.parameters(),
                                                ref.model.parameters(), strict=True))
    late = elastic.ElasticGroup(_state(), _build, coordinator=address, backend="gloo")
    with pytest.raises(elastic.ElasticError, match="the job finished at step 3"):
        next(iter(late.steps(3)))
    late.close()


def test_a_script_error_propagates_and_the_worker_leaves(
        coordinator: tuple[str, object]) -> None:
    address, store = coordinator
    group = elastic.ElasticGroup(_state(), _build, coordinator=address, backend="gloo")
    with pytest.raises(ValueError, match="a bug in the script"):
        for step in group.steps(5):
            with step:
                raise ValueError("a bug in the script")
    left = f"gradcomm-elastic/default/left/{group.worker_id}"
    assert store.check([left])  # type: ignore[attr-defined]
    assert store.get(left).startswith(b"raised ValueError")  # type: ignore[attr-defined]
    group.close()


def test_a_step_must_be_entered(coordinator: tuple[str, object]) -> None:
    address, _ = coordinator
    with elastic.ElasticGroup(_state(), _build, coordinator=address, backend="gloo") as group:
        steps = group.steps(2)
        next(steps)
        with pytest.raises(RuntimeError, match="enter each step with 'with step as comm:'"):
            next(steps)
    with pytest.raises(RuntimeError, match="this ElasticGroup is closed"):
        next(iter(group.steps(2)))


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.timeout(60)
def test_a_worker_raises_once_the_coordinator_dies(tmp_path: Path) -> None:
    """The coordinator in a process of its own (python -m gradcomm.elastic), killed while a
    worker trains: the worker's next step raises ElasticError, within a heartbeat or two."""
    address_file = tmp_path / "coordinator"
    coordinator = popen_rank([sys.executable, "-m", "gradcomm.elastic", "--host", "127.0.0.1",
                              "--port", "0", "--address-file", str(address_file)],
                             stdout=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 60
        while not address_file.exists():
            assert time.monotonic() < deadline and coordinator.poll() is None
            time.sleep(0.02)
        address = address_file.read_text().strip()
        state = _state()
        group = elastic.ElasticGroup(state, _build, coordinator=address, backend="gloo",
                                     heartbeat_timeout=0.5)
        with pytest.raises(elastic.ElasticError) as info:
            for step in group.steps(10**6):
                with step:
                    if step.index == 3:
                        coordinator.kill()
                        coordinator.wait()
                        killed = time.monotonic()
        assert time.monotonic() - killed < 2.0
        assert str(info.value).startswith(f"the elastic coordinator at {address} stopped "
                                          "answering (")
        assert str(info.value).endswith("); the job cannot re-form without it")
        group.close()  # the coordinator is gone: leaving cannot tell it, and does not hang
    finally:
        coordinator.kill()
        coordinator.wait()
    out = coordinator.stdout.read() if coordinator.stdout else ""
    assert out.startswith(f"gradcomm elastic coordinator listening on {address}"), out

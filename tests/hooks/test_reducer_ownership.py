"""One reducer per parameter: apply_gradient_allreduce twice is one reducer; a second
GradientReducer over parameters a live reducer owns raises; remove() releases them
(thread backend: logic only)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from gradcomm.comm.backends.threads import ThreadCommunicator, ThreadGroup
from gradcomm.hooks import GradientReducer, apply_gradient_allreduce


def _run(fn: Any, world_size: int = 2) -> list[Any]:
    def body(comm: ThreadCommunicator) -> Any:
        try:
            return fn(comm)
        except Exception as exc:  # noqa: BLE001 - the test inspects it
            return exc

    return ThreadGroup(world_size, timeout=20).run(body)


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 3), nn.Linear(3, 2))


def test_apply_twice_is_one_reducer_sending_each_bucket_once() -> None:
    def fn(comm: ThreadCommunicator) -> tuple[bool, int, torch.Tensor]:
        model = apply_gradient_allreduce(_model(), comm)
        first = model.gradient_reducer
        again = apply_gradient_allreduce(model, comm)
        sent: list[str] = []
        original = comm.all_reduce

        def spy(*args: Any, **kwargs: Any) -> Any:
            sent.append(str(kwargs.get("label", "")))
            return original(*args, **kwargs)

        comm.all_reduce = spy  # type: ignore[method-assign]
        x = torch.full((2, 4), float(comm.rank + 1))
        model(x).sum().backward()
        return again.gradient_reducer is first, len(sent), model[0].bias.grad.clone()

    out = _run(fn)
    for same, calls, grad in out:
        assert same
        # one bucket (25 MiB cap), which carries the control values: not two
        assert calls == 1
        assert torch.equal(grad, out[0][2])


def test_second_reducer_over_owned_parameters_raises_until_removed() -> None:
    def fn(comm: ThreadCommunicator) -> tuple[str, bool]:
        model = _model()
        first = GradientReducer(model, comm)
        with pytest.raises(RuntimeError) as info:
            GradientReducer(list(model[1].named_parameters()), comm)
        first.remove()
        second = GradientReducer(model, comm)  # released by remove()
        return str(info.value), second.module is model

    for message, ok in _run(fn):
        assert message == ("parameter weight is already reduced by another GradientReducer; "
                           "call remove() on that one first, or build one reducer for the whole "
                           "model")
        assert ok


def test_apply_again_on_another_communicator_raises() -> None:
    def fn(comm: ThreadCommunicator) -> str:
        model = apply_gradient_allreduce(_model(), comm)
        other = ThreadGroup(1).communicator(0)
        with pytest.raises(RuntimeError) as info:
            apply_gradient_allreduce(model, other)
        return str(info.value)

    for message in _run(fn):
        assert message == ("apply_gradient_allreduce: the module already has a gradient_reducer "
                           "on another communicator; call module.gradient_reducer.remove() first")

"""Comm hooks: built-in compression against references, selection, and user-supplied hooks."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch

import gradcomm
from gradcomm.comm.backends.threads import ThreadCommunicator, ThreadGroup
from gradcomm.hooks import (
    CommHook,
    GradBucket,
    GradientReducer,
    allreduce_hook,
    compress_wrapper,
)
from gradcomm.hooks.choice import resolve_comm_hook

from tests._support.reducer_common import (
    batch,
    eval_bn,
    grads_close,
    loss_fn,
    make_model,
    reference_grads,
)


def _run(world_size: int, fn: Any) -> list[Any]:
    return ThreadGroup(world_size, timeout=20).run(fn)


@pytest.mark.parametrize(("hook", "rtol"), [
    ("fp16_compress", 2e-3),  # float16: 11-bit significand
    (CommHook.BF16_COMPRESS, 1.6e-2),  # bfloat16: 8-bit significand
    ("allreduce", 1e-6),
])
@pytest.mark.parametrize("in_place", [math.inf, 0.0009])
def test_builtin_hooks_match_reference_within_dtype_tolerance(
    hook: Any, rtol: float, in_place: float
) -> None:
    ws = 2
    ref = reference_grads(ws)

    def fn(comm: ThreadCommunicator) -> Any:
        model = eval_bn(make_model())
        GradientReducer(model, comm, comm_hook=hook, bucket_cap_mb=0.002,
                        first_bucket_cap_mb=0.0005, in_place_min_mb=in_place)
        loss_fn(model, *batch(comm.rank)).backward()
        return {n: p.grad for n, p in model.named_parameters()}

    out = _run(ws, fn)
    assert grads_close(out[0], ref, rtol=rtol) == []
    if hook != "allreduce":  # compression really happened: not equal to the exact result
        assert grads_close(out[0], ref, rtol=1e-6) != []
    for name, g in out[0].items():
        assert g.dtype == torch.float32 and torch.equal(g, out[1][name])


@pytest.mark.parametrize("in_place", [math.inf, 0.0009])
def test_user_hook_receives_bucket_and_result_is_written_back(in_place: float) -> None:
    ws = 2
    seen: list[tuple[int, int, int, tuple[str, ...], bool, bool]] = []
    ref = reference_grads(ws)

    def my_hook(state: dict[str, Any], bucket: GradBucket) -> gradcomm.Work:
        comm = state["comm"]
        seen.append((comm.rank, bucket.index(), bucket.buffer().numel(), bucket.param_names,
                     bucket.is_last(), bucket.in_place))
        if bucket.in_place:  # the buffer is the parameter's gradient itself
            (p,) = bucket.parameters()
            assert bucket.buffer().data_ptr() == p.grad.data_ptr()
        assert bucket.gradients().numel() == sum(p.numel() for p in bucket.parameters())
        return comm.all_reduce(bucket.buffer(), "sum", async_op=True)

    def fn(comm: ThreadCommunicator) -> Any:
        model = eval_bn(make_model())
        reducer = GradientReducer(model, comm, bucket_cap_mb=0.002, first_bucket_cap_mb=0.0005,
                                  in_place_min_mb=in_place)
        reducer.register_comm_hook(my_hook, state={"comm": comm})
        loss_fn(model, *batch(comm.rank)).backward()
        return {n: p.grad for n, p in model.named_parameters()}, reducer.buckets

    out = _run(ws, fn)
    assert grads_close(out[0][0], ref) == []
    infos = out[0][1]
    mine = sorted(s[1:] for s in seen if s[0] == 0)
    assert [m[0] for m in mine] == [b.index for b in infos]
    for (index, numel, names, last, in_place_seen), info in zip(mine, infos, strict=True):
        assert in_place_seen == info.in_place
        # gradients only: the presence flags travel in the reducer's control tensor
        assert numel == info.numel
        assert names == info.param_names and last == (index == len(infos) - 1)
    assert any(info.in_place for info in infos) == (in_place < 1)


def test_compress_wrapper_composes_with_a_user_hook() -> None:
    dtypes: list[torch.dtype] = []

    def spy(state: Any, bucket: GradBucket) -> gradcomm.Work:
        dtypes.append(bucket.buffer().dtype)
        return allreduce_hook(state, bucket)

    def fn(comm: ThreadCommunicator) -> Any:
        p = torch.nn.Parameter(torch.zeros(5))
        GradientReducer([p], comm, comm_hook=compress_wrapper(spy, torch.float16))
        (p * (comm.rank + 1.0)).sum().backward()
        return p.grad

    for g in _run(2, fn):
        assert torch.equal(g, torch.full((5,), 1.5))
    assert dtypes == [torch.float16, torch.float16]


def test_hook_selection_and_bad_hooks() -> None:
    assert resolve_comm_hook("FP16-compress") is CommHook.FP16_COMPRESS.hook
    assert resolve_comm_hook(CommHook.ALLREDUCE) is allreduce_hook
    assert resolve_comm_hook(allreduce_hook) is allreduce_hook
    with pytest.raises(ValueError, match="allreduce, fp16_compress, bf16_compress"):
        resolve_comm_hook("topk")
    with pytest.raises(TypeError):
        resolve_comm_hook(3)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="floating-point"):
        compress_wrapper(allreduce_hook, torch.int8)

    def fn(comm: ThreadCommunicator) -> Any:
        p = torch.nn.Parameter(torch.zeros(3))
        not_a_hook: Any = lambda s, b: None  # noqa: E731 - returns None, not a Work
        GradientReducer([p], comm, comm_hook=not_a_hook)
        try:
            p.sum().backward()
        except TypeError as exc:
            return str(exc)
        return "no error"

    for msg in _run(2, fn):
        assert "not a gradcomm Work" in msg

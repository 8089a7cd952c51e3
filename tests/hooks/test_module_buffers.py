"""ModuleBuffers: the module's buffers as named_buffers() gives them, without a walk per forward."""

from __future__ import annotations

import torch
from torch import nn

from gradcomm.hooks._structure import ModuleBuffers, StructureWatch


def _expected(model: nn.Module) -> list[torch.Tensor]:
    return [b for _, b in model.named_buffers()]


def _same(got: list[torch.Tensor], want: list[torch.Tensor]) -> bool:
    return len(got) == len(want) and all(a is b for a, b in zip(got, want, strict=True))


class _Counting(nn.Sequential):
    walks = 0

    def modules(self):  # type: ignore[no-untyped-def, override]
        type(self).walks += 1
        return super().modules()


def test_module_buffers_follow_named_buffers_through_every_change() -> None:
    shared = nn.BatchNorm1d(3)
    model = _Counting(nn.Linear(3, 3), nn.BatchNorm1d(3), shared, nn.Sequential(shared))
    model.register_buffer("none", None)
    watch = StructureWatch()
    try:
        table = ModuleBuffers(model, watch)
        assert _same(table.current(), _expected(model))
        walks = _Counting.walks
        for _ in range(3):  # nothing registered: no walk
            assert _same(table.current(), _expected(model))
        assert _Counting.walks == walks
        model.double()  # torch writes the tables directly: read through them, still no walk
        assert _same(table.current(), _expected(model))
        assert table.current()[0].dtype == torch.float64 and _Counting.walks == walks
        model[1].running_mean = torch.zeros(3)  # reassigned: a registration, walked again
        assert _same(table.current(), _expected(model)) and _Counting.walks == walks + 1
        model.register_buffer("extra", torch.ones(2))
        model.add_module("more", nn.BatchNorm1d(2))
        assert _same(table.current(), _expected(model))
        del model[1].running_var  # not seen by any hook: skipped
        assert _same(table.current(), _expected(model))
    finally:
        watch.close()

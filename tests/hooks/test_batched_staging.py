"""Small gradients staged together at their bucket's send (``SharedBucket.stage_batched``) give the
same values, bit for bit, and the same ``.grad`` objects as staging each one in its own hook.

Ranks are threads of this process (the thread backend): the logic, not a transport, is tested.
The one-by-one path is the same reducer with ``BATCH_MAX_NUMEL`` 0 (every gradient eager).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from gradcomm.comm.backends.threads import ThreadCommunicator, ThreadGroup
from gradcomm.hooks import GradientReducer, _buckets

from tests._support.reducer_common import seeded

# Outputs of the large layer: its weight is above the batching size (read once, before a test
# changes that size).
_WIDE = _buckets.BATCH_MAX_NUMEL // 40 + 1


class Mixed(nn.Module):
    """40 one-element scales, a weight above the batching size, two small layers, and a bias that
    rank 1 never uses (its gradient is None there)."""

    def __init__(self) -> None:
        super().__init__()
        self.scales = nn.ParameterList(nn.Parameter(1.0 + 0.1 * torch.randn(1)) for _ in range(40))
        self.big = nn.Linear(40, _WIDE)
        self.head = nn.Linear(self.big.out_features, 3)
        self.extra = nn.Parameter(torch.randn(3))

    def forward(self, x: torch.Tensor, use_extra: bool) -> torch.Tensor:
        out = self.head(torch.tanh(self.big(x * torch.cat(list(self.scales)))))
        return out + self.extra if use_extra else out


def _train(comm: ThreadCommunicator, view: bool, set_to_none: bool, overlap: bool) -> list[Any]:
    with seeded(0):  # the ranks are threads sharing torch's RNG
        model = Mixed()
    reducer = GradientReducer(model, comm, gradient_as_bucket_view=view, overlap=overlap,
                              bucket_cap_mb=0.02, first_bucket_cap_mb=0.001)
    gen = torch.Generator().manual_seed(100 + comm.rank)
    seen: list[Any] = []
    for step in range(3):
        model.zero_grad(set_to_none=set_to_none)
        x = torch.randn(5, 40, generator=gen)
        model(x, use_extra=comm.rank == 0 or step == 2).square().mean().backward()
        seen.append({n: None if p.grad is None else p.grad.clone()
                     for n, p in model.named_parameters()})
        if view:  # every gradient present is its bucket's view
            seen.append([p.grad is None or any(p.grad is v for b in reducer._buckets
                                               for v in b.views)
                         for p in model.parameters()])
    reducer.remove()
    return seen


@pytest.mark.parametrize("overlap", [True, False])
@pytest.mark.parametrize("set_to_none", [True, False])
@pytest.mark.parametrize("view", [False, True])
def test_batched_staging_matches_one_by_one_bit_for_bit(
    view: bool, set_to_none: bool, overlap: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    def run() -> list[Any]:
        out = ThreadGroup(2, timeout=20.0).run(
            lambda comm: _train(comm, view, set_to_none, overlap))
        for r in out:
            assert not isinstance(r, Exception), r
        return out

    batched = run()
    monkeypatch.setattr(_buckets, "BATCH_MAX_NUMEL", 0)
    one_by_one = run()
    assert len(batched[0]) == len(one_by_one[0])
    for rank in range(2):
        for got, want in zip(batched[rank], one_by_one[rank], strict=True):
            if isinstance(want, list):
                assert got == want and all(want)
                continue
            assert got.keys() == want.keys()
            for name, g in got.items():
                w = want[name]
                assert (g is None) == (w is None), name
                assert g is None or (g.dtype == w.dtype and torch.equal(g, w)), name
    # rank 1 had no gradient for `extra` in steps 0 and 1, and both ranks agree
    assert batched[0][0]["extra"] is not None
    assert torch.equal(batched[0][-1 if not view else -2]["extra"],
                       batched[1][-1 if not view else -2]["extra"])


def test_buckets_stage_small_gradients_together_and_large_ones_in_their_hooks() -> None:
    def fn(comm: ThreadCommunicator) -> list[tuple[int, int]]:
        with seeded(0):
            model = Mixed()
        reducer = GradientReducer(model, comm)
        return [(len(b._batched_slots), len(b.eager_slots)) for b in reducer._buckets]

    for layout in ThreadGroup(2, timeout=20.0).run(fn):
        # one bucket: 44 small parameters (40 scales, big.bias, head.weight/bias, extra) and
        # the one large weight
        assert layout == [(44, 1)]

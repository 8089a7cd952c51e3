"""overlapping_grads against a brute-force element-by-element reference."""

from __future__ import annotations

import random

import pytest
import torch
from torch import nn

from gradcomm.hooks._overlap import overlapping_grads as _overlapping


def overlapping_grads(params: list[nn.Parameter]) -> frozenset[int]:
    return _overlapping([p.grad for p in params], [p.numel() * p.element_size() for p in params])


def _reference(params: list[nn.Parameter]) -> frozenset[int]:
    """Start addresses of grads whose elements share memory with another grad's elements."""
    cells: dict[int, set[int]] = {}
    for i, p in enumerate(params):
        g = p.grad
        if g is None or not g.numel():
            continue
        size = g.element_size()
        idx = torch.arange(g.numel()).reshape(g.shape) if g.dim() else torch.tensor(0)
        offsets = sum((idx // max(1, int(torch.tensor(g.shape[k + 1:]).prod())) % n) * st
                      for k, (n, st) in enumerate(zip(g.shape, g.stride(), strict=True)))
        for off in torch.as_tensor(offsets).flatten().tolist():
            for b in range(size):
                cells.setdefault(g.data_ptr() + off * size + b, set()).add(i)
    shared = {i for owners in cells.values() if len(owners) > 1 for i in owners}
    return frozenset(params[i].grad.data_ptr() for i in shared)  # type: ignore[union-attr]


def _random_grads(rng: random.Random) -> list[nn.Parameter]:
    buf = torch.zeros(64)
    params = []
    for _ in range(rng.randint(1, 6)):
        start, length = rng.randint(0, 40), rng.randint(0, 12)
        step = rng.choice([1, 1, 2, 3])
        g = buf[start: start + length * step: step]
        if rng.random() < 0.2 and g.numel() >= 4:
            g = g[: g.numel() // 2 * 2].view(-1, 2).t()  # non-contiguous 2-D
        p = nn.Parameter(torch.zeros(g.shape))
        p.grad = g
        params.append(p)
    if rng.random() < 0.5:  # a gradient of its own, and one missing
        p = nn.Parameter(torch.zeros(3))
        p.grad = torch.ones(3)
        params += [p, nn.Parameter(torch.zeros(2))]
    return params


@pytest.mark.parametrize("seed", range(200))
def test_overlapping_grads_matches_the_element_by_element_reference(seed: int) -> None:
    # The fast check may only send a case to the exact one, never answer "none" wrongly; the
    # exact one compares byte spans, so it may flag more than the grads that share elements
    # (interleaved strided views), never fewer.
    params = _random_grads(random.Random(seed))
    found = overlapping_grads(params)
    assert _reference(params) <= found


def test_disjoint_views_of_one_buffer_are_not_overlapping() -> None:
    buf = torch.zeros(5000)
    params = [nn.Parameter(torch.zeros(1)) for _ in range(5000)]
    for p, g in zip(params, buf.split(1), strict=True):
        p.grad = g
    assert overlapping_grads(params) == frozenset()
    params[7] = nn.Parameter(torch.zeros(2))
    params[7].grad = buf[7:9]  # now overlaps its neighbour's
    assert overlapping_grads(params) == {buf[7:].data_ptr(), buf[8:].data_ptr()}

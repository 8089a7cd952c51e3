"""Which gradients overlap in memory (see :func:`overlapping_grads`)."""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["overlapping_grads"]


def overlapping_grads(params: list[nn.Parameter]) -> frozenset[int]:
    """Start addresses (``data_ptr()``) of the gradients whose memory overlaps the gradient of
    another parameter.

    Autograd can give two parameters views of one memory as gradients (two ``p.unsqueeze(0)``
    added to one activation, batch of 1): reducing both in place would divide and sum that
    memory twice, and writing the results back into it would leave the last one in both --
    and keep them aliased, so that with ``zero_grad(set_to_none=False)`` the next backward
    adds both parameters' gradients into one memory. Such gradients are sent as copies and
    get tensors of their own at write-back. Views that share a storage without overlapping
    (``torch.stack`` of parameters, or a flat gradient buffer of the user's with ``p.grad``
    set to views of it, as apex does) are reduced and written back where they lie, as DDP
    does. Cheap when no storage is shared: one ``untyped_storage().data_ptr()`` per
    gradient; only grads in a shared storage have their byte extents compared.
    """
    by_storage: dict[int, list[torch.Tensor]] = {}
    shared = False
    for p in params:
        g = p.grad
        if g is not None and g.numel():
            try:
                ptr = g.untyped_storage().data_ptr()
            except NotImplementedError:  # sparse: its bucket's send refuses it, naming it
                continue
            views = by_storage.setdefault(ptr, [])
            views.append(g)
            shared = shared or len(views) > 1
    if not shared:
        return frozenset()
    spans = []  # (first byte, one past the last byte) of each grad in a shared storage
    for views in by_storage.values():
        if len(views) > 1:
            for g in views:
                last = sum((n - 1) * st for n, st in zip(g.shape, g.stride(), strict=True))
                spans.append((g.data_ptr(), g.data_ptr() + (last + 1) * g.element_size()))
    spans.sort()
    overlapping: set[int] = set()
    active: list[tuple[int, int]] = []  # spans that reach past the current start
    for first, stop in spans:
        active = [(a, b) for a, b in active if b > first]
        if active:
            overlapping.add(first)
            overlapping.update(a for a, _ in active)
        active.append((first, stop))
    return frozenset(overlapping)


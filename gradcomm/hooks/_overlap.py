"""Which gradients overlap in memory (see :func:`overlapping_grads`)."""

from __future__ import annotations

import operator
from functools import partial
from itertools import compress

import torch

__all__ = ["overlapping_grads"]

_present = partial(operator.is_not, None)


def _maybe_overlapping(grads: list[torch.Tensor | None], nbytes: list[int]) -> bool:
    """False when no two of ``grads`` (None: no gradient) can overlap in memory; True when some
    may (or a sparse one has no address). ``nbytes[i]`` is ``grads[i].nbytes``, known from its
    parameter (a gradient has its parameter's shape and dtype). Conservative: a span
    ``[data_ptr, data_ptr + nbytes)`` is exact for a contiguous gradient, and any non-contiguous
    one sends the caller to the exact check.

    Sorted by start, disjoint spans each end before the next starts; anything else may overlap.
    Every step is a C call over all of them (``map``, ``sorted``), and nothing is allocated per
    gradient that outlives the call, so the common case costs no Python step per parameter.
    """
    present = list(map(_present, grads))
    tensors: list[torch.Tensor] = list(compress(grads, present))  # type: ignore[arg-type]
    if len(tensors) != len(grads):
        nbytes = list(compress(nbytes, present))
    try:
        if not all(map(torch.Tensor.is_contiguous, tensors)):
            return True
        starts = list(map(torch.Tensor.data_ptr, tensors))
    except (RuntimeError, NotImplementedError):  # sparse: the exact check skips it
        return True
    ends = list(map(operator.add, starts, nbytes))
    order = sorted(range(len(starts)), key=starts.__getitem__)
    first = list(map(starts.__getitem__, order))
    stop = list(map(ends.__getitem__, order))
    return not all(map(operator.ge, first[1:], stop[:-1]))


def overlapping_grads(grads: list[torch.Tensor | None], nbytes: list[int]) -> frozenset[int]:
    """Start addresses (``data_ptr()``) of the gradients whose memory overlaps the gradient of
    another parameter (``grads``: each parameter's ``.grad``; ``nbytes``: each one's size in
    bytes, as its parameter's).

    Autograd can give two parameters views of one memory as gradients (two ``p.unsqueeze(0)``
    added to one activation, batch of 1): reducing both in place would divide and sum that
    memory twice, and writing the results back into it would leave the last one in both --
    and keep them aliased, so that with ``zero_grad(set_to_none=False)`` the next backward
    adds both parameters' gradients into one memory. Such gradients are sent as copies and
    get tensors of their own at write-back. Views that share a storage without overlapping
    (``torch.stack`` of parameters, or a flat gradient buffer of the user's with ``p.grad``
    set to views of it, as apex does) are reduced and written back where they lie, as DDP
    does. Each backward pays :func:`_maybe_overlapping` (no Python step per gradient); only
    when it finds spans that may overlap are the gradients grouped by storage and their byte
    extents compared one by one.
    """
    if not _maybe_overlapping(grads, nbytes):
        return frozenset()
    by_storage: dict[int, list[torch.Tensor]] = {}
    shared = False
    for g in grads:
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


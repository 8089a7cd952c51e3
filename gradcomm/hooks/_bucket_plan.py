"""Bucket layout: which gradients share a bucket (:func:`assign_buckets`), where each lies in it
(:func:`dense_strides`), and the read-only :class:`BucketInfo` the reducer shows.

Trainable parameters are grouped by (device, dtype) in reverse registration order -- roughly the
order backward produces their gradients -- each bucket closed when it reaches its cap (the first
one ``first_cap``), as torch DDP's reducer lays them out. A gradient of at least the in-place
threshold is a bucket of its own, reduced in ``param.grad`` itself (as Horovod reduces tensors);
those come after the shared buckets.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

__all__ = ["BucketInfo", "Entry", "assign_buckets", "bucket_strides", "dense_strides"]

#: ``(registration index, name, parameter)`` of one trainable parameter.
Entry = tuple[int, str, nn.Parameter]


@dataclass(frozen=True)
class BucketInfo:
    """Read-only description of one bucket (see :attr:`GradientReducer.buckets`).

    Attributes:
        index: launch order (0 first, holding the gradients backward produces first).
        device: device of the flat buffer. dtype: its dtype.
        numel: number of gradient elements. nbytes: ``numel * element size`` (bytes).
        param_names: names of its parameters, in buffer order.
        in_place: the bucket is one parameter whose gradient is all-reduced in place in
            ``param.grad`` (see ``in_place_min_mb``); it has no buffer of its own.
    """

    index: int
    device: torch.device
    dtype: torch.dtype
    numel: int
    nbytes: int
    param_names: tuple[str, ...]
    in_place: bool = False


def dense_strides(p: torch.Tensor) -> tuple[int, ...]:
    """The strides of ``p``'s view in a shared bucket: dense, in ``p``'s memory order (as
    ``torch.empty_like`` makes them; channels_last stays channels_last, like DDP's views)."""
    return tuple(torch.empty_like(p, device="meta").stride())


def bucket_strides(p: torch.Tensor) -> tuple[int, ...]:
    """:func:`dense_strides` as the cross-rank fingerprint compares them: 0 for dims of size 1,
    whose stride does not change where any element lies."""
    return tuple(st if n > 1 else 0 for n, st in zip(p.shape, dense_strides(p), strict=True))


def assign_buckets(
    params: list[Entry], cap_bytes: int, first_cap_bytes: int, in_place_bytes: int | None = None,
) -> list[tuple[list[Entry], bool]]:
    """Group by (device, dtype) in reverse order; close a bucket when it reaches its cap.

    A parameter of at least ``in_place_bytes`` (None: none) is a bucket of its own, reduced in
    place. Returns ``(group, in_place)`` pairs in launch order: the shared buckets by their first
    parameter (highest registration index), descending -- the order backward fills them -- then
    the in-place ones, in the same order (they are sent at the end of backward).
    """
    open_: dict[tuple[torch.device, torch.dtype], list[Entry]] = {}
    size: dict[tuple[torch.device, torch.dtype], int] = {}
    shared: list[list[Entry]] = []
    in_place: list[list[Entry]] = []
    for entry in reversed(params):
        p = entry[2]
        nbytes = p.numel() * p.element_size()
        if in_place_bytes is not None and nbytes >= in_place_bytes:
            in_place.append([entry])
            continue
        key = (p.device, p.dtype)
        open_.setdefault(key, []).append(entry)
        size[key] = size.get(key, 0) + nbytes
        limit = first_cap_bytes if not shared else cap_bytes
        if size[key] >= limit:
            shared.append(open_.pop(key))
            size[key] = 0
    shared.extend(open_.values())
    shared.sort(key=lambda b: -b[0][0])
    return [(group, False) for group in shared] + [(group, True) for group in in_place]

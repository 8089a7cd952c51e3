"""Checkpoints of a :class:`~gradcomm.hooks.ShardedOptimizer`: the full (unsharded) optimizer state
gathered from the shards, and a full state cut into this rank's shards.

The full state has ``torch.optim.Optimizer.state_dict()``'s format for the same parameter groups
(``{"state": {index: {key: value}}, "param_groups": [...]}``, indices counting the parameters of
every group in order), so it loads at any world size, and into an unsharded optimizer (and back).
A state value shaped as its segment is per element (Adam's ``exp_avg``); it is gathered bucket by
bucket into the parameter's shape. Any other value (``step``) is the same on every rank holding a
piece of the parameter and is taken from one of them.
"""

from __future__ import annotations

from typing import Any

import torch

from ..comm.communicator import Communicator
from ._shard_layout import BucketShard, all_gather_object, flat_of

__all__ = ["gather_full_state", "local_state"]

_ELEMENTWISE = "elementwise"


def _is_elementwise(value: Any, shape: torch.Size) -> bool:
    return isinstance(value, torch.Tensor) and value.dim() > 0 and value.shape == shape


def gather_full_state(comm: Communicator, shards: list[BucketShard], optim_state: dict[Any, Any],
                      index_of: dict[int, int], keep: bool) -> dict[int, dict[str, Any]]:
    """The full per-parameter state, keyed by parameter index (``index_of``: ``id(param)`` to its
    index); an empty dict where ``keep`` is False. A collective: every rank calls it.

    One all-gather of the small metadata, then one all-gather per bucket and per-element key
    (a padded bucket of that key's dtype at a time).
    """
    meta: dict[int, dict[str, Any]] = {}
    for bs in shards:
        for s in bs.segments:
            st = optim_state.get(s.tensor)
            if not st:
                continue
            idx = index_of[id(s.param)]
            meta[idx] = {k: (_ELEMENTWISE, v.dtype) if _is_elementwise(v, s.tensor.shape) else v
                         for k, v in st.items()}
    merged: dict[int, dict[str, Any]] = {}
    for part in all_gather_object(comm, meta):
        assert isinstance(part, dict)
        for idx, entry in part.items():
            merged.setdefault(idx, {}).update(entry)
    out: dict[int, dict[str, Any]] = {}
    for bs in shards:
        slots = {index_of[id(p)]: slot for slot, p in enumerate(bs.bucket.params)}
        keys = sorted({(k, v[1]) for idx in slots if idx in merged
                       for k, v in merged[idx].items()
                       if isinstance(v, tuple) and v and v[0] == _ELEMENTWISE}, key=str)
        for key, dtype in keys:
            values = {}
            for s in bs.segments:
                st = optim_state.get(s.tensor)
                if st and key in st:
                    values[s.slot] = st[key]
            full = torch.empty(bs.padded, dtype=dtype, device=bs.bucket.device)
            comm.all_gather(full, bs.pack(values, dtype))
            if not keep:
                continue
            for idx, slot in slots.items():
                if key in merged.get(idx, {}):
                    out.setdefault(idx, {})[key] = bs.unpack(full, slot).clone()
    if keep:
        for idx, entry in merged.items():
            for k, v in entry.items():
                if not (isinstance(v, tuple) and v and v[0] == _ELEMENTWISE):
                    out.setdefault(idx, {})[k] = v
    return dict(sorted(out.items()))  # in parameter order, as torch.optim's state_dict()


def local_state(shards: list[BucketShard], full_state: dict[int, dict[str, Any]],
                params: list[torch.nn.Parameter], seg_index: dict[int, int]
                ) -> dict[int, dict[str, Any]]:
    """Cut a full state (keyed by parameter index into ``params``) into this rank's segments,
    keyed by segment index (``seg_index``: ``id(segment tensor)`` to its index in the local
    optimizer).

    Raises:
        ValueError: a state index outside the parameters, or a per-element value whose shape
            differs from its parameter's.
    """
    by_param: dict[int, list[tuple[BucketShard, Any]]] = {}
    for bs in shards:
        for s in bs.segments:
            by_param.setdefault(id(s.param), []).append((bs, s))
    out: dict[int, dict[str, Any]] = {}
    for idx, entry in full_state.items():
        idx = int(idx)
        if not 0 <= idx < len(params):
            raise ValueError(f"optimizer state names parameter index {idx}, but the groups hold "
                             f"{len(params)} parameters")
        p = params[idx]
        for _, s in by_param.get(id(p), []):
            mine: dict[str, Any] = {}
            for k, v in entry.items():
                # a 0-d parameter's per-element state is 0-d too; its "step" is the counter
                if isinstance(v, torch.Tensor) and (v.dim() > 0 or (p.dim() == 0 and k != "step")):
                    if v.shape != p.shape:
                        raise ValueError(f"optimizer state {k!r} of parameter {idx} has shape "
                                         f"{tuple(v.shape)}, the parameter {tuple(p.shape)}")
                    mine[k] = flat_of(v.to(p.device), p)[s.lo:s.hi].clone()
                else:
                    mine[k] = v.clone() if isinstance(v, torch.Tensor) else v
            out[seg_index[id(s.tensor)]] = mine
    return out

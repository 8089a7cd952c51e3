"""The answer of :meth:`~gradcomm.comm.Communicator.supports` for one collective.

Reductions (all_reduce, reduce_scatter, reduce) answer per dtype with the backend's ``_supports``;
collectives that only move data take any dtype as raw bytes on the communicator's device type.
A backend refines the answer per collective in ``_supports_collective`` (e.g. an op it emulates);
a backend that keeps the base class's emulated ``_reduce_scatter`` is reported as emulated.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from ._emulation import complex_support
from .types import Collective, Support, SupportLevel

if TYPE_CHECKING:  # pragma: no cover
    from ._issue import IssuePath

__all__ = ["collective_support", "emulated"]


def emulated(base: Support, how: str) -> Support:
    """``base`` downgraded to EMULATED_SLOW (if supported at all), with ``how`` in its reason."""
    if not base.is_supported:
        return base
    reason = f"{how}; {base.reason}" if base.reason else how
    return Support(SupportLevel.EMULATED_SLOW, reason, base.transfer_dtype)


def collective_support(collective: Collective, dtype: torch.dtype, device: torch.device | None,
                       comm: IssuePath) -> Support:
    """How ``comm`` runs ``collective`` on ``dtype`` tensors on ``device`` (None: its own)."""
    if collective is Collective.ALL_REDUCE:
        if dtype.is_complex:
            return complex_support(dtype, device, comm._supports)
        return comm._supports(dtype, device)
    if collective.reduces:
        if dtype.is_complex:
            return Support(SupportLevel.UNSUPPORTED, f"{collective.value} does not take complex "
                           "tensors; all_reduce reduces them as their real view")
        base = comm._supports(dtype, device)
    else:
        dev_type = comm.device.type if device is None else device.type
        if dev_type != comm.device.type:
            base = Support(SupportLevel.UNSUPPORTED, f"this {comm.backend} communicator works "
                           f"on {comm.device.type} tensors, not {dev_type}")
        else:
            base = Support(SupportLevel.NATIVE, "", dtype)
    if collective is Collective.REDUCE_SCATTER and _keeps_default(comm, "_reduce_scatter"):
        base = emulated(base, "reduce_scatter runs as an all_reduce of the whole input "
                        "(world_size times the traffic)")
    if collective is Collective.ALL_GATHER_V and _keeps_default(comm, "_all_gather_v"):
        base = emulated(base, "all_gather with uneven sizes pads every input to the largest "
                        "(world_size * largest moved)")
    return comm._supports_collective(collective, dtype, device, base)


def _keeps_default(comm: IssuePath, hook: str) -> bool:
    from ._shard_ops import ShardOps  # the class whose default is an emulation

    return getattr(type(comm), hook) is getattr(ShardOps, hook)

"""Uneven inputs: a rank out of data shadows the others' collectives until every rank has joined.

The semantics of torch DDP's ``join()`` (``torch.distributed.algorithms.Join``), built on the
reducer's own collectives: a joined rank runs *shadow rounds*, each issuing exactly what an active
rank's synchronised step issues -- the buffer broadcast when ``broadcast_buffers`` is on, the comm
hook check before the first backward, every bucket through the comm hook (zeros, presence flags
0) and the control tensor with step value 0 (:mod:`._steps`) -- so collectives pair as usual. The
control's sum tells every rank which ranks contributed to the step: active ranks divide the sums
by that number (or by ``world_size``), and a round whose step values are all 0 means every rank
has joined: the loop ends on every rank at once. Unlike DDP no extra collective runs per step on
the active ranks: what they must know travels in the control tensor.

At the end, parameters and buffers are broadcast from the lowest rank that contributed to the
last step (DDP's final model sync from its last joiner), since joined ranks skipped the later
optimizer steps.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING

import torch

from ..comm.errors import CollectiveTimeoutError
from ._control import CONTROL_LABEL
from ._steps import active_ranks
from ._sync import broadcast_tensors

if TYPE_CHECKING:
    from ._backward import BackwardPass

__all__ = ["join_context"]


def _buffers(bw: BackwardPass) -> list[torch.Tensor]:
    return bw.guard.buffers()  # read afresh: a buffer may be reassigned between steps


def _shadow_round(bw: BackwardPass) -> list[float]:
    """One joined rank's share of a synchronised step; returns every rank's step value."""
    comm = bw.comm
    buffers = _buffers(bw)
    if bw.broadcast_buffers and buffers:
        broadcast_tensors(comm, buffers, bw.active[0])  # as the active ranks' forward does
    if not bw.hook.agreed:
        bw.hook.agree(comm)  # as the active ranks' first backward does
    control = bw.control
    with torch.no_grad():
        bw.steps.joined = True
        control.set_step(bw.steps.value())  # before the last bucket, which may carry it
        for b in bw.buckets:
            b.flags.zero_()  # no gradient from this rank
            if not b.in_place:
                b.data.zero_()
            bw.send(b, b.failed())  # a shared bucket's zeroed buffer; in place: zeros
        control.send()  # unless the last bucket carried it
    pending = [(b.work, b.label()) for b in bw.buckets] + [(control.work, CONTROL_LABEL)]
    try:
        for work, label in pending:
            if work is not None:
                try:
                    work.wait()
                except CollectiveTimeoutError as exc:
                    bw.mark_failed(f"shadowing {label} in join() timed out")
                    raise CollectiveTimeoutError(
                        f"join(): waiting for the other ranks' {label}: {exc}") from exc
        steps = control.steps()
    finally:
        for b in bw.buckets:
            b.reset()
        control.reset()
    return steps


def _join_all(bw: BackwardPass) -> None:
    """Shadow rounds until every rank has joined, then sync the final model."""
    bw.discard_if_stale()
    if bw.failed is not None:
        raise RuntimeError("join(): an earlier backward pass failed; restart from a checkpoint")
    if bw.epoch_active:
        raise RuntimeError("join(): a backward pass is still being reduced; call "
                           "reducer.synchronize() before leaving the join() block")
    if not bw.require_sync:
        raise RuntimeError("join(): leave no_sync() before leaving the join() block")
    if bw.comm.world_size == 1:
        return
    last = bw.active  # the ranks that contributed to the last step
    try:
        while True:
            steps = _shadow_round(bw)
            active = active_ranks(steps)
            if not active:
                break
            last = bw.active = active
    finally:
        bw.steps.joined = False
        bw.steps.forwards = 0
    bw.active = list(range(bw.comm.world_size))
    if len(last) != bw.comm.world_size:
        # Joined ranks skipped the last optimizer steps: every rank takes the model of a rank
        # that ran them all.
        broadcast_tensors(bw.comm, [p.data for p in bw.params] + _buffers(bw), last[0])


@contextmanager
def join_context(bw: BackwardPass, divide_by_initial_world_size: bool) -> Iterator[None]:
    """The body of :meth:`~gradcomm.hooks.GradientReducer.join` (see the module)."""
    if not isinstance(divide_by_initial_world_size, bool):
        raise TypeError("divide_by_initial_world_size must be True or False, got "
                        f"{divide_by_initial_world_size!r}")
    old = bw.divide_by_initial_world_size
    bw.divide_by_initial_world_size = divide_by_initial_world_size
    try:
        yield
        # Only on a normal exit: a rank leaving by an exception does not shadow (the others'
        # next collective then times out, as without join).
        _join_all(bw)
    finally:
        bw.divide_by_initial_world_size = old

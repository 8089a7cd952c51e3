"""Gradients of a :class:`~gradcomm.hooks.ShardedOptimizer`: where each rank's shard of the averaged
gradients comes from, and the global-norm clipping computed from shards.

Stage 1 reads the shard out of ``param.grad`` (the reducer all-reduced it as usual). Stage 2
(:class:`ReduceScatterGrads`) turns the reducer's all-reduce into a reduce-scatter: its comm hook
:func:`reduce_scatter_hook` sums each bucket into this rank's shard only, and its sink replaces the
reducer's write-back -- the shard is averaged (post-divided) and kept, and every ``param.grad`` of
the bucket is set to a :class:`ShardedGrad`: a stand-in that refuses every operation, so that code
reading the full gradient (``torch.nn.utils.clip_grad_norm_``, a gradient norm logged from
``param.grad``, ``GradScaler.unscale_``) raises instead of silently skipping a gradient that is
None.

The stand-in is also the parameter's gradient state, as ``param.grad`` is in torch: a parameter
whose stand-in is still there when the next backward reaches it accumulates (its part of the kept
shard is added to), and one whose ``param.grad`` was set to None meanwhile (``model.zero_grad()``,
by hand) starts afresh, and is skipped by a step taken before that. A tensor hook
(:func:`drop_stand_in`) notes a stand-in and clears it before autograd accumulates the next
backward's gradient.
"""

from __future__ import annotations

import math
import weakref
from typing import Any

import torch

from ..comm.communicator import Communicator
from ..comm.types import ReduceOp
from ..comm.work import Work
from ._buckets import Bucket
from ._shard_layout import BucketShard, flat_of
from .comm_hooks import GradBucket, warn_if_slow

__all__ = ["ReduceScatterGrads", "ShardedGrad", "reduce_scatter_hook", "attach_grads",
           "clip_grad_norm", "drop_stand_in"]

# What a ShardedGrad still answers: its metadata (shape, dtype, device, ``is None`` checks of
# torch's own code), nothing that reads or writes values.
_METADATA = frozenset({"size", "dim", "__hash__", "is_floating_point", "is_complex"})


class ShardedGrad(torch.Tensor):
    """``param.grad`` after a stage-2 backward: the parameter's shape, dtype and device over one
    element of storage; every operation raises RuntimeError (the averaged gradient exists only as
    the ranks' shards, see :meth:`ShardedOptimizer.clip_grad_norm_`)."""

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        name = getattr(func, "__name__", "")
        if name == "__get__" or name in _METADATA:
            return super().__torch_function__(func, types, args, kwargs)  # type: ignore[no-untyped-call]
        raise RuntimeError(
            f"{name or func}() on param.grad: in ShardedOptimizer stage 2 each rank keeps only its "
            "shard of the gradients; use opt.clip_grad_norm_() and opt.zero_grad() "
            "(docs/sharded.md)")

    def __repr__(self, *, tensor_contents: Any = None) -> str:  # type: ignore[override]
        return f"ShardedGrad(shape={tuple(self.shape)}, dtype={self.dtype}, device={self.device})"

    @staticmethod
    def of(param: torch.Tensor) -> ShardedGrad:
        """The stand-in for ``param``'s gradient (one element of storage, expanded)."""
        one = torch.zeros((), dtype=param.dtype, device=param.device)
        return one.expand(param.shape).as_subclass(ShardedGrad)


def drop_stand_in(carried: set[int], ref: weakref.ref[torch.Tensor], grad: torch.Tensor) -> None:
    """Tensor hook of a stage-2 parameter, run before autograd accumulates ``grad``: a
    :class:`ShardedGrad` in ``param.grad`` is cleared, so the new gradient is stored, not added,
    and the parameter's id goes into ``carried``: its kept shard is added to at the next sink."""
    param = ref()
    if param is not None and type(param.grad) is ShardedGrad:
        carried.add(id(param))
        param.grad = None


class ReduceScatterGrads:
    """State of :func:`reduce_scatter_hook` and the reducer's sink in stage 2 (see the module)."""

    def __init__(self, comm: Communicator, shards: list[BucketShard]) -> None:
        self.comm = comm
        self.shards = shards
        self.stand_ins = [[ShardedGrad.of(p) for p in bs.bucket.params] for bs in shards]
        self.carried: set[int] = set()  # see drop_stand_in

    def launch(self, bucket: GradBucket) -> Work:
        """Start the reduce-scatter (SUM) of one bucket into this rank's shard."""
        bs = self.shards[bucket.bucket_index]
        b = bs.bucket
        if b.in_place:  # the gradient itself, in its logical order: the padded flat layout
            inp = torch.zeros(bs.padded, dtype=b.dtype, device=b.device)
            bs.unpack(inp, 0).copy_(bucket.buffer().view(b.params[0].shape))
        else:
            inp = b.data  # padded by the ShardedOptimizer (SharedBucket.pad_to)
        # A pass that failed (its sink never ran) leaves ``filled`` False: overwritten, not added.
        accumulate = bs.filled and bs.grad is not None
        if accumulate or bs.grad is None:
            out = torch.empty(bs.chunk, dtype=b.dtype, device=b.device)
        else:
            out = bs.grad
        if bs.grad is None:
            bs.grad = out
        bs.pending = (out, accumulate)
        warn_if_slow(self.comm, b.dtype, b.device)
        return self.comm.reduce_scatter(out, inp, ReduceOp.SUM, async_op=True,
                                        label=bucket.label())

    def sink(self, b: Bucket, flags: list[float]) -> None:
        """Average the reduced shard (and add it to the kept one), note which parameters have a
        gradient on some rank, and drop the bucket's full gradients."""
        bs = self.shards[b.index]
        assert bs.pending is not None and bs.grad is not None  # set by launch
        out, accumulate = bs.pending
        bs.pending = None
        carried = self.carried
        # A parameter keeps its earlier gradient if its stand-in was there when this backward
        # reached it (the hook noted it) or still is (the parameter got no gradient).
        kept = [id(p) in carried or type(p.grad) is ShardedGrad for p in b.params]
        carried.difference_update(map(id, b.params))
        with torch.no_grad():
            if b.post != 1.0:
                out.div_(b.post)
            if accumulate:
                for s in bs.segments:
                    if not kept[s.slot]:  # its param.grad was set to None: start afresh
                        bs.grad[s.start:s.start + s.hi - s.lo].zero_()
                bs.grad.add_(out)
        bs.filled = True
        for slot, (p, stand_in) in enumerate(zip(b.params, self.stand_ins[b.index],
                                                 strict=True)):
            bs.present[slot] = (accumulate and kept[slot] and bs.present[slot]) or flags[slot] > 0
            p.grad = stand_in


def reduce_scatter_hook(state: ReduceScatterGrads, bucket: GradBucket) -> Work:
    """Comm hook of a stage-2 :class:`~gradcomm.hooks.ShardedOptimizer`: reduce-scatter (SUM) the
    bucket into this rank's shard (``Communicator.reduce_scatter``)."""
    return state.launch(bucket)


def attach_grads(shards: list[BucketShard], stage: int) -> None:
    """Give every segment its averaged gradient as ``.grad`` (None where the parameter has none,
    so the optimizer skips it as an unsharded one would).

    Stage 1: a view of ``param.grad`` (a copy when the gradient lies in another memory order);
    stage 2: a view of the kept shard, unless ``param.grad`` no longer holds its stand-in (set to
    None since the backward, as torch skips such a parameter).
    """
    for bs in shards:
        for s in bs.segments:
            if stage == 1:
                g = s.param.grad
                s.tensor.grad = None if g is None else flat_of(g, s.param)[s.lo:s.hi]
            elif (bs.grad is not None and bs.filled and bs.present[s.slot]
                  and type(s.param.grad) is ShardedGrad):
                s.tensor.grad = bs.grad[s.start:s.start + s.hi - s.lo]
            else:
                s.tensor.grad = None


def clip_grad_norm(comm: Communicator, shards: list[BucketShard], stage: int, max_norm: float,
                   norm_type: float, error_if_nonfinite: bool) -> torch.Tensor:
    """Clip the gradients by their global ``norm_type`` norm, computed from the shards with one
    one-element all-reduce (SUM of ``|g|^p``, MAX for ``inf``), as
    ``torch.nn.utils.clip_grad_norm_`` would on the full gradients (coefficient
    ``max_norm / (norm + 1e-6)``, applied when below 1). Returns the norm (float32, 0-d).

    Stage 1 scales every ``param.grad`` (they are full on every rank), stage 2 the kept shards.
    """
    attach_grads(shards, stage)
    grads = [s.tensor.grad for bs in shards for s in bs.segments if s.tensor.grad is not None]
    inf = math.isinf(norm_type)
    dev = comm.device
    local = torch.zeros(1, dtype=torch.float64, device=dev)
    for g in grads:
        n = torch.linalg.vector_norm(g, norm_type, dtype=torch.float64)
        local = torch.maximum(local, n) if inf else local + n ** norm_type
    comm.all_reduce(local, ReduceOp.MAX if inf else ReduceOp.SUM)
    total = (local if inf else local ** (1.0 / norm_type)).to(torch.float32).reshape(())
    if error_if_nonfinite and not bool(torch.isfinite(total)):
        raise RuntimeError(f"the total norm of order {norm_type} of the gradients is non-finite; "
                           "set error_if_nonfinite=False to clip anyway")
    coef = float(max_norm) / (float(total) + 1e-6)
    if coef < 1.0:
        with torch.no_grad():
            if stage == 1:
                for bs in shards:
                    for p in bs.bucket.params:
                        if p.grad is not None:
                            p.grad.mul_(coef)
            else:
                for bs in shards:
                    if bs.grad is not None:
                        bs.grad.mul_(coef)
    return total

"""Sharded data parallelism (ZeRO stages 1 and 2) over a :class:`~gradcomm.hooks.GradientReducer`.

:class:`ShardedOptimizer` splits the optimizer state -- and in stage 2 the averaged gradients --
across ranks along the reducer's own flat buckets (see :mod:`._shard_layout`), as DeepSpeed's ZeRO
partitions flat buffers (Rajbhandari et al., "ZeRO: Memory Optimizations Toward Training Trillion
Parameter Models", SC 2020) and with the interface of torch's ``ZeroRedundancyOptimizer``.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterable
from functools import partial
from typing import Any

import torch
from torch import nn

from ._buckets import SharedBucket
from ._shard_grads import (
    ReduceScatterGrads,
    ShardedGrad,
    attach_grads,
    clip_grad_norm,
    drop_stand_in,
    reduce_scatter_hook,
)
from ._shard_layout import BucketShard, check_dense, gather_params
from ._shard_state import gather_full_state, local_state
from .comm_hooks import allreduce_hook, hierarchical_hook
from .reducer import GradientReducer

__all__ = ["ShardedOptimizer"]

# torch.optim classes whose update of an element reads other elements of the parameter.
_NOT_ELEMENTWISE = tuple(getattr(torch.optim, n) for n in ("LBFGS", "Adafactor", "SparseAdam",
                                                             "Muon") if hasattr(torch.optim, n))


def _check_args(reducer: object, optimizer_class: object, stage: object) -> None:
    if not isinstance(reducer, GradientReducer):
        raise TypeError(f"reducer must be a GradientReducer, got {type(reducer).__name__}")
    if not (isinstance(optimizer_class, type)
            and issubclass(optimizer_class, torch.optim.Optimizer)):
        what = (f"an instance of {type(optimizer_class).__name__}; pass the class"
                if isinstance(optimizer_class, torch.optim.Optimizer)
                else type(optimizer_class).__name__)
        raise TypeError(f"optimizer_class must be a torch.optim.Optimizer subclass, got {what}")
    if issubclass(optimizer_class, _NOT_ELEMENTWISE):
        raise ValueError(f"ShardedOptimizer needs an element-wise optimizer; "
                         f"{optimizer_class.__name__} reads whole parameters (use it unsharded)")
    if stage not in (1, 2) or isinstance(stage, bool):
        raise ValueError(f"stage must be 1 or 2, got {stage!r}")


class ShardedOptimizer(torch.optim.Optimizer):
    """A torch optimizer whose state (stage 1) and averaged gradients (stage 2) are split across
    the ranks of ``reducer``'s communicator; every rank ends each step with the same parameters.

    Args:
        reducer: the :class:`~gradcomm.hooks.GradientReducer` of the model; its buckets are the
            flat buffers that are sharded (rank ``r`` owns the ``r``-th of ``world_size`` equal
            parts of each; the guide: docs/sharded.md).
        optimizer_class: an element-wise ``torch.optim.Optimizer`` subclass (SGD, Adam, AdamW,
            RMSprop, Adagrad, ...); it steps this rank's shards and is :attr:`optim`.
        stage: 1 -- the reducer all-reduces as usual and ``param.grad`` holds the full averaged
            gradients after backward; each rank keeps optimizer state for its shards only, steps
            them and all-gathers the parameters at the end of :meth:`step`. 2 -- as 1, and the
            reducer reduce-scatters each bucket instead (``Communicator.reduce_scatter``): after
            backward a rank keeps the averaged gradients of its shards only and every
            ``param.grad`` of the reducer is a stand-in that raises RuntimeError when used.
        **defaults: the optimizer's hyperparameters (``lr=...``). ``params`` (optional): the
            parameters or parameter groups (dicts, as torch.optim takes them) -- default: all of
            the reducer's parameters in one group. Frozen parameters (``requires_grad=False``)
            may be listed and are left alone.

    Values equal unsharded training with the same reducer: each element is updated by the same
    element-wise arithmetic; only a global-norm clipping differs in the last bits (the norm is
    summed from shards in float64). A parameter without a gradient on any rank is skipped, as an
    unsharded optimizer skips ``grad=None``.

    Raises:
        TypeError: ``reducer`` or ``optimizer_class`` of the wrong type.
        ValueError: a non-element-wise optimizer (LBFGS, Adafactor, SparseAdam, Muon); stage not
            1 or 2; a trainable parameter the reducer does not own, or one listed twice; stage 2
            with a comm hook other than all-reduce (it cannot become a reduce-scatter).
        RuntimeError: stage 2 after the reducer's first synchronised backward pass, or a second
            stage-2 optimizer on one reducer.

    Use :meth:`clip_grad_norm_` for clipping. In stage 2 ``param.grad`` holds no gradient after
    backward, so ``torch.nn.utils.clip_grad_norm_(model.parameters())`` raises RuntimeError (any
    operation on such a ``param.grad`` does) rather than clip nothing.
    Checkpoints: :meth:`state_dict` (full, any world size) and :meth:`sharded_state_dict` (this
    rank's part, same world size).
    """

    def __init__(self, reducer: GradientReducer, optimizer_class: type[torch.optim.Optimizer], *,
                 stage: int = 1, **defaults: Any) -> None:
        _check_args(reducer, optimizer_class, stage)
        params = defaults.pop("params", None)
        self.reducer = reducer
        self.stage = stage
        self._comm = reducer.comm
        self._owned = {id(p) for p in reducer._params}
        self._ready = False
        buckets = reducer._backward.buckets
        check_dense(tuple(reducer._params), tuple(reducer._names))
        if stage == 2:
            self._check_stage2()
        self._shards = [BucketShard(b, self._comm.world_size, self._comm.rank) for b in buckets]
        self._grouped: set[int] = set()
        self._gather_buffers: list[torch.Tensor] = []
        super().__init__(list(reducer._params) if params is None else params, defaults)
        self.optim = optimizer_class(
            [self._local_group(g) for g in self.param_groups], **defaults)
        self._ready = True
        # A joined rank would have to step its shards and join each step's all-gather.
        reducer._join_refused = ("reducer.join() is not supported with a ShardedOptimizer (a rank "
                                 "out of data cannot join its step's all-gather); give every "
                                 "rank the same number of batches")
        for mine, local in zip(self.param_groups, self.optim.param_groups, strict=True):
            for k, v in local.items():  # the optimizer's own defaults (betas...) shown here too
                mine.setdefault(k, v)
        if stage == 2:
            for b, bs in zip(buckets, self._shards, strict=True):
                if isinstance(b, SharedBucket):
                    b.pad_to(bs.padded)
            grads = ReduceScatterGrads(self._comm, self._shards)
            reducer.register_comm_hook(reduce_scatter_hook, grads)
            reducer._backward.sink = grads.sink
            # Removed with the reducer's own hooks (reducer.remove()).
            reducer._handles += [
                p.register_hook(partial(drop_stand_in, grads.carried, weakref.ref(p)))
                for b in buckets for p in b.params]

    def _check_stage2(self) -> None:
        r = self.reducer
        if r._backward.sink is not None:
            raise RuntimeError("this reducer already has a ShardedOptimizer of stage 2; build one "
                               "per reducer")
        if r._comm_hook.fn is hierarchical_hook:
            raise ValueError("ShardedOptimizer stage 2 reduce-scatters buckets itself; build the "
                             "GradientReducer without hierarchical=True")
        if r._comm_hook.fn is not allreduce_hook:
            raise ValueError("ShardedOptimizer stage 2 turns the reducer's all-reduce into a "
                             "reduce-scatter; its comm hook must be 'allreduce', got "
                             f"{getattr(r._comm_hook.fn, '__name__', r._comm_hook.fn)!r}")
        if r._backward.sink is not None or r._comm_hook.agreed:
            raise RuntimeError("ShardedOptimizer stage 2 must be built before the reducer's first "
                               "synchronised backward pass, and once per reducer")

    # ------------------------------------------------------------------ groups
    def _segments_of(self, params: Iterable[torch.Tensor]) -> list[torch.Tensor]:
        ids = {id(p) for p in params}
        return [s.tensor for bs in self._shards for s in bs.segments if id(s.param) in ids]

    def _local_group(self, group: dict[str, Any]) -> dict[str, Any]:
        out = {k: v for k, v in group.items() if k != "params"}
        out["params"] = self._segments_of(group["params"])
        return out

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a group (torch.optim's ``add_param_group``), with its hyperparameters, to
        :attr:`param_groups` and its shards to :attr:`optim`.

        Raises:
            ValueError: a trainable parameter the reducer does not own, or already in a group.
            TypeError: as torch.optim (not a dict, or parameters that are not tensors).
        """
        if not isinstance(param_group, dict):
            raise TypeError(f"param_group must be a dict, got {type(param_group).__name__}")
        params = param_group["params"]
        params = [params] if isinstance(params, torch.Tensor) else list(params)
        for p in params:
            if isinstance(p, torch.Tensor) and p.requires_grad and id(p) not in self._owned:
                raise ValueError(f"ShardedOptimizer: a parameter of shape {tuple(p.shape)} is not "
                                 "one the reducer owns; build the reducer over every parameter "
                                 "you optimize")
            if id(p) in self._grouped:
                raise ValueError("ShardedOptimizer: a parameter appears in more than one group")
        self._grouped.update(id(p) for p in params)
        super().add_param_group({**param_group, "params": params})
        if self._ready:
            self.optim.add_param_group(self._local_group(self.param_groups[-1]))

    def _sync_hyperparameters(self) -> None:
        """Copy hyperparameters set on :attr:`param_groups` (an LR scheduler's ``lr``) to
        :attr:`optim`."""
        for mine, local in zip(self.param_groups, self.optim.param_groups, strict=True):
            for k, v in mine.items():
                if k != "params":
                    local[k] = v

    # ------------------------------------------------------------------ steps
    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        """Step this rank's shards, then all-gather the parameters (every rank calls it).

        ``closure`` (optional) is called once, with gradients enabled, before the step; its
        value is returned. When no parameter has a ``.grad`` (torch's optimizers then change
        nothing) it does nothing and sends nothing, so a rank that skipped a backward after
        ``zero_grad()`` is caught by the next backward's step check on every rank
        (docs/failures.md). Raises CollectiveTimeoutError if a rank does not arrive.
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if all(p.grad is None for g in self.param_groups for p in g["params"]):
            return loss
        self._sync_hyperparameters()
        attach_grads(self._shards, self.stage)
        self.optim.step()
        gather_params(self._comm, self._shards, self._gather_buffers)
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Reset the gradients: ``param.grad`` of every parameter in the groups, the shards'
        gradients and (stage 2) the kept gradient shards. With ``set_to_none=False`` a stage-2
        stand-in stays, as torch keeps a zeroed gradient: its kept shard is zeroed."""
        stand_ins = [(p, p.grad) for p in self.reducer._params if type(p.grad) is ShardedGrad]
        for p, _ in stand_ins:
            p.grad = None  # torch's zero_grad would operate on it
        super().zero_grad(set_to_none)
        if not set_to_none:
            for p, g in stand_ins:
                p.grad = g
        self.optim.zero_grad(set_to_none)
        for bs in self._shards:
            if bs.grad is not None:
                if set_to_none:
                    bs.grad, bs.filled = None, False
                    bs.present = [False] * len(bs.present)
                else:
                    bs.grad.zero_()

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0,
                        error_if_nonfinite: bool = False) -> torch.Tensor:
        """Clip the averaged gradients by their global norm, computed from every rank's shards
        with one one-element all-reduce; returns the norm (0-d float32, the same on every rank).

        Same rule as ``torch.nn.utils.clip_grad_norm_`` (coefficient ``max_norm / (norm +
        1e-6)``, applied when below 1); the norm is summed from the shards in float64. Stage 1
        scales every ``param.grad``, stage 2 the kept gradient shards. Call it on every rank
        after backward and before :meth:`step`.

        Raises:
            RuntimeError: the norm is not finite and ``error_if_nonfinite`` is True (every rank).
        """
        return clip_grad_norm(self._comm, self._shards, self.stage, max_norm, float(norm_type),
                              error_if_nonfinite)

    def memory_bytes(self) -> dict[str, int]:
        """Bytes this rank holds now, counted from the tensors: ``optimizer_state`` (every tensor
        in :attr:`optim`'s state), ``gradients`` (``param.grad`` of the reducer's parameters and,
        stage 2, the kept gradient shards) and ``comm_buffers`` (the reducer's bucket buffers and
        the two all-gather buffers of :meth:`step`, made by the first step)."""
        def size(t: torch.Tensor | None) -> int:
            return 0 if t is None or type(t) is ShardedGrad else t.numel() * t.element_size()

        state = sum(size(v) for st in self.optim.state.values() for v in st.values()
                    if isinstance(v, torch.Tensor))
        grads = sum(size(p.grad) for p in self.reducer._params)
        grads += sum(size(bs.grad) for bs in self._shards)
        comm = sum(size(b.data) for b in self.reducer._backward.buckets)
        comm += sum(size(t) for t in self._gather_buffers)
        return {"optimizer_state": state, "gradients": grads, "comm_buffers": comm}

    # ------------------------------------------------------------------ checkpoints
    def _params_in_order(self) -> list[nn.Parameter]:
        return [p for g in self.param_groups for p in g["params"]]

    def state_dict(self, *, to: int | None = None) -> dict[str, Any]:
        """The full (unsharded) state in ``torch.optim``'s format, loadable at any world size
        (and by an unsharded optimizer over the same groups). A collective: every rank calls it.

        Args:
            to: the rank that gets it (the others get ``{}``); None: every rank.

        Raises:
            ValueError: ``to`` not a rank of the communicator.
        """
        if to is not None and not 0 <= to < self._comm.world_size:
            raise ValueError(f"to must be a rank below {self._comm.world_size} or None, got {to}")
        params = self._params_in_order()
        index_of = {id(p): i for i, p in enumerate(params)}
        keep = to is None or to == self._comm.rank
        state = gather_full_state(self._comm, self._shards, self.optim.state, index_of, keep)
        if not keep:
            return {}
        groups, start = [], 0
        for g in self.param_groups:
            n = len(g["params"])
            groups.append({**{k: v for k, v in g.items() if k != "params"},
                           "params": list(range(start, start + n))})
            start += n
        return {"state": state, "param_groups": groups}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a full state (from :meth:`state_dict` at any world size, or an unsharded
        optimizer's over the same groups) and keep this rank's shards of it. Call it on every
        rank with the same dict.

        Raises:
            ValueError: the groups differ in number or size from this optimizer's.
        """
        groups = state_dict["param_groups"]
        ours = self.param_groups
        if len(groups) != len(ours) or any(
                len(a["params"]) != len(b["params"]) for a, b in zip(groups, ours, strict=True)):
            raise ValueError("loaded optimizer state has parameter groups of other sizes than "
                             "this optimizer's")
        seg_index = {id(t): i for i, t in enumerate(
            t for g in self.optim.param_groups for t in g["params"])}
        state = local_state(self._shards, state_dict["state"], self._params_in_order(), seg_index)
        local_groups, start = [], 0
        for g, og in zip(groups, self.optim.param_groups, strict=True):
            n = len(og["params"])
            local_groups.append({**{k: v for k, v in g.items() if k != "params"},
                                 "params": list(range(start, start + n))})
            start += n
        self.optim.load_state_dict({"state": state, "param_groups": local_groups})
        for mine, g in zip(self.param_groups, groups, strict=True):
            mine.update({k: v for k, v in g.items() if k != "params"})

    def sharded_state_dict(self) -> dict[str, Any]:
        """This rank's part of the state (:attr:`optim`'s ``state_dict()`` plus the layout): save
        one file per rank; load with :meth:`load_sharded_state_dict` at the same world size.
        As torch's ``state_dict()``, it holds the live state tensors (save or copy it at once)."""
        self._sync_hyperparameters()
        return {"world_size": self._comm.world_size, "rank": self._comm.rank,
                "layout": [bs.numel for bs in self._shards], "optim": self.optim.state_dict()}

    def load_sharded_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load this rank's part written by :meth:`sharded_state_dict`.

        Raises:
            ValueError: it was written at another world size, by another rank, or for other
                buckets (use the full :meth:`state_dict` to change the world size).
        """
        mine = (self._comm.world_size, self._comm.rank, [bs.numel for bs in self._shards])
        theirs = (state_dict.get("world_size"), state_dict.get("rank"), state_dict.get("layout"))
        if mine != theirs:
            raise ValueError(f"sharded optimizer state of (world_size, rank)={theirs[:2]} and "
                             f"another bucket layout cannot load at {mine[:2]}; use state_dict()")
        self.optim.load_state_dict(state_dict["optim"])
        for g, og in zip(self.param_groups, self.optim.param_groups, strict=True):
            g.update({k: v for k, v in og.items() if k != "params"})

    def __repr__(self) -> str:
        return (f"<ShardedOptimizer stage {self.stage} of {type(self.optim).__name__}, "
                f"rank {self._comm.rank}/{self._comm.world_size}>")

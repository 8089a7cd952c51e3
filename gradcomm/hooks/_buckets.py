"""Bucket storage: how a bucket stages, sends and writes back its gradients (the layout, which
gradients share a bucket, is :mod:`._bucket_plan`'s).

A :class:`SharedBucket` owns one persistent flat buffer of exactly its gradients,
allocated once, into which each gradient is copied pre-divided -- a large one by its hook, the
small ones together as the bucket is sent -- (or of which it is a view,
``gradient_as_bucket_view``); an :class:`InPlaceBucket` owns no buffer. Either has one presence
flag per parameter (1 where this rank has the gradient) in the reducer's control tensor (see
:mod:`._control`), which is summed across ranks separately.
"""

from __future__ import annotations

import operator
from itertools import repeat
from typing import cast

import torch

from ..comm.errors import brief
from ..comm.work import Work
from ._bucket_plan import BucketInfo, Entry, dense_strides
from .comm_hooks import GradBucket

__all__ = ["SharedBucket", "InPlaceBucket", "Bucket", "dense_only"]

# What a bucket slot holds in this backward (gradient_as_bucket_view): nothing yet; the gradient,
# pre-divided, with param.grad None until the send; the gradient accumulated in place in the view
# (param.grad is the view), divided at launch.
_EMPTY, _DIVIDED, _IN_VIEW = 0, 1, 2

#: Gradients of fewer elements than this are staged together when their bucket is sent (see
#: :meth:`SharedBucket.stage_batched`); larger ones one by one, as each arrives.
BATCH_MAX_NUMEL = 16384

_grad_of = operator.attrgetter("grad")
# torch.foreach (public from a later torch) copies a list of tensors in one call; this torch has
# only the same operation under its older name.
_foreach = getattr(torch, "foreach", None)
_foreach_copy_ = _foreach.copy_ if _foreach is not None else torch._foreach_copy_


def dense_only(name: str, layout: torch.layout) -> TypeError:
    """The error for parameter ``name``'s gradient of ``layout`` (sparse), which no bucket holds."""
    return TypeError(f"parameter {brief(name, 60)} has a {layout} gradient; gradcomm reduces "
                     "dense gradients only (use sparse=False)")


class _BucketBase:
    """What every bucket has: its parameters, divide factors and per-backward state."""

    in_place = False

    def __init__(self, index: int, params: list[Entry], factors: tuple[float, float],
                 last: bool) -> None:
        first = params[0][2]
        self.index = index
        self.device = first.device
        self.dtype = first.dtype
        self.param_ids = [i for i, _, _ in params]
        self.names = tuple(n for _, n, _ in params)
        self.params = tuple(p for _, _, p in params)
        self.numel = sum(p.numel() for p in self.params)
        self.pre, self.post = factors
        self.last = last
        self.flags = torch.zeros(0)  # this bucket's slots of the control tensor (set by the owner)
        self.buffer: torch.Tensor | None = None  # in place: what was sent in the gradient's stead
        self.views: list[torch.Tensor] = []
        self.pending = len(self.params)
        self.work: Work | None = None
        self.grad_bucket: GradBucket | None = None
        self.eager = [False] * len(self.params)  # slots a gradient hook stages (see stage)
        self.eager_slots: list[int] = []  # their indices

    def info(self) -> BucketInfo:
        return BucketInfo(self.index, self.device, self.dtype, self.numel,
                          self.numel * self.params[0].element_size(), self.names, self.in_place)

    def label(self) -> str:
        assert self.grad_bucket is not None  # set by the first send
        return self.grad_bucket.label()

    def stage(self, slot: int) -> None:
        raise NotImplementedError

    def stage_missing(self, ready: list[bool]) -> None:
        """Stage the large gradients (``eager``) whose parameter is not ``ready`` (by index)."""
        for slot in self.eager_slots:
            if not ready[self.param_ids[slot]]:
                self.stage(slot)

    def stage_ready(self, ready: list[bool]) -> None:
        """Stage, one by one, the small gradients whose parameter is ``ready`` (by index)."""
        for slot, pid in enumerate(self.param_ids):
            if ready[pid] and not self.eager[slot]:
                self.stage(slot)

    def reset(self) -> None:
        """Forget this backward pass (the buffer stays allocated)."""
        self.pending = len(self.params)
        self.work = None
        self.buffer = None


class SharedBucket(_BucketBase):
    """A bucket with a persistent flat buffer: ``flat`` (also ``data``) is its ``numel`` gradient
    elements, one view per parameter in ``views``, in the bucket's dtype and on its device."""

    def __init__(self, index: int, params: list[Entry], factors: tuple[float, float],
                 last: bool, view: bool) -> None:
        super().__init__(index, params, factors, last)
        self.view = view
        self.tail_numel = 0  # see set_tail
        self.pad_to(self.numel)
        self.present = [False] * len(self.params)  # this rank has a gradient (this backward)
        self.slot_state = [_EMPTY] * len(self.params)  # gradient_as_bucket_view only

    def pad_to(self, total: int) -> None:
        """(Re)allocate the buffer as ``total >= numel`` zeros: ``data`` is all of it, ``flat`` its
        first ``numel`` elements (a reduce-scatter needs a multiple of world_size). Only before
        the first backward pass: the views are made anew."""
        storage = torch.zeros(total + self.tail_numel, dtype=self.dtype, device=self.device)
        self.data = storage[:total]
        self.flat = self.data[: self.numel]
        # The flat gradients followed by the tail, for a send that carries both (see set_tail);
        # only where nothing pads the buffer between them.
        self.tail = storage[total:]
        self.wire = storage[: self.numel + self.tail_numel] if total == self.numel else None
        self.views = []
        offset = 0
        for p in self.params:
            self.views.append(self.data.as_strided(p.shape, dense_strides(p), offset))
            offset += p.numel()
        self.grad_bucket = GradBucket(self.index, self.flat, self.numel, self.params, self.names,
                                      self.last)
        # Small gradients are staged at the send, all in one call (see stage_batched); each
        # large one by its own hook (eager[slot]), which copies and divides it in one pass.
        # (Complex ones one by one too: autograd may make a lazy conjugate .grad, which foreach
        # copies refuse as a destination.)
        self.eager = [p.numel() >= BATCH_MAX_NUMEL or self.dtype.is_complex for p in self.params]
        self.eager_slots = [s for s, e in enumerate(self.eager) if e]
        self._batched_slots = [s for s, e in enumerate(self.eager) if not e]
        self._batched_params = [self.params[s] for s in self._batched_slots]
        self._batched_pids = [self.param_ids[s] for s in self._batched_slots]
        self._batched_views = [self.views[s] for s in self._batched_slots]
        self._batched_regions = self._regions(self._batched_slots)
        self._batched_present = False  # every batched slot has a gradient (this backward)

    def set_tail(self, count: int) -> None:
        """Allocate ``count`` elements right after the flat gradients (``tail``; ``wire`` is both,
        one contiguous tensor), so that one all-reduce can carry the reducer's control values
        with this bucket. Only before the first backward pass (the buffer is made anew)."""
        self.tail_numel = count
        self.pad_to(self.data.numel())

    def _regions(self, slots: list[int]) -> list[torch.Tensor]:
        """The flat buffer's runs of consecutive ``slots``, one 1-D view each."""
        offsets = [0]
        for p in self.params:
            offsets.append(offsets[-1] + p.numel())
        runs: list[list[int]] = []
        for s in slots:
            if runs and runs[-1][1] == offsets[s]:
                runs[-1][1] = offsets[s + 1]
            else:
                runs.append([offsets[s], offsets[s + 1]])
        return [self.data[lo:hi] for lo, hi in runs if hi > lo]

    def reset(self) -> None:
        super().reset()
        self.slot_state = [_EMPTY] * len(self.params)
        self._batched_present = False

    def stage_batched(self, grads: list[torch.Tensor | None] | None = None) -> None:
        """Stage every small gradient (``eager[slot]`` False) at once, as its bucket is sent
        (``grads``: every parameter's ``.grad`` by index, as the caller read them just now, or
        None to read them here).

        When each has a fresh gradient (none is None or its view): one foreach copy into the
        views, then one in-place division per run of them in the buffer -- the same values, bit
        for bit, as dividing each into its view (one IEEE division per element either way) --
        and, with ``gradient_as_bucket_view``, each ``param.grad`` set to its view. When each
        was accumulated in place in its view: only the division. Otherwise each slot goes
        through :meth:`stage`. Reads ``param.grad`` as the last hook left it, so a gradient
        accumulated again before the send is staged whole.
        """
        if not self._batched_slots:
            return
        if torch.is_grad_enabled():  # backward(create_graph=True); otherwise autograd turned it off
            with torch.no_grad():
                return self.stage_batched(grads)
        try:
            self._stage_batched(grads)
        except RuntimeError:
            # No hook checked these gradients' layout (see _autograd.on_late_grad_ready); a
            # sparse one is refused by the copy: name it.
            for slot in self._batched_slots:
                g = self.params[slot].grad
                if g is not None and g.layout is not torch.strided:
                    raise dense_only(self.names[slot], g.layout) from None
            raise

    def _batched_grads(self, grads: list[torch.Tensor | None] | None) -> list[torch.Tensor | None]:
        if grads is None:
            return list(map(_grad_of, self._batched_params))
        return list(map(grads.__getitem__, self._batched_pids))  # no second read of each .grad

    def _stage_batched(self, all_grads: list[torch.Tensor | None] | None) -> None:
        grads = self._batched_grads(all_grads)
        views = self._batched_views
        fresh = all(map(operator.is_not, grads, repeat(None)))
        if fresh and not any(map(operator.is_, grads, views)):
            _foreach_copy_(views, cast(list[torch.Tensor], grads))  # none is None (fresh)
            if self.view:
                # each param.grad = its view, looping in C (setattr returns None)
                any(map(setattr, self._batched_params, repeat("grad"), views))
        elif not (fresh and self.view and all(map(operator.is_, grads, views))):
            for slot in self._batched_slots:
                self.stage(slot)
            return
        if self.pre != 1.0:
            for region in self._batched_regions:
                region.div_(self.pre)
        self._batched_present = True

    def stage(self, slot: int) -> None:
        """Put one parameter's pre-divided gradient into its slot.

        Copy mode: ``torch.div(grad, pre, out=view)``, one pass, as DDP's reducer does (a gradient
        accumulated again before the bucket is sent is simply staged again).

        ``gradient_as_bucket_view``: a gradient that already is the view (``zero_grad(set_to_none=
        False)``: accumulated in place) is divided in place at launch. A fresh gradient is copied
        and divided in one pass, and ``param.grad`` is set to None until the bucket is sent (then it
        becomes the view): the fresh tensor is freed at once, and a gradient accumulated again
        before the send (reentrant checkpointing) arrives as a new tensor that is added, divided,
        to the slot instead of landing on an already divided view.
        """
        if torch.is_grad_enabled():  # backward(create_graph=True); otherwise autograd turned it off
            with torch.no_grad():
                return self.stage(slot)
        p, v = self.params[slot], self.views[slot]
        g = p.grad
        pre = self.pre
        state = self.slot_state[slot]  # stays _EMPTY in copy mode
        if g is None:
            if state != _DIVIDED:  # a staged view-mode slot reads None until the send
                self.present[slot], self.slot_state[slot] = False, _EMPTY
                v.zero_()  # no gradient on this rank counts as zeros
            return
        self.present[slot] = True
        if g is v:  # view mode, accumulated in place: divided at launch
            self.slot_state[slot] = _IN_VIEW
            return
        if state == _DIVIDED:  # view mode, accumulated again before the send: add this part
            v.add_(torch.div(g, pre) if pre != 1.0 else g)
        elif pre != 1.0:
            torch.div(g, pre, out=v)
        else:
            v.copy_(g)
        if self.view:
            self.slot_state[slot] = _DIVIDED
            p.grad = None  # becomes the view when the bucket is sent

    def prepare(self, overlapping: frozenset[int]) -> GradBucket:
        """Finish the staged buffer for the send (view mode: divide what was accumulated in the
        views, point each ``param.grad`` at its view) and set the presence flags."""
        # Slots stage_batched finished (all present, divided, repointed) are skipped.
        slots = self.eager_slots if self._batched_present else range(len(self.params))
        with torch.no_grad():
            if self.view:
                pre, state = self.pre, self.slot_state
                if pre != 1.0 and _IN_VIEW in state:
                    if all(s == _IN_VIEW for s in state):
                        self.data.div_(pre)  # one kernel for the whole bucket
                    else:
                        for slot in slots:
                            if state[slot] == _IN_VIEW:
                                self.views[slot].div_(pre)
                for slot in slots:
                    if state[slot] == _DIVIDED:
                        self.params[slot].grad = self.views[slot]
            present = self.present
            if all(present[s] for s in slots):
                self.flags.fill_(1)
            else:
                if self._batched_present:
                    present = list(present)
                    for s in self._batched_slots:
                        present[s] = True
                self.flags.copy_(torch.tensor(present, dtype=self.flags.dtype))
        assert self.grad_bucket is not None  # made in __init__
        return self.grad_bucket

    def failed(self) -> GradBucket:
        """What to send in a backward pass that failed here: the buffer as it is (the control
        tensor carries the failure)."""
        assert self.grad_bucket is not None  # made in __init__
        return self.grad_bucket

    def write_back(self, flags: list[float], overlapping: frozenset[int],
                   grads: list[torch.Tensor | None] | None = None) -> None:
        """Average and write back the summed buffer (``flags``: the summed presence flags;
        ``grads``: as for :meth:`stage_batched`)."""
        post = self.post
        slots: range | list[int] = range(len(self.params))
        with torch.no_grad():
            if self.view:
                if post != 1.0:
                    self.data.div_(post)
                if all(map(operator.is_, map(_grad_of, self.params), self.views)):
                    return  # every gradient is its view already (so present: flags >= 1)
            elif self._batched_slots and not overlapping:
                # Small gradients of this rank's own: one division per run of them in the
                # buffer, then one foreach copy out (bit for bit a division into each).
                batched = self._batched_grads(grads)
                if (all(map(operator.is_not, batched, repeat(None)))
                        and all(map(flags.__getitem__, self._batched_slots))):
                    if post != 1.0:
                        for region in self._batched_regions:
                            region.div_(post)
                    _foreach_copy_(cast(list[torch.Tensor], batched), self._batched_views)
                    slots = self.eager_slots
            for slot in slots:
                p = self.params[slot]
                if flags[slot] == 0:
                    continue  # no gradient on any rank: grad stays None everywhere
                v, g = self.views[slot], p.grad
                if self.view:
                    if g is not v:
                        p.grad = v
                elif g is None or (overlapping and g.data_ptr() in overlapping):
                    p.grad = torch.div(v, post) if post != 1.0 else v.clone()
                elif post != 1.0:
                    torch.div(v, post, out=g)
                else:
                    g.copy_(v)

    def zero(self) -> None:
        """Zero the buffer (view mode: the views are ``param.grad``) after a failed step."""
        with torch.no_grad():
            self.data.zero_()


class InPlaceBucket(_BucketBase):
    """One parameter whose gradient is reduced in ``param.grad`` itself, at the end of backward.

    ``flat`` is empty (no buffer of its own); ``flags`` is this bucket's slot of the reducer's
    control tensor, set by the reducer.
    """

    in_place = True

    def __init__(self, index: int, params: list[Entry], factors: tuple[float, float],
                 last: bool) -> None:
        super().__init__(index, params, factors, last)
        self.flat = self.data = torch.zeros(0, dtype=self.dtype)

    def stage(self, slot: int) -> None:
        """Nothing to copy: the gradient stays where it is; :meth:`prepare` reads and divides it."""

    def stage_batched(self, grads: list[torch.Tensor | None] | None = None) -> None:
        """Nothing to copy (see :meth:`stage`)."""

    def _wrap(self, buf: torch.Tensor) -> GradBucket:
        self.buffer = buf
        return GradBucket(self.index, buf.view(-1), self.numel, self.params, self.names,
                          self.last, in_place=True)

    def prepare(self, overlapping: frozenset[int]) -> GradBucket:
        """Pre-divide the gradient in ``param.grad`` and wrap it as the bucket's buffer.

        Runs at the end of backward only: autograd may hand a parameter a gradient that is a view
        of a tensor other nodes still read (``p.unsqueeze(0)`` added to an activation), so writing
        into it earlier would corrupt other gradients. A rank without the gradient sends zeros (a
        new tensor, kept if another rank had one). A non-contiguous gradient, a lazy conjugate or
        negative view (``w.conj()`` in the model: its values live in a bit, not in memory, and
        hooks that reinterpret the buffer, e.g. ``torch.view_as_real``, refuse it), or one whose
        memory overlaps another parameter's gradient (see :func:`overlapping_grads`), is sent
        as a contiguous pre-divided copy and written back after the sum (``copy_`` honours the
        bits).
        """
        p = self.params[0]
        g = p.grad
        with torch.no_grad():
            pre = self.pre
            if g is None:
                buf = torch.zeros(p.shape, dtype=p.dtype, device=p.device)
            elif (g.is_contiguous() and not g.is_conj() and not g.is_neg()
                  and g.data_ptr() not in overlapping):
                buf = g
                if pre != 1.0:
                    buf.div_(pre)
            else:
                buf = torch.empty(g.shape, dtype=g.dtype, device=g.device)
                if pre != 1.0:
                    torch.div(g, pre, out=buf)
                else:
                    buf.copy_(g)
            self.flags.fill_(1.0 if g is not None else 0.0)
        return self._wrap(buf)

    def failed(self) -> GradBucket:
        """What to send in a backward pass that failed here: zeros (``param.grad`` left alone)."""
        p = self.params[0]
        return self._wrap(torch.zeros(p.shape, dtype=p.dtype, device=p.device))

    def write_back(self, flags: list[float], overlapping: frozenset[int],
                   grads: list[torch.Tensor | None] | None = None) -> None:
        """Post-divide the sum and leave it in ``param.grad`` (``flags``: the summed flag)."""
        buf, self.buffer = self.buffer, None
        assert buf is not None  # set by the send
        if flags[0] == 0.0:
            return  # no gradient on any rank (so none here either): grad stays None
        p, post = self.params[0], self.post
        with torch.no_grad():
            if post != 1.0:
                buf.div_(post)
            g = p.grad
            if g is None or (g is not buf and g.data_ptr() in overlapping):
                # no gradient here (the sum arrived in a zero tensor), or one whose memory other
                # gradients share: a tensor of its own, in the parameter's layout as autograd
                # would have made it (channels_last...)
                p.grad = buf if p.is_contiguous() else torch.empty_like(p).copy_(buf)
            elif g is not buf:  # sent as a copy (non-contiguous, lazy conj/neg)
                g.copy_(buf)

    def zero(self) -> None:
        """Nothing to zero: the gradient was the user's (left alone when the step failed)."""


Bucket = SharedBucket | InPlaceBucket

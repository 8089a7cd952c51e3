"""The autograd glue: the hooks through which torch drives a reducer's backward pass.

A post-accumulate-grad hook per parameter (:func:`on_grad_ready`) counts the gradient (and stages
a large one) and launches the buckets that became ready; the first one of a backward pass queues
one end-of-backward callback (:class:`BackwardEnd`) on the autograd engine; a forward pre-hook on
the module (:class:`ForwardPreHook`) runs the model checks before each forward. Everything here
only forwards to the :class:`~gradcomm.hooks._backward.BackwardPass` (or the reducer), so that
torch's hooks hold nothing else.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from ..comm.errors import brief
from ._buckets import dense_only

if TYPE_CHECKING:
    from ._backward import BackwardPass
    from .reducer import GradientReducer

__all__ = ["BackwardEnd", "ForwardPreHook", "StrongRef", "PassRef", "before_accumulate",
           "current_autograd_node", "grad_hook_of", "on_grad_ready", "on_late_grad_ready",
           "queue_engine_callback"]


def queue_engine_callback(fn: Any) -> None:
    """Run ``fn`` when the autograd engine's current graph task ends."""
    # torch has no public API to run code when a backward pass ends (the proposal to expose
    # torch.autograd.graph.queue_callback, pytorch#193958, was not merged); torch DDP and FSDP use
    # this same engine method.
    torch.autograd.Variable._execution_engine.queue_callback(fn)


def current_autograd_node() -> Any:
    """The node the autograd engine is running on this thread, None outside a backward pass."""
    # Used to tell the end of a nested (reentrant) backward from the end of the outermost one.
    return torch._C._current_autograd_node()


class BackwardEnd:
    """The end-of-backward callback of one backward pass (weakly referenced by its pass)."""

    __slots__ = ("__weakref__", "backward")

    def __init__(self, backward: BackwardPass) -> None:
        self.backward = backward

    def __call__(self) -> None:
        self.backward.on_backward_end(self)


class _InertHook:
    """What a copy of a wrapped module holds where the original has the reducer's forward hook."""

    __slots__ = ()

    def __call__(self, module: nn.Module, args: Any) -> None:
        return None


class ForwardPreHook:
    """The reducer's forward pre-hook on its module (it keeps the reducer alive).

    A copy of the module (``copy.deepcopy``, or ``torch.save``/pickle of the whole module) gets an
    :class:`_InertHook` in its place, so the copy is an ordinary local module -- as the ``.module``
    of a DDP wrapper is -- and copying never tries to copy the communicator (which cannot be).
    """

    __slots__ = ("reducer",)

    def __init__(self, reducer: GradientReducer) -> None:
        self.reducer = reducer

    def __call__(self, module: nn.Module, args: Any) -> None:
        self.reducer._on_forward(module)

    def __deepcopy__(self, memo: dict[int, Any]) -> _InertHook:
        return _InertHook()

    def __reduce__(self) -> tuple[type[_InertHook], tuple[()]]:
        return (_InertHook, ())


#: How a parameter's gradient hook finds its backward pass (see :func:`on_grad_ready`).
PassRef = Callable[[], "BackwardPass | None"]


class StrongRef:
    """Called like a weak reference, but keeps the pass alive (see :func:`on_grad_ready`)."""

    __slots__ = ("_target",)

    def __init__(self, target: BackwardPass) -> None:
        self._target = target

    def __call__(self) -> BackwardPass:
        return self._target


def before_accumulate(ref: PassRef, grad: torch.Tensor) -> None:
    """Tensor hook (before accumulation) of a parameter-list reducer in view mode: send the rest
    of a failed backward pass before autograd adds the new gradient into a view (see the
    reducer's ``__init__``)."""
    bw = ref()
    if bw is not None and bw.epoch_active and bw.token() is None:
        bw.discard_if_stale()


def on_grad_ready(ref: PassRef, pid: int, param: torch.Tensor) -> None:
    """Post-accumulate-grad hook of parameter ``pid``: mark it ready (staging a large gradient;
    a small one is staged with its bucket, see ``SharedBucket.stage_batched``), launch ready
    buckets.

    ``ref()`` gives the backward pass: a weak reference when the reducer wraps a module (whose
    forward hook keeps the reducer, and so its pass, alive), because torch does not show a
    tensor's hooks to Python's garbage collector and a strong reference here would keep every
    reducer and module dropped without ``remove()`` alive for good; a :class:`StrongRef` when it
    was built from parameters (nothing else holds it). A function, not a method, so that the
    lookup costs no extra Python call on this path (it runs once per parameter per backward).
    """
    bw = ref()
    if bw is None or not bw.require_sync or bw.removed:
        return
    grad = param.grad
    if grad is not None and grad.layout is not torch.strided:
        raise dense_only(bw.names[pid], grad.layout)
    # Runs once per parameter per backward: the checks of discard_if_stale and poll are
    # inlined so that the common case calls nothing.
    if bw.epoch_active and bw.token() is None:
        bw.discard_if_stale()
    if not bw.epoch_active:
        bw.begin()
    bidx, slot = bw.loc[pid]
    bucket = bw.buckets[bidx]
    if bw.ready[pid]:
        if bucket.work is not None:
            bw.abort()
            raise RuntimeError(
                f"the gradient of {brief(bw.names[pid], 50)} was accumulated again after "
                f"{brief(bucket.label(), 40)} was sent; a parameter used inside and outside a "
                "reentrant checkpoint does this (use checkpoint(..., use_reentrant=False))"
            )
        if bucket.eager[slot]:  # accumulated again before the bucket left: copy again
            bucket.stage(slot)
        return
    bw.ready[pid] = True
    if bucket.eager[slot]:  # a small gradient is staged with its bucket, at the send
        bucket.stage(slot)
    bucket.pending -= 1
    if bw.overlap and bucket.pending == 0 and bidx == bw.next:
        bw.launch_ready()
    if bw.polled < bw.next:
        bw.poll()


def on_late_grad_ready(ref: PassRef, pid: int, param: torch.Tensor) -> None:
    """Post-accumulate-grad hook of a small gradient in a bucket that only the end of backward
    sends (see :func:`grad_hook_of`): once the pass has begun, only mark it ready -- that
    bucket's send stages it (checking that it is dense), and no hook launches it, so nothing
    counts its gradients. Otherwise (the pass's first gradient, or the first after a failed
    pass) as :func:`on_grad_ready`. The same checks, in fewer steps: one per parameter."""
    bw = ref()
    if bw is None or not bw.require_sync or bw.removed:
        return
    if not bw.epoch_active or bw.token() is None:
        on_grad_ready(ref, pid, param)
        return
    bw.ready[pid] = True
    if bw.polled < bw.next:
        bw.poll()



def grad_hook_of(bw: BackwardPass, pid: int) -> Callable[[PassRef, int, torch.Tensor], None]:
    """The gradient hook of parameter ``pid``: :func:`on_late_grad_ready` when its gradient is
    small (staged by its bucket's send) and its bucket is sent only at the end of backward, so
    that nothing needs to count it; else :func:`on_grad_ready`."""
    bidx, slot = bw.loc[pid]
    b = bw.buckets[bidx]
    late = not b.in_place and not b.eager[slot] and (
        not bw.overlap or bidx >= bw.hook_launch_limit)
    return on_late_grad_ready if late else on_grad_ready

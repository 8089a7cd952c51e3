"""The autograd glue: the hooks through which torch drives a reducer's backward pass.

A post-accumulate-grad hook per parameter (:func:`on_grad_ready`) counts the gradient (and stages
a large one) and launches the buckets that became ready; the first one of a backward pass queues
one end-of-backward callback (:class:`BackwardEnd`) on the autograd engine; a forward pre-hook on
the module (:class:`ForwardPreHook`) runs the model checks before each forward. Everything here
only forwards to the :class:`~gradcomm.hooks._backward.BackwardPass` (or the reducer), so that
torch's hooks hold nothing else.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from functools import partial
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from ..comm.errors import brief
from ._buckets import dense_only

if TYPE_CHECKING:
    from ._backward import BackwardPass
    from .reducer import GradientReducer

__all__ = ["BackwardEnd", "ForwardPreHook", "StrongRef", "PassRef", "before_accumulate",
           "current_autograd_node", "grad_hook_of", "on_grad_ready", "on_late_grad_ready",
           "queue_engine_callback", "refuse_recorded_graphs", "register_hooks", "remove_handles"]

STALE_GRAPH = ("GradientReducer: backward of a graph recorded before the reducer was built (its "
               "construction broadcast changed the parameters); build the reducer first, then "
               "forward and backward")


def _refuse(grad_outputs: tuple[torch.Tensor, ...]) -> None:
    raise RuntimeError(STALE_GRAPH)


def refuse_recorded_graphs(params: list[torch.Tensor]) -> list[RemovableHandle]:
    """Make the backward of every graph recorded so far through ``params`` raise RuntimeError
    (:data:`STALE_GRAPH`) when it reaches one of them, before the reducer's hooks run; returns
    the hooks' handles.

    A leaf's gradient accumulator node lives as long as some graph refers to it, and a graph
    recorded while it lives shares it: the pre-hook registered on it here is reached by the
    graphs that exist now and, until the handles are removed (at the module's first forward with
    gradients), by new ones. A graph recorded after that gets a new accumulator if the old graphs
    are gone, or shares theirs without the hook.
    """
    return [torch.autograd.graph.get_gradient_edge(p).node.register_prehook(_refuse)
            for p in params if p.requires_grad]


def remove_handles(handles: list[RemovableHandle]) -> list[RemovableHandle]:
    """Remove every hook of ``handles``; returns an empty list (what is left)."""
    for h in handles:
        h.remove()
    return []


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


def register_hooks(reducer: GradientReducer, view: bool) -> list[RemovableHandle]:
    """Register the reducer's hooks: :func:`grad_hook_of`'s on every parameter, and
    :class:`ForwardPreHook` on its module (without one, in view mode, :func:`before_accumulate`
    on every parameter); returns their handles."""
    bw = reducer._backward
    ref: PassRef = StrongRef(bw) if reducer._module is None else weakref.ref(bw)
    handles = [p.register_post_accumulate_grad_hook(partial(grad_hook_of(bw, i), ref, i))
               for i, p in enumerate(reducer._params)]
    if reducer._module is not None:
        handles.append(reducer._module.register_forward_pre_hook(ForwardPreHook(reducer)))
    elif view:
        # Without a module there is no forward hook to notice a failed backward before the
        # next one; in view mode autograd would then add the first new gradient into its view
        # before the reducer's hook sends the failed pass's rest and zeroes the views (with
        # zero_grad(set_to_none=False) the gradients are the views). A hook that runs before
        # accumulation notices it first.
        handles += [p.register_hook(partial(before_accumulate, ref)) for p in reducer._params]
    return handles


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

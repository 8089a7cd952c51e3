"""What the reducer needs of autograd's engine and hooks, beside its own backward pass.

Running a callback when the engine's graph task ends (:func:`queue_engine_callback`), telling a
nested backward from the outermost (:func:`current_autograd_node`), refusing graphs recorded
before the reducer existed (:func:`refuse_recorded_graphs`), and the module's forward pre-hook
(:class:`ForwardPreHook`). The per-parameter hooks, which drive the backward pass, live with it
in :mod:`~gradcomm.hooks._backward`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

__all__ = ["ForwardPreHook", "STALE_GRAPH", "current_autograd_node", "queue_engine_callback",
           "refuse_recorded_graphs", "remove_handles"]

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

    __slots__ = ("on_forward",)

    def __init__(self, on_forward: Callable[[nn.Module], None]) -> None:
        self.on_forward = on_forward  # the reducer's bound method: it keeps the reducer alive

    def __call__(self, module: nn.Module, args: Any) -> None:
        self.on_forward(module)

    def __deepcopy__(self, memo: dict[int, Any]) -> _InertHook:
        return _InertHook()

    def __reduce__(self) -> tuple[type[_InertHook], tuple[()]]:
        return (_InertHook, ())



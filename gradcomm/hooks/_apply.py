"""``apply_gradient_allreduce``: the entry point of NVIDIA's tacotron2/waveglow ``distributed.py``,
kept for scripts written against it."""

from __future__ import annotations

from torch import nn

from ..comm.communicator import Communicator
from .reducer import GradientReducer

__all__ = ["apply_gradient_allreduce"]


def apply_gradient_allreduce(module: nn.Module, comm: Communicator | None = None) -> nn.Module:
    """Attach gradient averaging to ``module`` and return it (the old NVIDIA entry point).

    Drop-in for the ``apply_gradient_allreduce(module)`` of NVIDIA's tacotron2/waveglow
    ``distributed.py``: parameters are broadcast from rank 0 and every ``loss.backward()`` ends with
    averaged gradients. Applying it again to the same module (with no ``comm``, or the same one)
    returns the module unchanged: one reducer, each bucket sent once. The
    :class:`GradientReducer` doing it (default options) is stored as
    ``module.gradient_reducer``; a ``copy.deepcopy`` or ``torch.save`` of the module is a local
    module whose ``gradient_reducer`` is None.

    Raises:
        TypeError: ``module`` is not an ``nn.Module``.
        RuntimeError: the module's ``gradient_reducer`` uses another communicator.
    """
    if not isinstance(module, nn.Module):
        raise TypeError(f"module must be an nn.Module, got {type(module).__name__}")
    old = getattr(module, "gradient_reducer", None)
    if isinstance(old, GradientReducer) and old.module is module and not old._backward.removed:
        if comm is None or comm is old.comm:
            return module  # applied again (tacotron2's train.py does): keep the one reducer
        raise RuntimeError("apply_gradient_allreduce: the module already has a gradient_reducer "
                           "on another communicator; call module.gradient_reducer.remove() first")
    reducer = GradientReducer(module, comm)
    object.__setattr__(module, "gradient_reducer", reducer)
    return module

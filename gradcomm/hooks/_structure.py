"""Notice when any module's parameters or submodules are (re)registered.

The :class:`~gradcomm.GradientReducer` must refuse to train a module whose parameters changed
after it was wrapped (a new trainable parameter's gradient would stay local and the ranks would
drift apart). Walking ``module.named_parameters()`` before every forward finds such parameters
but is most of the check's cost on a model with many parameters. Every way that
public torch code adds or replaces a parameter or submodule -- ``setattr``,
``register_parameter``/``add_module``, ``load_state_dict(assign=True)``, parametrizations -- runs
torch's global registration hooks
(``torch.nn.modules.module.register_module_{parameter,module}_registration_hook``), so the reducer
walks again only after one of them fired (for any module in the process). Buffers are not
watched: a module that reassigns one in every forward (a running average) would otherwise make
every check walk the module.

What these hooks do not see -- ``requires_grad_()`` and ``param.data = ...`` / ``module.to()``,
which keep the registered objects -- the reducer checks on every forward without a walk.
"""

from __future__ import annotations

from typing import Any

from torch.nn.modules import module as _module_hooks  # the public home of the global hooks

__all__ = ["StructureWatch"]


class StructureWatch:
    """A flag set whenever torch registers a parameter or submodule on any module.

    ``changed`` is True from the start (nothing has been checked yet); the owner clears it after
    a successful check. :meth:`close` removes the global hooks (idempotent); the hooks reference
    only this object, so a reducer that is garbage-collected without ``remove()`` is not kept
    alive by them (it closes its watch with :func:`weakref.finalize`).
    """

    def __init__(self) -> None:
        self.changed = True
        self._handles = [
            _module_hooks.register_module_parameter_registration_hook(self._note),
            _module_hooks.register_module_module_registration_hook(self._note),
        ]

    def _note(self, module: Any, name: str, value: Any) -> None:
        self.changed = True  # returning None keeps the value torch is registering

    def close(self) -> None:
        """Remove the global hooks."""
        for handle in self._handles:
            handle.remove()
        self._handles = []

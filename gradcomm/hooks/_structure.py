"""Notice when any module's parameters or submodules are (re)registered.

The :class:`~gradcomm.GradientReducer` must refuse to train a module whose parameters changed
after it was wrapped (a new trainable parameter's gradient would stay local and the ranks would
drift apart). Walking ``module.named_parameters()`` before every forward finds such parameters
but is most of the check's cost on a model with many parameters. Every way that
public torch code adds or replaces a parameter or submodule -- ``setattr``,
``register_parameter``/``add_module``, ``load_state_dict(assign=True)``, parametrizations -- runs
torch's global registration hooks
(``torch.nn.modules.module.register_module_{parameter,module}_registration_hook``), so the reducer
walks again only after one of them fired (for any module in the process). Buffers have a flag of
their own (:class:`ModuleBuffers`): a module that reassigns one in every forward (a running
average) then re-walks for its buffers only, not for the parameter check.

What these hooks do not see -- ``requires_grad_()`` and ``param.data = ...`` / ``module.to()``,
which keep the registered objects -- the reducer checks on every forward without a walk.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.nn.modules import module as _module_hooks  # the public home of the global hooks

__all__ = ["ModuleBuffers", "StructureWatch"]



class StructureWatch:
    """A flag set whenever torch registers a parameter or submodule on any module.

    ``changed`` is True from the start (nothing has been checked yet); the owner clears it after
    a successful check. :meth:`close` removes the global hooks (idempotent); the hooks reference
    only this object, so a reducer that is garbage-collected without ``remove()`` is not kept
    alive by them (it closes its watch with :func:`weakref.finalize`).
    """

    def __init__(self) -> None:
        self.changed = True
        self.buffers_changed = True  # a buffer or submodule registered (see ModuleBuffers)
        self._handles = [
            _module_hooks.register_module_parameter_registration_hook(self._note),
            _module_hooks.register_module_module_registration_hook(self._note_module),
            _module_hooks.register_module_buffer_registration_hook(self._note_buffer),
        ]

    # Each returns None, which keeps the value torch is registering.
    def _note(self, module: Any, name: str, value: Any) -> None:
        self.changed = True

    def _note_module(self, module: Any, name: str, value: Any) -> None:
        self.changed = self.buffers_changed = True

    def _note_buffer(self, module: Any, name: str, value: Any) -> None:
        self.buffers_changed = True

    def close(self) -> None:
        """Remove the global hooks."""
        for handle in self._handles:
            handle.remove()
        self._handles = []


class ModuleBuffers:
    """A module's buffers in ``named_buffers()`` order, without walking the module each time.

    Remembers which table (a module's ``_buffers``) and key holds each buffer and reads them
    through it, so a buffer replaced where torch writes the table directly (``module.to()``,
    ``.double()``) is read as it is now; the walk is redone only after ``watch`` saw a buffer or
    submodule registered (``register_buffer``, assigning a buffer attribute, a new submodule).
    A buffer deleted (``del``) is skipped.
    """

    def __init__(self, module: nn.Module, watch: StructureWatch) -> None:
        self._module = module
        self._watch = watch
        self._tables: list[dict[str, torch.Tensor | None]] = []
        self._keys: list[str] = []

    def current(self) -> list[torch.Tensor]:
        """The buffers now (as ``[b for _, b in module.named_buffers()]``)."""
        if self._watch.buffers_changed:
            self._watch.buffers_changed = False  # before the walk: a registration during it counts
            seen: set[int] = set()
            self._tables, self._keys = [], []
            for m in self._module.modules():  # as named_buffers(): modules and tensors once each
                for key, buf in m._buffers.items():
                    if buf is not None and id(buf) not in seen:
                        seen.add(id(buf))
                        self._tables.append(m._buffers)
                        self._keys.append(key)
        found = map(dict.get, self._tables, self._keys)
        return [b for b in found if b is not None]

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

import threading
import weakref
from typing import Any

import torch
from torch import nn
from torch.nn.modules import module as _module_hooks  # the public home of the global hooks

__all__ = ["ModuleBuffers", "StructureWatch"]

# torch keeps its global registration hooks in a dict that every module registration iterates;
# adding or removing one while another thread builds a module raises "OrderedDict mutated during
# iteration" there. So the hooks are installed once, when this module is imported, never removed,
# and tell the live watches. The watches are a tuple replaced whole (copy on write), so a hook
# reads it without a lock; close() only sets a flag, since it also runs from a finalizer, which
# the garbage collector may start anywhere, even inside the adding lock.
_watches: tuple[weakref.ref[StructureWatch], ...] = ()
_adding = threading.Lock()


def _live_watches() -> list[StructureWatch]:
    return [w for w in (r() for r in _watches) if w is not None and not w.closed]


# Each returns None, which keeps the value torch is registering.
def _note_parameter(module: Any, name: str, value: Any) -> None:
    for watch in _live_watches():
        watch.changed = True


def _note_module(module: Any, name: str, value: Any) -> None:
    for watch in _live_watches():
        watch.changed = watch.buffers_changed = True


def _note_buffer(module: Any, name: str, value: Any) -> None:
    for watch in _live_watches():
        watch.buffers_changed = True


_module_hooks.register_module_parameter_registration_hook(_note_parameter)
_module_hooks.register_module_module_registration_hook(_note_module)
_module_hooks.register_module_buffer_registration_hook(_note_buffer)


class StructureWatch:
    """A flag set whenever torch registers a parameter or submodule on any module.

    ``changed`` is True from the start (nothing has been checked yet); the owner clears it after
    a successful check. :meth:`close` stops the notes (idempotent). The process-wide hooks, added
    once at import (adding and removing them races with module construction in other threads),
    hold the watches weakly, so a reducer that is garbage-collected without ``remove()`` is not
    kept alive by them.
    """

    def __init__(self) -> None:
        global _watches
        self.changed = True
        self.buffers_changed = True  # a buffer or submodule registered (see ModuleBuffers)
        self.closed = False
        with _adding:
            _watches = (*(r for r in _watches if (w := r()) is not None and not w.closed),
                        weakref.ref(self))

    def close(self) -> None:
        """Stop noting registrations (the next watch made drops this one from the list)."""
        self.closed = True


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

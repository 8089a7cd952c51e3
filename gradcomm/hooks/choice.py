"""Choosing a comm hook by name: the :class:`CommHook` members and the hooks they stand for.

The hooks themselves are in :mod:`.comm_hooks` (all-reduce, fp16/bf16 compression) and
:mod:`.powersgd` (low-rank compression, built on the former); this module knows both, so neither
needs the other's names.
"""

from __future__ import annotations

import enum
from typing import Any

from ..comm.communicator import Communicator
from .comm_hooks import CommHookFn, allreduce_hook, bf16_compress_hook, fp16_compress_hook
from .powersgd import PowerSGDState, powersgd_hook

__all__ = ["CommHook", "default_hook_state", "resolve_comm_hook"]


class CommHook(enum.Enum):
    """The built-in comm hooks, selectable by member or by (case-insensitive) name."""

    ALLREDUCE = "allreduce"
    FP16_COMPRESS = "fp16_compress"
    BF16_COMPRESS = "bf16_compress"
    POWERSGD = "powersgd"

    @property
    def hook(self) -> CommHookFn:
        """The hook function of this member."""
        return _BUILTIN[self]

    @classmethod
    def coerce(cls, value: CommHook | str) -> CommHook:
        """Return ``value`` as a member; accepts the member or its name.

        Raises:
            ValueError: unknown name (the message lists the known ones).
            TypeError: neither a :class:`CommHook` nor a string.
        """
        if isinstance(value, cls):
            return value
        if isinstance(value, str):
            try:
                return cls(value.strip().lower().replace("-", "_"))
            except ValueError:
                known = ", ".join(m.value for m in cls)
                raise ValueError(f"unknown comm hook {value!r}; known: {known}") from None
        raise TypeError(
            f"comm hook must be a CommHook, str or callable, got {type(value).__name__}"
        )


_BUILTIN: dict[CommHook, CommHookFn] = {
    CommHook.ALLREDUCE: allreduce_hook,
    CommHook.FP16_COMPRESS: fp16_compress_hook,
    CommHook.BF16_COMPRESS: bf16_compress_hook,
    CommHook.POWERSGD: powersgd_hook,
}


def default_hook_state(hook: CommHookFn, comm: Communicator) -> Any:
    """The state ``hook`` gets when none is given: for the PowerSGD hook a new
    :class:`~gradcomm.hooks.PowerSGDState` of ``comm`` with default options (it keeps per-reducer
    memory), else ``comm``."""
    return PowerSGDState(comm) if hook is powersgd_hook else comm


def resolve_comm_hook(hook: CommHook | str | CommHookFn) -> CommHookFn:
    """Turn a :class:`CommHook`, its name, or a callable into a hook function (once, at the edge).

    Raises:
        ValueError: unknown name. TypeError: not a CommHook, string or callable.
    """
    if isinstance(hook, (CommHook, str)):
        return CommHook.coerce(hook).hook
    if callable(hook):
        return hook
    raise TypeError(f"comm hook must be a CommHook, str or callable, got {type(hook).__name__}")


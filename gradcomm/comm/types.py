"""Value types shared by every backend: reduction operations and capability answers.

Strings given by users (``"sum"``, ``"avg"``) are converted to :class:`ReduceOp` once, at the public
edge, by :meth:`ReduceOp.coerce`; nothing below the :class:`~gradcomm.comm.Communicator` methods
dispatches on strings.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import torch

__all__ = ["ReduceOp", "SupportLevel", "Support"]


class ReduceOp(enum.Enum):
    """Element-wise reduction applied by :meth:`Communicator.all_reduce`.

    ``AVG`` is the sum divided by ``world_size``; backends without a native average (gloo, MPI)
    emulate it as ``SUM`` followed by a division and say so in their capability table.
    ``AVG`` is defined for floating-point tensors only (an integer average would be truncated
    silently), so integer tensors with ``AVG`` raise :class:`TypeError` before any collective.
    """

    SUM = "sum"
    AVG = "avg"
    MIN = "min"
    MAX = "max"
    PRODUCT = "product"

    @classmethod
    def coerce(cls, op: ReduceOp | str) -> ReduceOp:
        """Return ``op`` as a :class:`ReduceOp`; accepts the enum or its case-insensitive name.

        Raises:
            ValueError: ``op`` is a string that names no operation.
            TypeError: ``op`` is neither a :class:`ReduceOp` nor a string.
        """
        if isinstance(op, cls):
            return op
        if isinstance(op, str):
            try:
                return cls(op.strip().lower())
            except ValueError:
                known = ", ".join(m.value for m in cls)
                raise ValueError(f"unknown reduction op {op!r}; known: {known}") from None
        raise TypeError(f"op must be a gradcomm.ReduceOp or str, got {type(op).__name__}")


class SupportLevel(enum.Enum):
    """How well a backend handles one (dtype, device) pair."""

    NATIVE = "native"
    """Reduced by the transport itself at full speed."""
    EMULATED_SLOW = "emulated-slow"
    """Correct, but through a slow path (upcast, user-defined reduction op, host staging)."""
    UNSUPPORTED = "unsupported"
    """The backend cannot reduce this pair; collectives on it raise TypeError."""


@dataclass(frozen=True)
class Support:
    """Answer of :meth:`Communicator.supports` for one (dtype, device) pair.

    Attributes:
        level: native, emulated-slow or unsupported.
        reason: one human-readable sentence; empty when ``level`` is NATIVE.
        transfer_dtype: the dtype the data travels in on the wire (equal to the tensor's dtype on a
            native path; e.g. ``torch.float32`` where fp16 is upcast).
    """

    level: SupportLevel
    reason: str = ""
    transfer_dtype: torch.dtype | None = None

    @property
    def is_slow(self) -> bool:
        """True when the pair is handled, but through a slow path."""
        return self.level is SupportLevel.EMULATED_SLOW

    @property
    def is_supported(self) -> bool:
        """True unless the pair is unsupported."""
        return self.level is not SupportLevel.UNSUPPORTED

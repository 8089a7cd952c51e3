"""Value types shared by every backend: reduction operations and capability answers.

Strings given by users (``"sum"``, ``"avg"``) are converted to :class:`ReduceOp` once, at the public
edge, by :meth:`ReduceOp.coerce`; nothing below the :class:`~gradcomm.comm.Communicator` methods
dispatches on strings.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import TypeVar

import torch

__all__ = ["ReduceOp", "Collective", "SupportLevel", "Support"]


_E = TypeVar("_E", bound=enum.Enum)


def _coerce(cls: type[_E], value: object, what: str, must: str) -> _E:
    """``value`` as a member of ``cls``: the member itself or its case-insensitive value."""
    if isinstance(value, cls):
        return value
    if isinstance(value, str):
        try:
            return cls(value.strip().lower())
        except ValueError:
            known = ", ".join(m.value for m in cls)
            raise ValueError(f"unknown {what} {value!r}; known: {known}") from None
    raise TypeError(f"{must} or str, got {type(value).__name__}")


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

    # Members compare by identity, so the identity hash is consistent with ==; Enum's own
    # hashes the name in Python, which every collective pays in ``op in native_reduce_ops``.
    __hash__ = object.__hash__

    @classmethod
    def coerce(cls, op: ReduceOp | str) -> ReduceOp:
        """Return ``op`` as a :class:`ReduceOp`; accepts the enum or its case-insensitive name.

        Raises:
            ValueError: ``op`` is a string that names no operation.
            TypeError: ``op`` is neither a :class:`ReduceOp` nor a string.
        """
        if op.__class__ is cls:  # the common call: one comparison, not two nested calls
            return op
        return _coerce(cls, op, "reduction op", "op must be a gradcomm.ReduceOp")


class Collective(enum.Enum):
    """A collective operation, as named by :meth:`Communicator.supports`'s ``collective``."""

    ALL_REDUCE = "all_reduce"
    REDUCE_SCATTER = "reduce_scatter"
    REDUCE = "reduce"
    BROADCAST = "broadcast"
    ALL_GATHER = "all_gather"
    #: all_gather with ``output_split_sizes`` (first dimensions differing by rank)
    ALL_GATHER_V = "all_gather_v"
    ALL_TO_ALL = "all_to_all"
    GATHER = "gather"
    SCATTER = "scatter"
    #: send/recv (point-to-point; nccl-tests' ``sendrecv``): moves data, any dtype
    SENDRECV = "sendrecv"

    @property
    def reduces(self) -> bool:
        """True for the collectives that combine values (their dtypes need a reduction)."""
        return self in (Collective.ALL_REDUCE, Collective.REDUCE_SCATTER, Collective.REDUCE)

    @classmethod
    def coerce(cls, name: Collective | str) -> Collective:
        """Return ``name`` as a :class:`Collective`; accepts the enum or its name.

        Raises:
            ValueError: a string that names no collective.
            TypeError: neither a :class:`Collective` nor a string.
        """
        return _coerce(cls, name, "collective", "collective must be a gradcomm.comm.Collective")


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

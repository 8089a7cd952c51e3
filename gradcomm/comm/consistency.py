"""Checking, before a collective, that every rank is about to run the same one.

Every rank must call the same collectives in the same order with matching arguments; when they
do not, transports fail in ways that do not name the cause: MPI returns silently wrong values
(an all-gather or all-reduce of different sizes, a different dtype or reduce op), gloo aborts
a process on a size mismatch, and a different operation waits until the timeout
(docs/failures.md has the table per backend). In the manner of torch's
``TORCH_DISTRIBUTED_DEBUG=DETAIL`` (which wraps each process group in one that compares a
fingerprint of every collective across ranks first), a :class:`ConsistencyCheck` all-gathers a
fixed-size int64 fingerprint of the call over the communicator's own transport, on its device,
and raises the same :class:`RuntimeError` on every rank when the fingerprints differ, naming the
first field that differs and the ranks.

The fingerprint is built from the collective's :class:`~gradcomm.comm.work.Description` (the
operation, this communicator's sequence number, element count, root, split sizes, label), the
reduce op and the dtype of its tensor, so a collective that goes through
``Communicator._issue`` is checked without code of its own; one with a root or split sizes
passes them to its Description.

Two levels (:class:`DebugLevel`): ``OFF`` (default) checks nothing, as torch.distributed does
not, so a collective costs what its transport costs (one small collective per call would more
than double a small all-gather); ``DETAIL`` checks every collective (``GRADCOMM_DEBUG=detail`` or
``gradcomm.init(debug="detail")``).
"""

from __future__ import annotations

import enum
import hashlib
import os
from collections.abc import Callable, Mapping, Sequence

import torch

from .errors import brief
from .types import ReduceOp
from .work import Description, DescriptionLike, Work

__all__ = ["DebugLevel", "ConsistencyCheck", "debug_level_from_env"]


class DebugLevel(enum.Enum):
    """How much a communicator checks across ranks before each collective."""

    #: No check (default).
    OFF = "off"
    #: Every collective: operation, sequence number, dtype, element count, split sizes, root,
    #: reduce op and label, with one small all-gather each.
    DETAIL = "detail"

    @classmethod
    def coerce(cls, value: DebugLevel | str | None, source: str = "debug") -> DebugLevel:
        """``value`` as a DebugLevel: a member, its name or value in any case, or None (OFF).

        Raises:
            TypeError: not a DebugLevel, str or None.
            ValueError: a string that names no level.
        """
        if value is None or isinstance(value, DebugLevel):
            return value or cls.OFF
        if not isinstance(value, str):
            raise TypeError(f"{source} must be a str or DebugLevel, got {type(value).__name__}")
        word = value.strip().lower()
        for level in cls:
            if word == level.value:
                return level
        if word in ("", "0"):
            return cls.OFF
        raise ValueError(f"{source} must be 'off' or 'detail' (any case), got {value!r}")


#: Operations never checked: a point-to-point transfer involves two ranks, not all of them.
_UNCHECKED = frozenset({"send", "recv"})
#: Operations whose element count differs by rank by design (all_to_all's uneven splits): their
#: count is left out of the fingerprint.
_PER_RANK_COUNT = frozenset({"all_to_all"})

#: The environment variable read by :func:`debug_level_from_env`.
DEBUG_ENV_VAR = "GRADCOMM_DEBUG"

_MAGIC = 0x6772_6164_636D_6D01  # "gradcmm" + format version 1
#: The fields of a fingerprint after its magic word, in the order they are compared, and
#: their words: texts (op name, label) take 16 bytes, truncated.
_FIELDS = ("op", "sequence number", "dtype", "element count", "split sizes", "root",
           "reduce op", "label")
_SIZES = (2, 1, 1, 1, 1, 1, 1, 2)
_SPANS = tuple(slice(1 + sum(_SIZES[:i]), 1 + sum(_SIZES[:i + 1])) for i in range(len(_SIZES)))
_WIDTH = 1 + sum(_SIZES)
_DTYPES: tuple[torch.dtype, ...] = (
    torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.complex64,
    torch.complex128, torch.int8, torch.uint8, torch.int16, torch.int32, torch.int64, torch.bool,
    torch.uint16, torch.uint32, torch.uint64, torch.float8_e4m3fn, torch.float8_e5m2,
)
_DTYPE_CODE = {dt: i + 1 for i, dt in enumerate(_DTYPES)}  # 0: no tensor (barrier)
_OPS = tuple(ReduceOp)


def debug_level_from_env(env: Mapping[str, str] | None = None) -> DebugLevel:
    """The level named by ``GRADCOMM_DEBUG`` (unset or blank: OFF).

    Raises:
        ValueError: a value that names no level (the message names the variable).
    """
    env = os.environ if env is None else env
    return DebugLevel.coerce(env.get(DEBUG_ENV_VAR, ""), DEBUG_ENV_VAR)


def _digest(data: bytes) -> int:
    """A signed 64-bit digest of ``data`` (blake2b; the same in every process, unlike hash())."""
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little", signed=True)


def _text_words(text: str) -> list[int]:
    raw = text.encode("utf-8", "replace")[:16].ljust(16, b"\0")
    return [int.from_bytes(raw[:8], "little", signed=True),
            int.from_bytes(raw[8:], "little", signed=True)]


def fingerprint(opname: str, description: DescriptionLike, dtype: torch.dtype | None) -> list[int]:
    """The int64 words compared across ranks for one collective (:data:`_WIDTH` of them)."""
    words = [_MAGIC, *_text_words(opname)]
    if isinstance(description, Description):
        seq, numel, root, splits, label = (description.seq, description.numel,
                                           description.root, description.splits,
                                           description.label)
        extra = description.extra
    else:  # pragma: no cover - every collective of the base class passes a Description
        seq, numel, root, splits, label, extra = -1, 0, None, None, None, None
    split_word = 0 if splits is None else _digest(
        b"".join(int(s).to_bytes(8, "little", signed=True) for s in splits))
    # a dtype outside _DTYPES (shown as "other") by a digest of its name, so two such differ
    code = 0 if dtype is None else _DTYPE_CODE.get(dtype) or _digest(str(dtype).encode())
    if opname in _PER_RANK_COUNT:
        numel = 0
    words += [seq, code, numel, split_word,
              -1 if root is None else root,
              _OPS.index(extra) if isinstance(extra, ReduceOp) else -1,
              *_text_words("" if label is None else label)]
    return words


def _shown(field: int, row: Sequence[int]) -> str:
    """How field ``field`` (index into _FIELDS) of a fingerprint ``row`` is named in messages."""
    if _SIZES[field] == 2:  # text: the op name as it is, a label quoted
        raw = b"".join(w.to_bytes(8, "little", signed=True) for w in row[_SPANS[field]])
        text = raw.rstrip(b"\0").decode("utf-8", "replace")
        return repr(text) if field else text
    value = row[_SPANS[field].start]
    if field == 2:
        return "none" if value == 0 else (str(_DTYPES[value - 1]).replace("torch.", "")
                                          if 0 < value <= len(_DTYPES) else "other")
    if field == 5:
        return "none" if value < 0 else str(value)
    if field == 6:
        return "none" if value < 0 else _OPS[value].name
    return str(value)


def _groups(field: int, rows: Sequence[Sequence[int]], digest: bool) -> str:
    """``"rank 0: 4; rank 1: 5"``: ranks grouped by their value of ``field`` (first 3 groups)."""
    keyed: dict[tuple[int, ...], list[int]] = {}
    for rank, row in enumerate(rows):
        keyed.setdefault(tuple(row[_SPANS[field]]), []).append(rank)
    parts = []
    for i, ranks in enumerate(keyed.values()):
        if i == 3:
            parts.append("...")
            break
        who = (f"rank {ranks[0]}" if len(ranks) == 1
               else f"ranks {','.join(map(str, ranks[:4]))}{',...' if len(ranks) > 4 else ''}")
        value = chr(ord("A") + i) if digest else _shown(field, rows[ranks[0]])
        parts.append(f"{who}: {value}")
    return "; ".join(parts)


def mismatch_message(rows: Sequence[Sequence[int]]) -> str | None:
    """The error for all-gathered fingerprints ``rows`` (one per rank), or None if they match.

    Built from ``rows`` alone, so every rank raises the same text (at most 200 characters).
    """
    first = rows[0]
    if all(row == first for row in rows):
        return None
    if any(row[0] != _MAGIC for row in rows):
        bad = [r for r, row in enumerate(rows) if row[0] != _MAGIC]
        return brief(f"collective check failed: ranks {bad[:4]} sent no fingerprint (another "
                     "collective, or a different GRADCOMM_DEBUG); set it alike on every rank",
                     200)
    for field, name in enumerate(_FIELDS):
        span = _SPANS[field]
        if any(row[span] != first[span] for row in rows):
            digest = name == "split sizes"
            where = f"{_shown(0, first)} #{_shown(1, first)}"
            text = (f"ranks called different collectives at rank 0's {where}, first difference in "
                    f"{name} ({_groups(field, rows, digest)})")
            return brief(text, 200)
    return None  # pragma: no cover - rows that differ differ in some field


class ConsistencyCheck:
    """Compares each collective's fingerprint across the ranks of one communicator.

    Args:
        exchange: ``exchange(output, input, description) -> Work``: the backend's all-gather
            hook (``Communicator._all_gather``) on 1-D int64 tensors.
        complete: ``complete(work, False, None)``: waits for ``work`` under the communicator's
            timeout and stall guard (``Communicator._complete``).
        world_size: number of ranks.
        device: the communicator's device; a barrier's fingerprint lives there (the others' on
            the device of the collective's tensor, which the checks placed there).
        level: the initial :class:`DebugLevel` (:attr:`level` may change it).
    """

    __slots__ = ("_complete", "_device", "_exchange", "_world_size", "level")

    def __init__(self, exchange: Callable[[torch.Tensor, torch.Tensor, DescriptionLike], Work],
                 complete: Callable[[Work, bool, None], object], world_size: int,
                 device: torch.device | str, level: DebugLevel = DebugLevel.OFF) -> None:
        self._exchange = exchange
        self._complete = complete
        self._world_size = world_size
        self._device = torch.device(device)
        self.level = level

    def wants(self, opname: str) -> bool:
        """Whether ``opname`` is checked at this level."""
        return self.level is DebugLevel.DETAIL and opname not in _UNCHECKED

    def check(self, opname: str, description: DescriptionLike, like: torch.Tensor | None) -> None:
        """All-gather this call's fingerprint; raise if any rank's differs.

        ``like`` is the collective's tensor (None for a barrier): the fingerprint is made with
        its ``new_empty``, so it lives where the transport expects the collective's data.

        Raises:
            RuntimeError: the ranks' fingerprints differ (the same message on every rank).
            CollectiveTimeoutError: not every rank joined the check within the timeout.
        """
        words = torch.tensor(fingerprint(opname, description,
                                         None if like is None else like.dtype), dtype=torch.int64)
        if like is None:
            mine = words.to(self._device)
            out = torch.empty(self._world_size * _WIDTH, dtype=torch.int64, device=self._device)
        else:
            mine = like.new_empty((_WIDTH,), dtype=torch.int64).copy_(words)
            out = like.new_empty((self._world_size * _WIDTH,), dtype=torch.int64)
        work = self._exchange(out, mine, f"consistency check before {description}")
        self._complete(work, False, None)
        flat = out.tolist()
        rows = [flat[r * _WIDTH:(r + 1) * _WIDTH] for r in range(self._world_size)]
        message = mismatch_message(rows)
        if message is not None:
            raise RuntimeError(message)

"""Bandwidth formulas, message-size sweeps and name parsing for the all-reduce benchmark.

Definitions follow nccl-tests (``doc/PERFORMANCE.md`` in https://github.com/NVIDIA/nccl-tests):

* ``time``: mean time of one operation, here in microseconds.
* ``algbw = size / time`` in GB/s, with ``GB = 1e9 bytes`` and ``size`` the bytes of the buffer
  each rank passes in.
* ``busbw = algbw * 2 (n - 1) / n`` for all-reduce on ``n`` ranks: the bandwidth each link of a
  ring would need, comparable to the hardware's peak and independent of ``n``.

The sweep's sizes follow nccl-tests' ``-b/-e/-f`` (``minbytes``, ``maxbytes``, ``stepfactor``):
``minbytes, minbytes * f, minbytes * f**2, ...`` up to ``maxbytes``; each size is rounded down to
a whole number of elements.
"""

from __future__ import annotations

import math
import re

import torch

from ..comm.types import ReduceOp

__all__ = [
    "GB",
    "algbw",
    "busbw",
    "busbw_factor",
    "parse_size",
    "format_size",
    "size_sweep",
    "parse_dtype",
    "dtype_name",
    "op_name",
]

#: Bytes in one GB as nccl-tests counts them (decimal, ``1.0E9``).
GB = 1.0e9

_SUFFIX = {"": 1, "K": 1024, "M": 1024**2, "G": 1024**3}

_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float": torch.float32,
    "float64": torch.float64,
    "double": torch.float64,
    "float16": torch.float16,
    "half": torch.float16,
    "bfloat16": torch.bfloat16,
    "int8": torch.int8,
    "uint8": torch.uint8,
    "int32": torch.int32,
    "int": torch.int32,
    "int64": torch.int64,
}

# nccl-tests' short names of the reduction ops (its ``redop`` column).
_OP_NAMES = {
    ReduceOp.SUM: "sum",
    ReduceOp.PRODUCT: "prod",
    ReduceOp.MIN: "min",
    ReduceOp.MAX: "max",
    ReduceOp.AVG: "avg",
}


def _check_positive(name: str, value: float) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a number, got {type(value).__name__}")
    if not math.isfinite(value) or value <= 0:
        raise ValueError(f"{name} must be a positive finite number, got {value!r}")


def algbw(size_bytes: int, seconds: float) -> float:
    """Algorithm bandwidth in GB/s: ``size_bytes / seconds / 1e9`` (nccl-tests' ``algbw``).

    Args:
        size_bytes: bytes of the buffer each rank reduces (``count * element size``).
        seconds: time of one operation, in seconds.

    Raises:
        ValueError: ``size_bytes`` is negative or ``seconds`` is not a positive finite number.
        TypeError: the arguments are not numbers.
    """
    _check_positive("seconds", seconds)
    if isinstance(size_bytes, bool) or not isinstance(size_bytes, int):
        raise TypeError(f"size_bytes must be an int, got {type(size_bytes).__name__}")
    if size_bytes < 0:
        raise ValueError(f"size_bytes must be >= 0, got {size_bytes}")
    return size_bytes / GB / seconds


def busbw_factor(world_size: int) -> float:
    """nccl-tests' all-reduce bus-bandwidth factor ``2 (n - 1) / n`` for ``n = world_size``.

    A ring all-reduce sends and receives ``2 (n - 1) / n`` times the buffer on every link, so
    ``busbw = algbw * factor`` can be compared with the link's peak bandwidth (0 for one rank).

    Raises:
        ValueError: ``world_size < 1``. TypeError: not an int.
    """
    if isinstance(world_size, bool) or not isinstance(world_size, int):
        raise TypeError(f"world_size must be an int, got {type(world_size).__name__}")
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    return 2.0 * (world_size - 1) / world_size


def busbw(size_bytes: int, seconds: float, world_size: int) -> float:
    """All-reduce bus bandwidth in GB/s: ``algbw(size_bytes, seconds) * 2 (n - 1) / n``.

    Raises:
        ValueError, TypeError: as :func:`algbw` and :func:`busbw_factor`.
    """
    return algbw(size_bytes, seconds) * busbw_factor(world_size)


def parse_size(text: str | int) -> int:
    """Parse a byte count as nccl-tests' ``-b/-e`` do: ``"8"``, ``"64K"``, ``"64M"``, ``"1G"``.

    Suffixes K, M and G are powers of 1024 (case-insensitive; a trailing ``B``/``iB`` is allowed).

    Raises:
        ValueError: not a non-negative integer with an optional suffix.
    """
    if isinstance(text, int) and not isinstance(text, bool):
        if text < 0:
            raise ValueError(f"size must be >= 0 bytes, got {text}")
        return text
    match = re.fullmatch(r"\s*(\d+)\s*([kmgKMG]?)(?:i?[bB])?\s*", str(text))
    if match is None:
        raise ValueError(f"size must look like 8, 64K, 64M or 1G (bytes), got {text!r}")
    return int(match.group(1)) * _SUFFIX[match.group(2).upper()]


def format_size(size_bytes: int) -> str:
    """Short human form of a byte count: ``8 B``, ``64 KiB``, ``1.5 MiB``, ``256 MiB``."""
    value = float(size_bytes)
    for unit in ("B", "KiB", "MiB"):
        if value < 1024:
            return f"{value:g} {unit}"
        value /= 1024
    return f"{value:g} GiB"


def size_sweep(
    minbytes: int, maxbytes: int, stepfactor: float = 2.0, element_size: int = 1
) -> list[int]:
    """Message sizes in bytes: ``minbytes * stepfactor**k <= maxbytes``, as nccl-tests' -b/-e/-f.

    Each size is rounded down to a multiple of ``element_size``; sizes smaller than one element
    are skipped, and duplicates (after rounding) appear once.

    Args:
        minbytes: first size in bytes (>= 1).
        maxbytes: last size in bytes (>= minbytes).
        stepfactor: multiplicative step (> 1).
        element_size: bytes per element of the dtype to be reduced.

    Returns:
        Increasing list of sizes in bytes (may be empty when ``maxbytes < element_size``).

    Raises:
        ValueError: ``minbytes < 1``, ``maxbytes < minbytes``, ``stepfactor <= 1`` or
            ``element_size < 1``.
    """
    if minbytes < 1:
        raise ValueError(f"minbytes must be >= 1, got {minbytes}")
    if maxbytes < minbytes:
        raise ValueError(f"maxbytes ({maxbytes}) must be >= minbytes ({minbytes})")
    _check_positive("stepfactor", stepfactor)
    if stepfactor <= 1:
        raise ValueError(f"stepfactor must be > 1, got {stepfactor}")
    if element_size < 1:
        raise ValueError(f"element_size must be >= 1, got {element_size}")
    sizes: list[int] = []
    size = float(minbytes)
    while size <= maxbytes:
        rounded = int(size) // element_size * element_size
        if rounded >= element_size and (not sizes or rounded > sizes[-1]):
            sizes.append(rounded)
        size *= stepfactor
    return sizes


def parse_dtype(name: str | torch.dtype) -> torch.dtype:
    """Return the torch dtype for ``name`` (``float32``/``float``, ``float16``/``half``, ...).

    Raises:
        ValueError: unknown name (the message lists the known ones).
    """
    if isinstance(name, torch.dtype):
        return name
    key = str(name).strip().lower().removeprefix("torch.")
    if key not in _DTYPES:
        raise ValueError(f"unknown dtype {name!r}; known: {', '.join(sorted(_DTYPES))}")
    return _DTYPES[key]


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.float32 -> "float32"``: the name printed in the ``type`` column."""
    return str(dtype).removeprefix("torch.")


def op_name(op: ReduceOp | str) -> str:
    """nccl-tests' name of a reduction op: ``sum``, ``prod``, ``min``, ``max``, ``avg``.

    Raises:
        ValueError: unknown op name.
    """
    if isinstance(op, str) and op.strip().lower() == "prod":
        op = ReduceOp.PRODUCT
    return _OP_NAMES[ReduceOp.coerce(op)]

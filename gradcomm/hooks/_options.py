"""The reducer's options: validation at the edge, and the defaults each communicator resolves.

:class:`ReducerOptions` checks every :class:`~gradcomm.hooks.GradientReducer` argument once (types
and ranges, before any collective), resolves the per-communicator defaults (the first bucket's cap,
the in-place threshold, the divide factors) and writes the fingerprint entries that ranks compare,
so that every rank lays out the same buckets and issues the same collectives.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from ..comm.communicator import Communicator

__all__ = [
    "ReducerOptions",
    "default_predivide_factor",
    "resolve_first_bucket_cap_mb",
    "resolve_in_place_min_mb",
    "qualified_name",
]

MIB = 2**20
_HALF = (torch.float16, torch.bfloat16)


def default_predivide_factor(world_size: int, dtype: torch.dtype) -> float:
    """The pre-divide factor used when ``gradient_predivide_factor`` is None.

    Gradients are divided by the pre-divide factor before the sum and by
    ``world_size / predivide`` after it (their product is ``world_size``), the scheme of Horovod's
    ``gradient_predivide_factor`` and of DDP's fp16 hooks, which divide before summing "to avoid
    overflow".

    * float16 / bfloat16: the largest power of two <= sqrt(world_size), but at least 2 -- about
      the square root, which balances overflow of the sum against underflow of the parts, and a
      power of two, so the division itself is exact (no rounding unless the result is subnormal).
      Two ranks of 40000 in fp16 sum to 40000 (not inf); 8 ranks of 1e-7 average to 1.19e-7 (not 0).
    * wider dtypes: ``world_size`` (one division, before the sum, as DDP does; fp32 has the range).

    Raises:
        ValueError: ``world_size < 1``.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if world_size == 1:
        return 1.0
    if dtype in _HALF:
        return float(2 ** max(1, int(math.log2(world_size)) // 2))
    return float(world_size)


def resolve_first_bucket_cap_mb(
    first_bucket_cap_mb: float | None, bucket_cap_mb: float, comm: Communicator
) -> float:
    """The cap of bucket 0 in MiB: ``first_bucket_cap_mb``, or when it is None, chosen for ``comm``.

    A small first bucket (DDP's 1 MiB) lets the first all-reduce start early in backward; that pays
    only when the transport moves data while backward computes
    (:attr:`Communicator.background_progress`: NCCL's stream, gloo with a spare core per process).
    Otherwise -- MPI without a progress thread, which advances only inside our polls, or 2 ranks on
    2 cores, where gloo's thread competes with backward for the core -- overlap hides nothing and
    splitting costs: fewer, larger collectives are cheaper, so bucket 0 gets ``bucket_cap_mb``.
    Measured on 2 ranks of a 2-core machine (README, Performance, "What moved the numbers"), x
    DDP with one bucket vs a 1 MiB first bucket, two alternating runs: gloo MLP 0.963/0.960 vs
    1.019/0.977, transformer 1.001/1.011 vs 1.037/1.045; mpi MLP 0.718/0.717 vs 0.751/0.718.
    """
    if first_bucket_cap_mb is not None:
        return float(first_bucket_cap_mb)
    return 1.0 if comm.background_progress else float(bucket_cap_mb)


def resolve_in_place_min_mb(in_place_min_mb: float | None, comm: Communicator) -> float:
    """The size in MiB from which gradients are reduced in place: ``in_place_min_mb``, or when it
    is None, chosen for ``comm``.

    Reducing a gradient in place in ``param.grad`` saves copying it into a shared bucket (one
    pass over its memory) and costs one more collective. That pays where collectives are cheap
    (:attr:`Communicator.cheap_collectives`: MPI on host memory), from 2 MiB up; elsewhere the
    default is ``math.inf`` (none). The measurements behind the threshold are in
    ``benchmarks/step_time.py``'s results (docs/results.md).

    Raises:
        TypeError: not a number (or a bool). ValueError: negative or NaN.
    """
    if in_place_min_mb is None:
        return 2.0 if comm.cheap_collectives else math.inf
    return _checked_in_place_min_mb(in_place_min_mb)


def _checked_mib(name: str, value: object) -> float:
    """A size argument in MiB as a float, or raise TypeError (not a real number, or a bool; numpy
    scalars are accepted)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a number of MiB, got {type(value).__name__}")
    return float(value)


def _checked_cap_mb(name: str, value: object) -> float:
    """A bucket cap in MiB: positive, and finite in bytes too, or raise ValueError."""
    mb = _checked_mib(name, value)
    if not (mb > 0 and math.isfinite(mb * MIB)):
        raise ValueError(f"{name} must be a positive number of MiB, finite in bytes too, "
                         f"got {value}")
    return mb


def _checked_in_place_min_mb(value: object) -> float:
    """``value`` as a float >= 0 (``-0.0`` as ``0.0``, so ranks compare equal; a size too large to
    count in bytes as ``math.inf``, which it means), or raise."""
    mb = _checked_mib("in_place_min_mb", value)
    if not mb >= 0:
        raise ValueError(f"in_place_min_mb must be a number of MiB >= 0 (or math.inf), got {value}")
    return mb + 0.0 if math.isfinite(mb * MIB) else math.inf


def qualified_name(fn: Callable[..., Any]) -> str:
    """``module.qualname`` of a function (or of a callable object's class): the same on every
    rank for the same hook."""
    named = fn if hasattr(fn, "__qualname__") else type(fn)
    return f"{getattr(named, '__module__', '?')}.{named.__qualname__}"


@dataclass(frozen=True)
class ReducerOptions:
    """The reducer's keyword arguments, checked (see :class:`~gradcomm.hooks.GradientReducer`).

    Sizes are floats in MiB (numpy scalars became floats, so byte counts are computed in
    float64); ``first_bucket_cap_mb`` and ``in_place_min_mb`` may still be None (resolved per
    communicator by :meth:`resolved`).
    """

    bucket_cap_mb: float
    first_bucket_cap_mb: float | None
    in_place_min_mb: float | None
    gradient_as_bucket_view: bool
    broadcast_buffers: bool
    gradient_predivide_factor: float | None
    overlap: bool
    broadcast_parameters: bool
    hierarchical: bool = False
    step_check: bool = True

    @classmethod
    def checked(
        cls, *, bucket_cap_mb: object, first_bucket_cap_mb: object, in_place_min_mb: object,
        gradient_as_bucket_view: object, broadcast_buffers: object,
        gradient_predivide_factor: object, overlap: object, broadcast_parameters: object,
        hierarchical: object = False, custom_hook: bool = False, step_check: object = True,
    ) -> ReducerOptions:
        """The options, validated in the order of the reducer's signature.

        Raises:
            TypeError: a size or factor that is not a number (or is a bool), a flag that is not
                a bool. ValueError: a cap that is not positive (or not finite in bytes), a
                negative or NaN ``in_place_min_mb``, ``hierarchical=True`` with a comm hook
                other than the plain all-reduce (``custom_hook``).
        """
        cap = _checked_cap_mb("bucket_cap_mb", bucket_cap_mb)
        first = (None if first_bucket_cap_mb is None
                 else _checked_cap_mb("first_bucket_cap_mb", first_bucket_cap_mb))
        flags = {"gradient_as_bucket_view": gradient_as_bucket_view,
                 "broadcast_buffers": broadcast_buffers, "overlap": overlap,
                 "broadcast_parameters": broadcast_parameters, "hierarchical": hierarchical,
                 "step_check": step_check}
        for name, flag in flags.items():
            if not isinstance(flag, bool):
                raise TypeError(f"{name} must be True or False, got {flag!r}")
        factor: float | None = None
        if gradient_predivide_factor is not None:
            f = gradient_predivide_factor
            if isinstance(f, bool) or not isinstance(f, numbers.Real):
                raise TypeError(
                    f"gradient_predivide_factor must be a number, got {type(f).__name__}"
                )
            factor = float(f)  # 2 and 2.0 (and numpy scalars) alike
        in_place = None if in_place_min_mb is None else _checked_in_place_min_mb(in_place_min_mb)
        if hierarchical and custom_hook:
            raise ValueError("hierarchical=True sums buckets with its own hook; it cannot be "
                             "combined with a comm_hook other than 'allreduce'")
        return cls(cap, first, in_place, bool(gradient_as_bucket_view), bool(broadcast_buffers),
                   factor, bool(overlap), bool(broadcast_parameters), bool(hierarchical),
                   bool(step_check))

    def check_comm(self, comm: Communicator) -> None:
        """Check what depends on the communicator.

        Raises:
            ValueError: ``gradient_predivide_factor`` outside ``[1, comm.world_size]``.
        """
        f = self.gradient_predivide_factor
        if f is not None and not (1.0 <= f <= comm.world_size):
            # Outside [1, world_size] one of the two factors multiplies: the gradients then
            # overflow or flush to zero sooner than with no split at all (1e39 gave zeros).
            raise ValueError(f"gradient_predivide_factor must be between 1 and world_size "
                             f"({comm.world_size}), got {f}")

    def resolved(self, comm: Communicator) -> tuple[float, float]:
        """``(first_bucket_cap_mb, in_place_min_mb)`` as ``comm`` resolves them."""
        return (resolve_first_bucket_cap_mb(self.first_bucket_cap_mb, self.bucket_cap_mb, comm),
                resolve_in_place_min_mb(self.in_place_min_mb, comm))

    def factors(self, world_size: int, dtype: torch.dtype) -> tuple[float, float]:
        """``(pre, post)`` divide factors of a bucket of ``dtype``; ``pre * post == world_size``."""
        pre = (default_predivide_factor(world_size, dtype)
               if self.gradient_predivide_factor is None
               else float(self.gradient_predivide_factor))
        return pre, world_size / pre

    def fingerprint(self, first_cap: float, in_place_mb: float,
                    hook: Callable[..., Any]) -> list[str]:
        """The entries ranks compare for the options (before the model's own entries)."""
        return [f"GradientReducer option bucket_cap_mb={self.bucket_cap_mb} "
                f"first_bucket_cap_mb={first_cap} in_place_min_mb={in_place_mb} "
                f"gradient_predivide_factor={self.gradient_predivide_factor}",
                # These decide which collectives run (a compression hook changes their dtype).
                f"GradientReducer setting comm_hook={qualified_name(hook)} "
                f"broadcast_buffers={self.broadcast_buffers} "
                f"broadcast_parameters={self.broadcast_parameters} "
                f"step_check={self.step_check}"]

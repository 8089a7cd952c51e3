"""User-defined MPI reduction ops over 16-bit floats (float16, bfloat16), applied by torch.

MPI has no bfloat16, and MPICH's float16 SUM is slow, so 16-bit data is either reduced by one of
these ops (MPI sees it as ``MPI.INT16_T``; the op views its buffers as the 16-bit dtype and torch
rounds each result to it) or upcast to float32 (see :func:`uses_user_op`).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import torch
from mpi4py import MPI

from ...types import ReduceOp

__all__ = ["half_op", "uses_user_op"]

# SUM and PRODUCT use the user op only up to this many ranks: with two ranks each element is
# rounded once, exactly like the float32 upcast, at half the bytes and without the two
# conversion passes. With more ranks the partial sums would be rounded to 16 bits at every step,
# so the upcast is used. MIN and MAX never round.
_USER_OP_MAX_WORLD = 2

_HalfReduce = Callable[[torch.Tensor, torch.Tensor], object]
_HALF_REDUCERS: dict[ReduceOp, _HalfReduce] = {
    ReduceOp.SUM: torch.Tensor.add_,
    ReduceOp.PRODUCT: torch.Tensor.mul_,
    ReduceOp.MIN: lambda acc, x: torch.minimum(acc, x, out=acc),
    ReduceOp.MAX: lambda acc, x: torch.maximum(acc, x, out=acc),
}
_half_ops: dict[tuple[torch.dtype, ReduceOp], MPI.Op] = {}
_half_ops_lock = threading.Lock()


def uses_user_op(op: ReduceOp, world_size: int) -> bool:
    """Whether a host-memory float16/bfloat16 all-reduce with ``op`` over ``world_size`` ranks
    uses :func:`half_op`: MIN and MAX at any world size (exact), SUM and PRODUCT up to two ranks
    (one rounding per element). Device memory never does: a user op cannot run on it."""
    return op in (ReduceOp.MIN, ReduceOp.MAX) or world_size <= _USER_OP_MAX_WORLD


def half_op(dtype: torch.dtype, op: ReduceOp) -> MPI.Op:
    """A user-defined MPI op reducing 16-bit floats of ``dtype`` in place with torch (cached,
    commutative)."""
    key = (dtype, op)
    with _half_ops_lock:
        found = _half_ops.get(key)
        if found is None:
            reduce = _HALF_REDUCERS[op]

            def _apply(inbuf: Any, inoutbuf: Any, _datatype: MPI.Datatype) -> None:
                if len(inoutbuf):
                    reduce(
                        torch.frombuffer(inoutbuf, dtype=dtype),
                        torch.frombuffer(inbuf, dtype=dtype),
                    )

            found = _half_ops[key] = MPI.Op.Create(_apply, commute=True)
        return found

"""How torch dtypes and reduction ops map onto MPI's, and raw views of tensors' memory."""

from __future__ import annotations

import torch
from mpi4py import MPI
from mpi4py.util import dtlib

from ...types import ReduceOp

__all__ = ["NATIVE", "HALF", "SUM_FAST", "MPI_BUFFER", "mpi_op", "predefined_datatype"]

#: Dtypes MPI reduces itself.
NATIVE = frozenset(
    {
        torch.float32,
        torch.float64,
        torch.int8,
        torch.uint8,
        torch.int16,
        torch.int32,
        torch.int64,
        torch.bool,
    }
)
#: 16-bit floats: reduced by a user-defined op or upcast (see :mod:`.ops16`).
HALF = frozenset({torch.float16, torch.bfloat16})
#: Native dtypes whose SUM is ``MPI.SUM`` (for bool it is logical or).
SUM_FAST = NATIVE - {torch.bool}

#: mpi4py 4 names it MPI.buffer; 3.x called the same class MPI.memory.
MPI_BUFFER = getattr(MPI, "buffer", None) or MPI.memory

_MPI_OPS: dict[ReduceOp, MPI.Op] = {
    ReduceOp.SUM: MPI.SUM,
    ReduceOp.MIN: MPI.MIN,
    ReduceOp.MAX: MPI.MAX,
    ReduceOp.PRODUCT: MPI.PROD,
}
# MPI allows only logical ops on MPI_C_BOOL.
_BOOL_OPS: dict[ReduceOp, MPI.Op] = {
    ReduceOp.SUM: MPI.LOR,
    ReduceOp.MAX: MPI.LOR,
    ReduceOp.MIN: MPI.LAND,
    ReduceOp.PRODUCT: MPI.LAND,
}


def mpi_op(op: ReduceOp, dtype: torch.dtype) -> MPI.Op:
    """The predefined MPI op of ``op`` (SUM, MIN, MAX or PRODUCT) on a native ``dtype``."""
    return (_BOOL_OPS if dtype == torch.bool else _MPI_OPS)[op]


def predefined_datatype(dtype: torch.dtype) -> MPI.Datatype:
    """The predefined MPI datatype of a torch dtype that numpy can represent.

    :func:`mpi4py.util.dtlib.from_numpy_dtype` returns a *duplicate* of the predefined type, which
    MPICH's predefined reduction ops reject ("MPI_Op operation not defined for this datatype"), so
    the duplicate is decoded to its predefined original and freed.
    """
    dup = dtlib.from_numpy_dtype(torch.empty(0, dtype=dtype).numpy().dtype)
    try:
        base, _combiner, _params = dup.decode()
    finally:
        dup.Free()
    return base

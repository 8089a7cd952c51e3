"""What the mpi backend answers to :meth:`~gradcomm.comm.Communicator.supports`."""

from __future__ import annotations

import torch

from ...types import ReduceOp, Support, SupportLevel
from .dtypes import HALF, NATIVE
from .ops16 import uses_user_op

__all__ = ["classify"]


def classify(
    dtype: torch.dtype,
    dev_type: str,
    comm_dev_type: str,
    world_size: int,
    cuda_aware: bool,
    cuda_reason: str,
) -> Support:
    """How an mpi communicator on ``comm_dev_type`` tensors all-reduces ``dtype`` on ``dev_type``.

    NATIVE for the dtypes MPI reduces itself, EMULATED_SLOW with ``transfer_dtype`` float32 for
    float16/bfloat16 (upcast) or with their own dtype (user op), EMULATED_SLOW for anything on
    CUDA when MPI is not ``cuda_aware`` (host staging; ``cuda_reason`` says why), and
    UNSUPPORTED for other dtypes or another device type.
    """
    if dev_type != comm_dev_type:
        return Support(
            SupportLevel.UNSUPPORTED,
            f"this mpi communicator works on {comm_dev_type} tensors, not {dev_type} "
            "(pass device= to gradcomm.init)",
        )
    staged = dev_type == "cuda" and not cuda_aware
    stage_note = (
        f"; MPI is not CUDA-aware ({cuda_reason}), so data is staged through host memory"
        if staged
        else ""
    )
    if dtype in NATIVE:
        if staged:
            return Support(SupportLevel.EMULATED_SLOW, stage_note[2:], dtype)
        return Support(SupportLevel.NATIVE, "", dtype)
    if dtype in HALF:
        if dev_type == "cpu" and uses_user_op(ReduceOp.SUM, world_size):
            return Support(
                SupportLevel.EMULATED_SLOW,
                f"MPI has no fast {dtype} reduction: reduced by a user-defined MPI op (a "
                "Python callback) over the 16-bit data",
                dtype,
            )
        return Support(
            SupportLevel.EMULATED_SLOW,
            f"MPI has no fast {dtype} reduction: upcast to float32, reduce, round back"
            + stage_note,
            torch.float32,
        )
    return Support(SupportLevel.UNSUPPORTED, f"the mpi backend cannot reduce {dtype}")

"""The nccl backend: CUDA tensors over a torch.distributed ``ProcessGroupNCCL`` of gradcomm's own.

Capability table (CUDA):

===========================================  ============  =====================================
dtype                                        support       note
===========================================  ============  =====================================
float16, bfloat16, float32, float64          native        bfloat16 needs NCCL >= 2.10 (every
                                                           CUDA build of torch >= 2.0 has it)
int8, uint8, int32, int64                    native
ReduceOp SUM, AVG, MIN, MAX, PRODUCT         native        AVG is ``ncclAvg``
other dtypes (bool, float8, ...)             unsupported   TypeError (complex: the base class
                                                           reduces the real view)
CPU tensors, or a GPU other than ``device``  unsupported   ValueError / TypeError
===========================================  ============  =====================================

Device: ``cuda:<local_rank>`` unless given; :func:`torch.cuda.set_device` is called before the
process group exists, so NCCL's communicator lands on that GPU. NCCL allows one rank per GPU, so a
host must not run more ranks than it has GPUs (checked on every rank before the rendezvous).

Rendezvous: the store of :func:`gradcomm.comm.rendezvous.create_store` -- ``MASTER_ADDR`` and
``MASTER_PORT`` (torchrun), or, under ``mpirun``/``mpiexec`` without them, an address broadcast over
MPI. The user's default process group is never touched.

Completion: :meth:`Work.wait` blocks the calling thread until the collective is done on the GPU
(at most the communicator's timeout), so the result can be read by any stream afterwards.
"""

from __future__ import annotations

import datetime

import torch
import torch.distributed as dist

from ..errors import BackendUnavailableError
from ..launcher import LaunchInfo
from ..types import ReduceOp, Support, SupportLevel
from .torch_dist import TorchDistCommunicator

__all__ = [
    "NCCL_DTYPES",
    "NCCL_REDUCE_OPS",
    "NCCLCommunicator",
    "check_same_device",
    "nccl_support",
    "nccl_unavailable",
    "resolve_cuda_device",
]

#: dtypes NCCL reduces natively (``ncclDataType_t``).
NCCL_DTYPES = frozenset(
    {
        torch.float16,
        torch.bfloat16,
        torch.float32,
        torch.float64,
        torch.int8,
        torch.uint8,
        torch.int32,
        torch.int64,
    }
)


#: Every ReduceOp is native in NCCL (AVG is ``ncclAvg``, NCCL >= 2.10).
NCCL_REDUCE_OPS = frozenset(ReduceOp)


def nccl_unavailable() -> BackendUnavailableError | None:
    """Why the nccl backend cannot run here (no CUDA device, no NCCL in torch), or None."""
    if not torch.cuda.is_available():
        return BackendUnavailableError(
            "nccl backend needs a CUDA device: torch.cuda.is_available() is False"
        )
    if not dist.is_available() or not dist.is_nccl_available():
        return BackendUnavailableError(
            "nccl backend needs NCCL, but this torch build has none "
            "(torch.distributed.is_nccl_available() is False); install a CUDA build of torch"
        )
    return None


def nccl_support(dtype: torch.dtype, device: torch.device, backend: str = "nccl") -> Support:
    """The capability table above, for one (dtype, device) pair (NCCL-based backends share it)."""
    if device.type != "cuda":
        return Support(
            SupportLevel.UNSUPPORTED,
            f"the {backend} backend reduces CUDA tensors, not {device.type}",
        )
    if dtype in NCCL_DTYPES:
        return Support(SupportLevel.NATIVE, "", dtype)
    return Support(SupportLevel.UNSUPPORTED, f"NCCL cannot reduce {dtype}")


def resolve_cuda_device(
    launch: LaunchInfo, device: torch.device | str | None, backend: str
) -> torch.device:
    """The CUDA device one rank of an NCCL-based backend uses (``cuda:<local_rank>`` by default).

    Args:
        launch: this process's place in the job.
        device: None or ``"cuda"`` for ``cuda:<local_rank>``, or an explicit ``cuda:<i>``.
        backend: backend name, for messages.

    Raises:
        ValueError: ``device`` is not a CUDA device, or its index is out of range.
        BackendUnavailableError: no CUDA device, or (default device) more ranks on this host than
            GPUs. ``local_world_size`` is the same on every rank of a host, so every rank raises.
    """
    if not torch.cuda.is_available():
        raise BackendUnavailableError(
            f"{backend} backend needs a CUDA device: torch.cuda.is_available() is False"
        )
    count = torch.cuda.device_count()
    dev = None if device is None else torch.device(device)
    if dev is not None and dev.type != "cuda":
        raise ValueError(f"the {backend} backend works on CUDA devices, not {dev}")
    if dev is None or dev.index is None:
        if launch.local_world_size > count:
            raise BackendUnavailableError(
                f"{launch.local_world_size} ranks on this host but {count} CUDA device(s): NCCL "
                f"needs a GPU of its own per rank; start at most {count} rank(s) per host"
            )
        return torch.device("cuda", launch.local_rank)
    if dev.index >= count:
        raise ValueError(f"{dev} does not exist: this host has {count} CUDA device(s)")
    return dev


def check_same_device(tensor: torch.Tensor, device: torch.device, opname: str) -> None:
    """Raise ValueError when a CUDA tensor is on another GPU than the communicator's."""
    if tensor.device != device:
        raise ValueError(
            f"{opname}: tensor is on {tensor.device}, but this communicator's GPU is {device}"
        )


class NCCLCommunicator(TorchDistCommunicator):
    """Collectives on CUDA tensors through a ``ProcessGroupNCCL`` of gradcomm's own.

    Args:
        launch: rank, world size and local rank (see :func:`gradcomm.comm.detect_launch`).
        timeout: seconds per collective, also NCCL's watchdog timeout; ``None``: a day.
        device: ``cuda:<i>``; default ``cuda:<local_rank>``.

    Raises:
        BackendUnavailableError: no CUDA device, no NCCL in this torch, or more ranks than GPUs
            on this host.
        ValueError: ``device`` is not a CUDA device of this host.
        RuntimeError: the rendezvous failed.
    """

    backend = "nccl"
    native_reduce_ops = NCCL_REDUCE_OPS
    interface_variable = "NCCL_SOCKET_IFNAME"  # unset: gradcomm sets it to the chosen interface
    exports_interface = True

    def __init__(
        self,
        launch: LaunchInfo,
        *,
        timeout: float | None = 300.0,
        device: torch.device | str | None = None,
    ) -> None:
        problem = nccl_unavailable()
        if problem is not None:
            raise problem
        dev = resolve_cuda_device(launch, device, self.backend)
        torch.cuda.set_device(dev)  # before NCCL creates its communicator on "the" device
        super().__init__(launch, device=dev, timeout=timeout)

    def _make_group(
        self, store: dist.Store, launch: LaunchInfo, timeout: float | None
    ) -> dist.ProcessGroup:
        seconds = 86400 if timeout is None else timeout
        td = datetime.timedelta(seconds=seconds)
        opts = dist.ProcessGroupNCCL.Options(is_high_priority_stream=False)
        # The options have no public timeout field; torch's own init_process_group sets this one
        # (every torch 2.x). It is also the watchdog's timeout.
        opts._timeout = td
        group = dist.ProcessGroupNCCL(store, launch.rank, launch.world_size, opts)
        return group  # type: ignore[return-value]  # a Backend: the methods used are the same

    @property
    def background_progress(self) -> bool:
        """True: NCCL kernels run on their own CUDA stream while backward computes."""
        return True

    def _supports(self, dtype: torch.dtype, device: torch.device | str | None) -> Support:
        dev = self.device if device is None else torch.device(device)
        return nccl_support(dtype, dev, self.backend)

    def _check_tensor(self, tensor: object, opname: str, *, reduction: bool = True) -> str:
        tail = super()._check_tensor(tensor, opname, reduction=reduction)
        if isinstance(tensor, torch.Tensor):  # always, after the base class's checks
            check_same_device(tensor, self.device, opname)
        return tail


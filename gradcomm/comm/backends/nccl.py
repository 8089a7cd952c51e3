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

Rendezvous: the store of :func:`gradcomm.comm._rendezvous.create_store` -- ``MASTER_ADDR`` and
``MASTER_PORT`` (torchrun), or, under ``mpirun``/``mpiexec`` without them, an address broadcast over
MPI. The user's default process group is never touched.

Completion: torch's ``WorkNCCL.wait()`` only makes the current stream wait for NCCL's (the host
blocks only with ``TORCH_NCCL_BLOCKING_WAIT``), so by itself a wait or a :meth:`barrier` could
return before the peers arrived. :class:`NCCLWork` therefore polls ``is_completed()`` until the
collective is done or the deadline (the wait's timeout, at most the communicator's) passes, then
calls torch's ``wait()`` for the stream ordering and the error, if any. The result can then be
read by the current stream.

After a timeout: a started NCCL kernel cannot be cancelled, and one waiting for a dead peer never
returns, so the process group is aborted (``ProcessGroupNCCL.abort()``) and the wait raises
:class:`~gradcomm.CollectiveTimeoutError`. The communicator is then unusable for good: every later
collective raises RuntimeError (naming the timed-out one), :meth:`close` releases nothing more and
succeeds, and a new communicator (a new rendezvous on every rank) is the only way on.
"""

from __future__ import annotations

import datetime
import logging
import threading
import time
from collections.abc import Callable

import torch
import torch.distributed as dist

from ..communicator import P2PKind, Transfer
from ..errors import BackendUnavailableError
from ..launch.launcher import LaunchInfo
from ..types import ReduceOp, Support, SupportLevel
from ..work import DescriptionLike, Work
from .torch_dist import TorchDistCommunicator, TorchWork

log = logging.getLogger("gradcomm.comm.nccl")

__all__ = [
    "NCCL_DTYPES",
    "NCCL_REDUCE_OPS",
    "NCCLCommunicator",
    "NCCLWork",
    "nccl_support",
    "nccl_unavailable",
    "poll_until_done",
    "post_in_pair_order",
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


def post_in_pair_order(rank: int, ops: list[Transfer],
                       post: Callable[[Transfer], Work]) -> list[Work]:
    """``post`` each of ``ops`` in an order where transfers that block until matched cannot
    deadlock; return the works in the order of ``ops``.

    Per peer, the lower rank of the pair posts its sends before its receives and the higher rank
    its receives before its sends; sends keep their order among sends, receives among receives
    (so tags still match in order). Used where each transfer occupies one stream per pair of
    ranks (NCCL without a group call).
    """
    def key(item: tuple[int, Transfer]) -> tuple[int, int, int]:
        index, p = item
        first = P2PKind.SEND if rank < p.peer else P2PKind.RECV
        return (p.peer, 0 if p.kind is first else 1, index)

    works: list[Work | None] = [None] * len(ops)
    for index, p in sorted(enumerate(ops), key=key):
        works[index] = post(p)
    return [w for w in works if w is not None]


#: Polling interval bounds of the NCCL-family waits, seconds (doubling from first to second).
POLL_MIN_S = 20e-6
POLL_MAX_S = 1e-3


def poll_until_done(done: Callable[[], bool], timeout: float | None,
                    expire: Callable[[], None], what: str) -> None:
    """Call ``done()`` until it returns True, sleeping between calls (20 us doubling to 1 ms).

    A GPU collective finishes on the device, so the host can only ask. After ``timeout`` seconds
    (None: never) ``expire()`` is called once and :class:`TimeoutError` (``what``) is raised.
    """
    deadline = None if timeout is None else time.monotonic() + timeout
    delay = POLL_MIN_S
    while not done():
        if deadline is not None and time.monotonic() >= deadline:
            expire()
            raise TimeoutError(what)
        time.sleep(delay)
        delay = min(2 * delay, POLL_MAX_S)


class NCCLWork(TorchWork):
    """A ``WorkNCCL`` whose :meth:`wait` blocks the host until done, within the timeout.

    Args:
        work: torch's Work of the collective. description, timeout: as :class:`TorchWork`.
        on_timeout: called once when a wait times out, before it raises (aborts the group).
    """

    def __init__(self, work: dist.Work, description: DescriptionLike, timeout: float | None,
                 on_timeout: Callable[[], None],
                 aborted: threading.Event | None = None) -> None:
        super().__init__(work, description, timeout, aborted)
        self._on_nccl_timeout = on_timeout
        self._timed_out = False

    def _wait(self, timeout: float | None) -> None:
        if self._timed_out:
            raise RuntimeError(f"{self.description}: the NCCL process group was aborted")
        poll_until_done(self._finished_or_aborted, timeout, self._expire,
                        f"{self.description}: NCCL collective still running")
        self._wait_once(None)  # done: the current stream waits for NCCL's; an error is raised

    def _finished_or_aborted(self) -> bool:
        self._check_aborted()  # NCCLCommunicator.abort() from another thread
        return bool(self._work.is_completed())

    def _expire(self) -> None:
        self._timed_out = True
        self._on_nccl_timeout()

    def _test(self) -> bool:
        if self._timed_out:
            raise RuntimeError(f"{self.description} timed out and the NCCL process group was "
                               "aborted; make a new communicator")
        return super()._test()


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
    exact_device = True
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

    @property
    def aborted(self) -> bool:
        """True once the NCCL process group was aborted (a collective timed out, or
        :meth:`abort`)."""
        return self._aborted

    _aborted = False

    def _wrap(self, work: dist.Work | None, description: DescriptionLike) -> Work:
        if work is None:  # pragma: no cover - async_op=True always returns a Work
            raise RuntimeError(f"{description}: torch.distributed returned no Work")
        return NCCLWork(work, description, self._timeout, self._abort, self._abort_flag)

    def abort(self) -> None:
        """End this communicator at once, from any thread: NCCL's kernels are aborted
        (``ProcessGroupNCCL.abort()``), a wait in progress raises RuntimeError at its next poll,
        and so does every later collective (see :meth:`Communicator.abort`)."""
        super().abort()
        self._abort(timed_out=False)

    def _abort(self, timed_out: bool = True) -> None:
        group, self._group = self._group, None
        self._aborted = True
        if group is not None:
            if timed_out:
                log.error("nccl rank %d: a collective timed out; aborting the NCCL process group",
                          self.rank)
            group.abort()  # ProcessGroupNCCL.abort(): public

    def _pg(self) -> dist.ProcessGroup:
        if self._aborted:
            raise RuntimeError("nccl communicator was aborted after a timed-out collective; "
                               "make a new one")
        return super()._pg()

    def _supports(self, dtype: torch.dtype, device: torch.device | str | None) -> Support:
        dev = self.device if device is None else torch.device(device)
        return nccl_support(dtype, dev, self.backend)

    def _post_batch(self, prepared: list[Transfer]) -> list[Work]:
        # NCCL's send and recv each block their stream until matched, and the two ranks of a pair
        # share one stream: a ring posted send-first on every rank would deadlock, so the lower
        # rank of each pair sends first. torch's own batching API needs a registered group.
        return post_in_pair_order(self.rank, prepared, lambda p: self._post_transfer(p, True))



"""The cupy-nccl backend: NCCL through CuPy's communicator, bootstrapped over MPI.

NCCL needs one 128-byte unique id, made by rank 0 and known to every rank, before the
communicator exists. Here it travels over MPI (mpi4py's ``bcast``) when the job was started by
``mpirun``/``mpiexec``, so such a job needs no ``MASTER_ADDR``/``MASTER_PORT`` and no torch
store; otherwise (torchrun, explicit ranks) over the store of
:func:`gradcomm.comm.launch.rendezvous.create_store`. MPI carries only the id: the data moves
by NCCL.

Capability table: the nccl backend's (:mod:`gradcomm.comm.backends.nccl`): float16, bfloat16,
float32, float64, int8, uint8, int32, int64 native on CUDA; SUM, AVG (``ncclAvg``), MIN, MAX,
PRODUCT native. With NCCL older than 2.10 (no ``ncclAvg``, no bfloat16) AVG takes the base
class's emulation, as on every backend without a native average: floating-point only (an integer
tensor raises TypeError before any collective), float16 summed in float32 and rounded once.
Broadcast and all_gather move raw bytes, so they take any dtype.

Streams, as ``ProcessGroupNCCL`` orders them: every communicator has a CUDA stream of its own
(the side stream), so NCCL runs while the compute stream goes on with backward. At launch the side
stream waits for the current stream (NCCL reads what the kernels before it wrote), the collective
is enqueued on the side stream, every tensor it reads or writes is marked with
``Tensor.record_stream(side)`` (the caching allocator then does not hand its memory to another
tensor until the side stream is past it, even if the caller frees it), and a CUDA event is
recorded on the side stream. The :class:`~gradcomm.comm.Work` is that event: ``is_completed()``
asks it, ``wait()`` polls it (and NCCL's asynchronous error state) until done or until the
timeout, then makes the current stream wait for it, so later kernels read the result. After a
timeout the NCCL communicator is aborted (a kernel waiting for a dead peer never returns) and the
communicator cannot be used again: every later collective raises RuntimeError.

Torch tensors go to NCCL by pointer (``tensor.data_ptr()``): zero-copy. CuPy arrays are reduced by
viewing them as torch tensors, also zero-copy and stream-safe through DLPack::

    x = cupy.arange(4, dtype=cupy.float32)
    comm.all_reduce(torch.from_dlpack(x))     # x now holds the sum over ranks

(:func:`as_tensor` does the same and checks the argument.) One rank per GPU: NCCL refuses two
ranks of one communicator on the same GPU ("Duplicate GPU detected").
"""

from __future__ import annotations

import functools
import importlib.util
import logging
import pickle
from collections.abc import Callable
from typing import Any

import torch

from ..communicator import Communicator, SplitPlan, Transfer
from ..errors import BackendUnavailableError
from ..launch.launcher import Launcher, LaunchInfo
from ..launch.rendezvous import create_store
from ..types import ReduceOp, Support, SupportLevel
from ..work import DescriptionLike, Work
from .cuda_event import CudaEventWork
from .cuda_packages import cupy_pip, nccl_pip
from .nccl import (
    NCCL_REDUCE_OPS,
    nccl_support,
    resolve_cuda_device,
)

__all__ = ["CudaEventWork", "CupyNCCLCommunicator", "as_tensor", "cupy_nccl_unavailable"]

log = logging.getLogger("gradcomm.comm.cupy_nccl")

# nccl.h values, stable across NCCL 2.x (CuPy does not export every one in every version).
_NCCL_AVG = 4  # ncclAvg, NCCL >= 2.10
_NCCL_BFLOAT16 = 9  # ncclBfloat16, NCCL >= 2.10
_NCCL_2_10 = 21000  # ncclGetVersion() code of 2.10.0
_UID_BYTES = 128  # NCCL_UNIQUE_ID_BYTES; CuPy gives the id as a tuple of 128 signed chars


def cupy_nccl_unavailable() -> Exception | None:
    """Why the cupy-nccl backend cannot run here, or None; imports cupy only when CUDA is there.

    Returns:
        ImportError naming the pip command of
        :func:`~gradcomm.comm.backends.cuda_packages.cupy_pip` (the CuPy of torch's CUDA major)
        when cupy is missing;
        BackendUnavailableError when there is no CUDA device or CuPy finds no NCCL library.
    """
    if importlib.util.find_spec("cupy") is None:
        extra = "" if torch.cuda.is_available() else " (it also needs a CUDA device; none here)"
        return ImportError(f"the cupy-nccl backend needs the cupy package: {cupy_pip()}{extra}")
    if not torch.cuda.is_available():
        return BackendUnavailableError(
            "cupy-nccl backend needs a CUDA device: torch.cuda.is_available() is False"
        )
    try:
        from cupy.cuda import nccl  # type: ignore[import-not-found, unused-ignore]
    except ImportError as exc:
        return BackendUnavailableError(
            f"CuPy cannot load NCCL ({exc}): {nccl_pip()}"
        )
    if not getattr(nccl, "available", False):
        return BackendUnavailableError(
            f"CuPy found no NCCL library (cupy.cuda.nccl.available is False): {nccl_pip()}"
        )
    return None


def as_tensor(array: Any) -> torch.Tensor:
    """A torch view of a CuPy array (zero-copy, through DLPack), for the collectives.

    DLPack's stream handshake makes torch's current stream wait for CuPy's, so the array's pending
    writes land before NCCL reads it. Writes into the view are writes into ``array``.

    Raises:
        TypeError: ``array`` does not support DLPack (``__dlpack__``).
    """
    if not hasattr(array, "__dlpack__"):
        raise TypeError(f"expected a CuPy array (with __dlpack__), got {type(array).__name__}")
    return torch.from_dlpack(array)


class CupyNCCLCommunicator(Communicator):
    """Collectives on CUDA tensors through ``cupy.cuda.nccl.NcclCommunicator``.

    Args:
        launch: rank, world size and local rank (see :func:`gradcomm.comm.detect_launch`).
        timeout: seconds per collective (and for a store rendezvous); ``None``: forever.
        device: ``cuda:<i>``; default ``cuda:<local_rank>``.

    The NCCL communicator is created at every world size (a 1-rank NCCL communicator is valid),
    although the base class issues no collective at world_size 1.

    Raises:
        ImportError: cupy missing (the message names the CuPy of torch's CUDA major).
        BackendUnavailableError: no CUDA device, no NCCL for CuPy, or more ranks than GPUs on
            this host.
        ValueError: ``device`` is not a CUDA device of this host.
        RuntimeError: the unique-id exchange failed (MPI, or store timeout).
    """

    backend = "cupy-nccl"
    exact_device = True
    native_reduce_ops = NCCL_REDUCE_OPS  # without AVG on NCCL < 2.10 (set per instance)

    def __init__(
        self,
        launch: LaunchInfo,
        *,
        timeout: float | None = 300.0,
        device: torch.device | str | None = None,
    ) -> None:
        problem = cupy_nccl_unavailable()
        if problem is not None:
            raise problem
        from cupy.cuda import nccl  # type: ignore[import-not-found, unused-ignore]

        dev = resolve_cuda_device(launch, device, self.backend)
        super().__init__(
            rank=launch.rank,
            world_size=launch.world_size,
            local_rank=launch.local_rank,
            device=dev,
            timeout=timeout,
        )
        self.launch = launch
        self._store: Any = None
        torch.cuda.set_device(dev)
        self._nccl_mod = nccl
        self.nccl_version = int(nccl.get_version())
        self._dtypes = self._dtype_table(nccl)
        self._ops = {
            ReduceOp.SUM: nccl.NCCL_SUM,
            ReduceOp.PRODUCT: nccl.NCCL_PROD,
            ReduceOp.MAX: nccl.NCCL_MAX,
            ReduceOp.MIN: nccl.NCCL_MIN,
        }
        if self.nccl_version >= _NCCL_2_10:
            self._ops[ReduceOp.AVG] = getattr(nccl, "NCCL_AVG", _NCCL_AVG)
        else:  # no ncclAvg: the base class's AVG (floats only; 16-bit summed in float32)
            self.native_reduce_ops = NCCL_REDUCE_OPS - {ReduceOp.AVG}  # type: ignore[misc]
        # The side stream NCCL runs on (see the module docstring).
        self._stream = torch.cuda.Stream(dev)
        uid = self._exchange_unique_id(launch, timeout)
        self._connect(launch, uid)
        log.debug("cupy-nccl rank %d/%d on %s, NCCL %d", self.rank, self.world_size, dev,
                  self.nccl_version)

    # ------------------------------------------------------------------ set-up
    #: Events of a batch of transfers inside ``nccl.groupStart()``, recorded after groupEnd
    #: (NCCL enqueues the group's kernels only then); None outside a batch.
    _batch: list[Any] | None = None

    def _connect(self, launch: LaunchInfo, uid: Any) -> None:
        import cupy  # type: ignore[import-not-found, unused-ignore]

        with cupy.cuda.Device(self.device.index):
            self._comm: Any = self._nccl_mod.NcclCommunicator(launch.world_size, uid,
                                                              launch.rank)

    def _dtype_table(self, nccl: Any) -> dict[torch.dtype, int]:
        table = {
            torch.int8: nccl.NCCL_INT8,
            torch.uint8: nccl.NCCL_UINT8,
            torch.int32: nccl.NCCL_INT32,
            torch.int64: nccl.NCCL_INT64,
            torch.float16: nccl.NCCL_FLOAT16,
            torch.float32: nccl.NCCL_FLOAT32,
            torch.float64: nccl.NCCL_FLOAT64,
        }
        if self.nccl_version >= _NCCL_2_10:
            table[torch.bfloat16] = getattr(nccl, "NCCL_BFLOAT16", _NCCL_BFLOAT16)
        return table

    def _exchange_unique_id(self, launch: LaunchInfo, timeout: float | None) -> Any:
        """Rank 0's ``nccl.get_unique_id()`` on every rank: over ``launch.store`` when given,
        else over MPI under an MPI launcher, else over the rendezvous store."""
        nccl = self._nccl_mod
        over_mpi = launch.launcher.is_mpi and importlib.util.find_spec("mpi4py") is not None
        store = launch.store
        if store is None and over_mpi:
            from mpi4py import MPI

            comm = MPI.COMM_WORLD
            if comm.Get_size() != launch.world_size or comm.Get_rank() != launch.rank:
                raise RuntimeError(
                    f"MPI says rank {comm.Get_rank()} of {comm.Get_size()}, the launcher's "
                    f"environment says {launch.rank} of {launch.world_size}"
                )
            uid, error = None, None
            if launch.rank == 0:
                try:
                    uid = nccl.get_unique_id()
                except Exception as exc:  # noqa: BLE001 - every rank must learn of the failure
                    error = f"rank 0 could not make an NCCL unique id: {exc}"
            uid, error = comm.bcast((uid, error), root=0)
            if error is not None:
                raise RuntimeError(error)
            return uid
        if launch.world_size == 1:
            return nccl.get_unique_id()
        # Kept until close: when rank 0's store (the server) is freed, the others cannot read.
        if store is None:
            store = create_store(launch, timeout, self.backend)
        self._store = store
        if launch.rank == 0:
            uid_bytes = pickle.dumps(nccl.get_unique_id())
            store.set("nccl_unique_id", uid_bytes)  # bytes work
        # The store is this job's own (same trust as mpi4py's pickled bcast).
        return pickle.loads(store.get("nccl_unique_id"))

    # ------------------------------------------------------------------ capability
    @property
    def background_progress(self) -> bool:
        """True: NCCL kernels run on their own CUDA stream while backward computes."""
        return True

    def _supports(self, dtype: torch.dtype, device: torch.device | str | None) -> Support:
        dev = self.device if device is None else torch.device(device)
        support = nccl_support(dtype, dev, self.backend)
        if support.is_supported and dtype not in self._dtypes:  # bfloat16 before NCCL 2.10
            return Support(
                SupportLevel.UNSUPPORTED, f"NCCL {self.nccl_version} cannot reduce {dtype}"
            )
        return support


    # ------------------------------------------------------------------ collectives
    def _all_reduce(self, tensor: torch.Tensor, op: ReduceOp, description: DescriptionLike) -> Work:
        ptr, count = tensor.data_ptr(), tensor.numel()
        dtype, nccl_op = self._dtypes[tensor.dtype], self._ops[op]
        return self._launch(
            (tensor,), lambda comm, s: comm.allReduce(ptr, ptr, count, dtype, nccl_op, s),
            description,
        )

    def _broadcast(self, tensor: torch.Tensor, src: int, description: DescriptionLike) -> Work:
        ptr, nbytes = tensor.data_ptr(), tensor.numel() * tensor.element_size()
        uint8 = self._nccl_mod.NCCL_UINT8
        return self._launch(
            (tensor,), lambda comm, s: comm.broadcast(ptr, ptr, nbytes, uint8, src, s),
            description,
        )

    def _all_gather(
        self, output: torch.Tensor, input: torch.Tensor, description: DescriptionLike
    ) -> Work:
        send, recv = input.data_ptr(), output.data_ptr()
        nbytes = input.numel() * input.element_size()
        uint8 = self._nccl_mod.NCCL_UINT8
        return self._launch(
            (input, output), lambda comm, s: comm.allGather(send, recv, nbytes, uint8, s),
            description,
        )

    # Beyond all-reduce, broadcast and all-gather: one NCCL call each, or one NCCL group of
    # sends and receives where NCCL has no call of its own (all-to-all, gather, scatter), as
    # NCCL's documentation and torch's ProcessGroupNCCL build them.
    def _reduce_scatter(self, output: torch.Tensor, input: torch.Tensor, op: ReduceOp,
                        description: DescriptionLike) -> Work:
        send, recv, count = input.data_ptr(), output.data_ptr(), output.numel()
        dtype, nccl_op = self._dtypes[output.dtype], self._ops[op]
        return self._launch(
            (input, output),
            lambda comm, s: comm.reduceScatter(send, recv, count, dtype, nccl_op, s),
            description,
        )

    def _all_to_all(self, output: torch.Tensor, input: torch.Tensor, output_counts: list[int],
                    input_counts: list[int], description: DescriptionLike) -> Work:
        # NCCL has no all-to-all call: one send and one receive per peer inside a group call is
        # how NCCL's own documentation (and ProcessGroupNCCL) builds it.
        size = input.element_size()
        return self._exchange_bytes(output, input, [c * size for c in output_counts],
                                    [c * size for c in input_counts], description)

    def _reduce(self, tensor: torch.Tensor, dst: int, op: ReduceOp,
                description: DescriptionLike) -> Work:
        ptr, count = tensor.data_ptr(), tensor.numel()
        dtype, nccl_op = self._dtypes[tensor.dtype], self._ops[op]
        return self._launch(
            (tensor,), lambda comm, s: comm.reduce(ptr, ptr, count, dtype, nccl_op, dst, s),
            description,
        )

    def _gather(self, output: torch.Tensor | None, input: torch.Tensor, dst: int,
                description: DescriptionLike) -> Work:
        # NCCL has no gather: sends to the root and, on it, one receive per rank, in a group.
        n = input.numel() * input.element_size()
        counts = [n if output is not None else 0] * self.world_size
        sends = [n if peer == dst else 0 for peer in range(self.world_size)]
        return self._exchange_bytes(output, input, counts, sends, description)

    def _scatter(self, output: torch.Tensor, input: torch.Tensor | None, src: int,
                 description: DescriptionLike) -> Work:
        n = output.numel() * output.element_size()
        sends = [n if input is not None else 0] * self.world_size
        counts = [n if peer == src else 0 for peer in range(self.world_size)]
        return self._exchange_bytes(output, input, counts, sends, description)

    def _exchange_bytes(self, output: torch.Tensor | None, input: torch.Tensor | None,
                        recv_bytes: list[int], send_bytes: list[int],
                        description: DescriptionLike) -> Work:
        """One group of sends and receives: ``send_bytes[p]`` bytes of ``input`` (consecutive,
        rank order) to each peer ``p``, ``recv_bytes[p]`` into ``output`` from each."""
        nccl, uint8 = self._nccl_mod, self._nccl_mod.NCCL_UINT8
        send = 0 if input is None else input.data_ptr()
        recv = 0 if output is None else output.data_ptr()

        def call(comm: Any, stream: int) -> None:
            nccl.groupStart()
            try:
                at_send = at_recv = 0
                for peer, (n_send, n_recv) in enumerate(zip(send_bytes, recv_bytes,
                                                            strict=True)):
                    if n_send:
                        comm.send(send + at_send, n_send, uint8, peer, stream)
                    if n_recv:
                        comm.recv(recv + at_recv, n_recv, uint8, peer, stream)
                    at_send += n_send
                    at_recv += n_recv
            finally:
                nccl.groupEnd()

        tensors = tuple(t for t in (input, output) if t is not None)
        return self._launch(tensors, call, description)

    def _send(self, tensor: torch.Tensor, dst: int, tag: int, description: DescriptionLike) -> Work:
        ptr, nbytes = tensor.data_ptr(), tensor.numel() * tensor.element_size()
        uint8 = self._nccl_mod.NCCL_UINT8  # NCCL has no tags: transfers match in order
        return self._launch((tensor,), lambda comm, s: comm.send(ptr, nbytes, uint8, dst, s),
                            description)

    def _recv(self, tensor: torch.Tensor, src: int, tag: int, description: DescriptionLike) -> Work:
        ptr, nbytes = tensor.data_ptr(), tensor.numel() * tensor.element_size()
        uint8 = self._nccl_mod.NCCL_UINT8
        return self._launch((tensor,), lambda comm, s: comm.recv(ptr, nbytes, uint8, src, s),
                            description)

    def _post_batch(self, prepared: list[Transfer]) -> list[Work]:
        # One NCCL group: its sends and receives progress together (no order can deadlock).
        nccl = self._nccl_mod
        self._batch = []
        nccl.groupStart()
        try:
            works = [self._post_transfer(p, True) for p in prepared]
        finally:
            nccl.groupEnd()
            events, self._batch = self._batch, None
            for event in events:
                event.record(self._stream)
        return works

    def _split_child(self, plan: SplitPlan) -> CupyNCCLCommunicator | None:
        """A new NCCL communicator per color: each group's first member makes the unique id,
        and every rank of this communicator gathers all of them (a collective here)."""
        nccl = self._nccl_mod
        if self.world_size == 1:  # nobody to tell
            uid = nccl.get_unique_id() if plan.color is not None else None
        else:
            mine = torch.zeros(_UID_BYTES, dtype=torch.int16, device=self.device)
            if plan.color is not None and plan.rank == 0:
                mine.copy_(torch.tensor(nccl.get_unique_id(), dtype=torch.int16))
            ids = torch.empty(self.world_size * _UID_BYTES, dtype=torch.int16, device=self.device)
            self.all_gather(ids, mine)
            first = plan.members[0] if plan.members else 0
            uid = tuple(ids[first * _UID_BYTES:(first + 1) * _UID_BYTES].tolist())
        if plan.color is None:
            return None
        launch = LaunchInfo(plan.rank, len(plan.members), plan.local_rank,
                            plan.local_world_size, Launcher.EXPLICIT)
        child = object.__new__(type(self))  # this backend's state, a new NCCL communicator
        Communicator.__init__(child, rank=plan.rank, world_size=len(plan.members),
                              local_rank=plan.local_rank, device=self.device,
                              timeout=self._timeout)
        child.launch, child._store, child._nccl_mod = launch, None, nccl
        child.nccl_version, child._dtypes, child._ops = self.nccl_version, self._dtypes, self._ops
        child.native_reduce_ops = self.native_reduce_ops  # type: ignore[misc]
        child._stream = torch.cuda.Stream(self.device)
        child._connect(launch, uid)
        return child

    def _barrier(self, description: DescriptionLike) -> Work:
        # An all-reduce of one element (record_stream keeps it alive until the side stream is done)
        return self._all_reduce(torch.zeros(1, device=self.device), ReduceOp.SUM, description)

    def _launch(
        self,
        tensors: tuple[torch.Tensor, ...],
        call: Callable[[Any, int], None],
        description: DescriptionLike,
    ) -> Work:
        """Enqueue ``call(nccl_comm, side_stream_handle)`` on the side stream, ordered after the
        current stream's work on ``tensors``; return a Work on an event recorded after it."""
        comm = self._live()
        side = self._stream
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.device(self.device):
            call(comm, side.cuda_stream)
        for t in tensors:
            t.record_stream(side)
        event = torch.cuda.Event()
        if self._batch is None:
            event.record(side)
        else:  # inside a group: recorded once NCCL has enqueued it (see _post_batch)
            self._batch.append(event)
        return CudaEventWork(event, description, self._timeout, self._check_async, self._abort,
                             on_complete=functools.partial(self._join, event))

    def _join(self, event: Any) -> None:
        """Make the current stream (the waiter's) wait for ``event``: the result is read there."""
        torch.cuda.current_stream(self.device).wait_event(event)

    def _close(self) -> None:
        self._store = None
        comm, self._comm = self._comm, None
        if comm is not None:
            self._stream.synchronize()  # NCCL's work is on the side stream
            comm.destroy()

    # ------------------------------------------------------------------ helpers
    def _live(self) -> Any:
        if self._comm is None:
            if self._user_aborted:
                raise RuntimeError("cupy-nccl communicator was aborted")
            raise RuntimeError("cupy-nccl communicator was aborted after a timed-out collective")
        return self._comm

    def _check_async(self) -> None:
        comm = self._comm
        if comm is not None:
            comm.check_async_error()  # raises cupy's NcclError (a RuntimeError)
        elif self._user_aborted:  # abort() from another thread: end the waits polling here
            raise RuntimeError("cupy-nccl communicator was aborted")

    _user_aborted = False

    def abort(self) -> None:
        """End this communicator at once, from any thread: NCCL is aborted
        (``ncclCommAbort``), a wait in progress raises RuntimeError at its next poll, and so
        does every later collective (see :meth:`Communicator.abort`)."""
        self._user_aborted = True
        self._abort(timed_out=False)

    def _abort(self, timed_out: bool = True) -> None:
        comm, self._comm = self._comm, None
        if comm is not None:
            if timed_out:
                log.error("cupy-nccl rank %d: a collective timed out; aborting NCCL", self.rank)
            comm.abort()

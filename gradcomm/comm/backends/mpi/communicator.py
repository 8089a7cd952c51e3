"""The MPI backend: collectives over mpi4py on a duplicate of ``MPI.COMM_WORLD``.

CPU tensors are handed to MPI without a copy (``MPI.buffer.fromaddress`` views of their memory,
``MPI.IN_PLACE`` for all-reduce); MPI datatypes come from
:func:`mpi4py.util.dtlib.from_numpy_dtype` (decoded to the predefined type, which MPI's reduction
ops need). Every collective is non-blocking (``Iallreduce``, ``Ibcast``, ``Iallgather``,
``Ibarrier``) and returns an :class:`MPIWork`.

Capability table (in the manner of ChainerMN's communicator factory):

==============================  =============  ===============================================
dtype / device                  support        note
==============================  =============  ===============================================
float32, float64 (cpu)          native         MPI_FLOAT / MPI_DOUBLE, reduced by MPI
int8, uint8, int16, int32,      native         ``ReduceOp.AVG`` raises TypeError (integers)
int64 (cpu)
bool (cpu)                      native         SUM and MAX are logical or, PRODUCT and MIN
                                               logical and (MPI_C_BOOL with LOR / LAND)
float16, bfloat16 (cpu)         emulated-slow  MPI has no bfloat16 and MPICH's float16 SUM is
                                               slow (much slower than float32). With 2
                                               ranks, and for MIN/MAX at any size: a
                                               user-defined MPI op adds the 16-bit data with
                                               torch (one rounding per element, so the result
                                               equals the float32 reference rounded back).
                                               With 3+ ranks SUM/PRODUCT upcast to a float32
                                               scratch buffer, reduce, round back once
                                               (``transfer_dtype`` float32). SlowPathWarning
                                               from the gradient manager.
ReduceOp.AVG                    emulated       MPI has no average: SUM, then divide (in the
                                               tensor's dtype, by the base class)
any dtype, broadcast and        native         moved as raw bytes (``MPI.BYTE``)
all_gather
CUDA tensors (``device=cuda``)  as above       CuPy views when MPI is CUDA-aware; otherwise
                                               staged through pinned host memory, reported as
                                               emulated-slow (``GRADCOMM_MPI_CUDA_AWARE=0|1``
                                               overrides detection); fp16/bf16 always upcast
complex64, complex128           via real view  the base class reduces ``view_as_real`` (SUM/AVG)
other dtypes (float8, ...)      unsupported    all_reduce raises TypeError
==============================  =============  ===============================================

Progress: see :mod:`gradcomm.comm.backends.mpi.work` (waiting polls MPI, which advances a
non-blocking collective only inside calls into it).

Failure behaviour: a collective that does not complete within the communicator's timeout (or the
timeout given to ``wait``) raises :class:`~gradcomm.CollectiveTimeoutError`; MPI cannot cancel a
started collective, so every later collective on the communicator raises RuntimeError for as long
as that one is still pending (a late peer that catches up makes it usable again; see
:class:`~gradcomm.comm.Communicator`). A :class:`MPIWork` dropped before completion is kept by
the communicator until MPI is done with its buffers (its copy-back and averaging still run then,
at a later collective; an error they raise is logged as a warning on ``gradcomm.comm.mpi`` and
kept for that work's ``wait()``, not raised by the later collective, which would leave this rank
out of step with the others). Under ``mpiexec`` with more than one rank, creating a communicator
installs (once per process, chaining the previous hook) a :data:`sys.excepthook` that prints the
traceback and calls ``MPI.COMM_WORLD.Abort(1)`` -- what ``python -m mpi4py`` does -- so an
uncaught error on one rank ends the whole job instead of leaving the other ranks spinning in a
collective. Set ``GRADCOMM_MPI_ABORT_ON_ERROR=0`` to opt out.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from mpi4py import MPI

from ..._mpi_abort import abort_on_error_enabled, install_abort_hook
from ...communicator import Communicator, flat_bytes
from ...errors import BackendUnavailableError
from ...launcher import Launcher, LaunchInfo, check_launch_matches_mpi, cpus_per_local_process
from ...types import ReduceOp, Support
from ...work import DescriptionLike, Work
from . import compiled
from .compiled_calls import CompiledCalls
from .dtypes import HALF, MPI_BUFFER, SUM_FAST, mpi_op, predefined_datatype
from .groups import MPIGroupOps
from .ops16 import half_op, uses_user_op
from .scratch import ScratchPool
from .shard import MPIShardOps
from .support import classify
from .work import MPIWork

if TYPE_CHECKING:  # pragma: no cover
    from mpi4py import MPI as MPIModule

__all__ = ["MPICommunicator"]

logger = logging.getLogger("gradcomm.comm.mpi")


class MPICommunicator(CompiledCalls, MPIShardOps, MPIGroupOps, Communicator):
    """Collectives through mpi4py on a private duplicate of ``MPI.COMM_WORLD``.

    Args:
        launch: rank and world size from the launcher's environment. MPI's own rank and size
            must agree; when the environment says a single process but MPI reports more (a
            launcher gradcomm does not recognise), MPI's rank, size and node-local rank are used.
        timeout: seconds each collective may take before :class:`~gradcomm.CollectiveTimeoutError`
            (``None``: forever).
        device: ``None`` or cpu for CPU tensors; a CUDA device for GPU tensors (CuPy views when MPI
            is CUDA-aware, else staged through pinned host memory; see
            :mod:`gradcomm.comm.backends.mpi_device`). ``cuda`` without an index means
            ``cuda:<local_rank mod device count>``.

    Raises:
        RuntimeError: MPI's rank/size disagree with ``launch``; CUDA with an MPI thread level
            below ``MPI_THREAD_SERIALIZED``.
        BackendUnavailableError: ``device`` is CUDA but no CUDA device is available.
        ValueError: ``device`` is neither cpu nor cuda, or timeout is not positive.

    The duplicate communicator isolates gradcomm's traffic from the user's own MPI calls; it is
    freed by :meth:`close`. With more than one rank, :func:`install_abort_hook` is called unless
    ``GRADCOMM_MPI_ABORT_ON_ERROR=0``.
    """

    backend = "mpi"
    native_reduce_ops = frozenset({ReduceOp.SUM, ReduceOp.MIN, ReduceOp.MAX, ReduceOp.PRODUCT})
    _comm: MPIModule.Intracomm | None
    _adapter: Any

    def __init__(
        self,
        launch: LaunchInfo,
        *,
        timeout: float | None = 300.0,
        device: torch.device | str | None = None,
    ) -> None:
        dev = torch.device("cpu") if device is None else torch.device(device)
        if dev.type not in ("cpu", "cuda"):
            raise ValueError(f"the mpi backend works on cpu or cuda tensors, not {dev}")
        if dev.type == "cuda" and not torch.cuda.is_available():
            raise BackendUnavailableError(
                "the mpi backend was asked for CUDA tensors, but torch.cuda.is_available() is False"
            )
        abort_on_error = abort_on_error_enabled()  # a bad value raises before any collective
        world = MPI.COMM_WORLD
        mpi_size = world.Get_size()
        if launch.launcher is Launcher.SINGLE and mpi_size > 1:
            launch = self._launch_from_mpi(world)
        else:
            check_launch_matches_mpi(world, launch)
        index: int | None = dev.index
        if dev.type == "cuda" and index is None:
            dev = torch.device("cuda", launch.local_rank % torch.cuda.device_count())
        super().__init__(rank=launch.rank, world_size=launch.world_size,
                         local_rank=launch.local_rank, device=dev, timeout=timeout)
        self._attach(launch, world.Dup())
        if dev.type == "cuda":
            from .. import mpi_device  # lazy: needs cupy only on this branch

            mpi_device.check_thread_level(MPI)  # gradient hooks call MPI from autograd's threads
            torch.cuda.set_device(dev)  # this rank's GPU, not GPU 0, for contexts and copies
            self._cuda_aware, self._cuda_reason = mpi_device.cuda_aware_mpi()
            self._adapter = mpi_device.DeviceBufferAdapter(self._cuda_aware)
        if launch.world_size > 1 and abort_on_error:
            install_abort_hook()

    def _attach(self, launch: LaunchInfo, comm: MPIModule.Comm) -> None:
        """This communicator's state over ``comm`` (a duplicate of the world, or a split)."""
        self.launch = launch
        self._comm = comm  # type: ignore[assignment]  # Split's result: an Intracomm
        self._adapter = None
        # Works whose requests have not completed, oldest first (see MPIWork).
        self._inflight: list[MPIWork] = []
        self._scratch = ScratchPool()
        self._datatypes: dict[torch.dtype, MPI.Datatype] = {}
        # The datatypes of SUM_FAST dtypes looked up so far (the gradient path of _all_reduce).
        self._sum_datatypes: dict[torch.dtype, MPI.Datatype] = {}
        self._support_cache: dict[tuple[torch.dtype, str], Support] = {}
        self._cuda_aware = False
        self._cuda_reason = ""
        self._compiled = compiled.calls(self, comm, launch.world_size, launch.rank,
                                        wanted=self._on_cpu)
        if self._compiled is not None:
            compiled.bind_batch(self)

    @staticmethod
    def _launch_from_mpi(world: MPIModule.Intracomm) -> LaunchInfo:
        node = world.Split_type(MPI.COMM_TYPE_SHARED)
        try:
            local_rank, local_size = node.Get_rank(), node.Get_size()
        finally:
            node.Free()
        return LaunchInfo(
            world.Get_rank(), world.Get_size(), local_rank, local_size, Launcher.EXPLICIT
        )

    @property
    def mpi_comm(self) -> MPIModule.Intracomm:
        """The private duplicate of ``MPI.COMM_WORLD`` (do not free it; :meth:`close` does)."""
        if self._comm is None:
            raise RuntimeError("mpi communicator is closed")
        return self._comm

    @property
    def cheap_collectives(self) -> bool:
        """True for host memory: MPI reduces it where it lies, and a small all-reduce is cheap.

        Device memory goes through CuPy views or host staging, where the copy is not saved.
        """
        return self._adapter is None

    @property
    def background_progress(self) -> bool:
        """True only with an asynchronous progress thread and >= 2 CPU cores per process.

        Without one, a non-blocking MPI collective advances only inside MPI calls (our polls), so
        overlapping it with backward cannot hide its time. The thread is MPICH's
        ``MPIR_CVAR_ASYNC_PROGRESS=1`` (alias ``MPICH_ASYNC_PROGRESS``) or Intel MPI's
        ``I_MPI_ASYNC_PROGRESS=1``, read from the environment; it needs a core of its own.
        """
        names = ("MPIR_CVAR_ASYNC_PROGRESS", "MPICH_ASYNC_PROGRESS", "I_MPI_ASYNC_PROGRESS")
        thread = any(os.environ.get(n, "").strip().lower() in ("1", "yes", "true", "on")
                     for n in names)
        return thread and cpus_per_local_process(self.launch.local_world_size) >= 2

    @property
    def cuda_aware(self) -> bool:
        """True when CUDA buffers go to MPI directly (only meaningful with a CUDA device)."""
        return self._cuda_aware

    # ------------------------------------------------------------------ capability
    def _supports(self, dtype: torch.dtype, device: torch.device | str | None) -> Support:
        """How ``dtype`` on ``device`` (default: this communicator's) is all-reduced.

        Returns NATIVE for the dtypes MPI reduces itself, EMULATED_SLOW with ``transfer_dtype``
        float32 for float16/bfloat16 (upcast), EMULATED_SLOW for anything on CUDA when MPI is not
        CUDA-aware (host staging), and UNSUPPORTED for other dtypes or a device type this
        communicator was not built for.
        """
        dev_type = self.device.type if device is None else torch.device(device).type
        key = (dtype, dev_type)
        cached = self._support_cache.get(key)
        if cached is None:
            cached = self._support_cache[key] = classify(
                dtype, dev_type, self.device.type, self.world_size, self._cuda_aware,
                self._cuda_reason,
            )
        return cached

    # ------------------------------------------------------------------ collectives
    def _all_reduce(self, tensor: torch.Tensor, op: ReduceOp, description: DescriptionLike) -> Work:
        # The gradient path -- SUM of host memory of a dtype MPI reduces natively (not bool),
        # whose datatype an earlier call looked up, with nothing pending -- is posted in a few
        # steps: small all-reduces pay every nested call of the general path below.
        datatype = self._sum_datatypes.get(tensor.dtype)
        comm = self._comm
        if (datatype is not None and op is ReduceOp.SUM and comm is not None
                and not self._inflight and self._adapter is None):
            buf = MPI_BUFFER.fromaddress(tensor.data_ptr(), tensor.nbytes)
            request = comm.Iallreduce(MPI.IN_PLACE, [buf, datatype], MPI.SUM)
            request.Test()  # as below: a waiting peer gets this rank's data now
            return MPIWork(request, description, self._timeout,
                           (tensor, tensor.untyped_storage(), buf), self._inflight)
        return self._post_all_reduce(tensor, op, description)

    def _post_all_reduce(
        self, tensor: torch.Tensor, op: ReduceOp, description: DescriptionLike
    ) -> Work:
        """Every all-reduce outside the gradient path: 16-bit data, bool, other ops, device
        memory, or one issued while another is pending (which it drives first)."""
        comm = self._live_comm()
        dtype = tensor.dtype
        flat = tensor if tensor.dim() == 1 else tensor.view(-1)
        scratch: torch.Tensor | None = None
        if dtype in HALF and self._adapter is None and uses_user_op(op, self.world_size):
            wire = flat.view(torch.int16)
            reduce_op, datatype = half_op(dtype, op), MPI.INT16_T
        else:
            if dtype in HALF:
                scratch = self._scratch.take(flat.numel(), flat.device)
                wire = scratch[: flat.numel()]
                wire.copy_(flat)
            else:
                wire = flat
            reduce_op = mpi_op(op, wire.dtype)
            datatype = self._datatype(wire.dtype)
        buf, finish = self._prepare(wire)
        request = comm.Iallreduce(MPI.IN_PLACE, [buf, datatype], reduce_op)
        # One Test() at once: a peer already waiting gets this rank's first message now, not
        # after the Python that wraps the request (MPI advances only inside MPI calls).
        request.Test()
        work = self._work(request, description, (tensor, wire, wire.untyped_storage(), buf))
        if finish is not None:
            work.add_callback(finish)
        if scratch is not None:
            upcast, pool = wire, self._scratch

            def _round_back() -> None:
                flat.copy_(upcast)
                pool.give(scratch)

            work.add_callback(_round_back)
        return work

    def _broadcast(self, tensor: torch.Tensor, src: int, description: DescriptionLike) -> Work:
        return self._post(lambda comm, b: comm.Ibcast([b[0], MPI.BYTE], root=src),
                          description, (tensor, True, True))

    def _all_gather(
        self, output: torch.Tensor, input: torch.Tensor, description: DescriptionLike
    ) -> Work:
        return self._post(lambda comm, b: comm.Iallgather([b[0], MPI.BYTE], [b[1], MPI.BYTE]),
                          description, (input, True, False), (output, False, True))

    def _barrier(self, description: DescriptionLike) -> Work:
        return self._work(self._live_comm().Ibarrier(), description, ())

    def _close(self) -> None:
        comm, self._comm = self._comm, None
        self._compiled = None
        vars(self).pop("batch_isend_irecv", None)
        if comm is None or MPI.Is_finalized():
            return
        for work in list(self._inflight):
            work.is_completed()
        # A communicator with a collective still pending (a timed-out or dropped one, whose peer
        # may be dead) is left to MPI_Finalize: freeing it would wait for that collective.
        if not self._inflight:
            comm.Free()

    # ------------------------------------------------------------------ helpers
    def _live_comm(self) -> MPIModule.Intracomm:
        if self._inflight:
            self._drive_oldest()
        return self.mpi_comm

    def _drive_oldest(self) -> None:
        """Test the oldest pending work once: one whose Work was dropped then completes (its
        callbacks run) and leaves the list, freeing its buffers."""
        oldest = self._inflight[0]
        try:
            oldest.is_completed()
        except Exception as exc:
            if self._inflight and self._inflight[0] is oldest:
                raise  # still pending and its transport fails: nothing can be posted behind it
            # It completed wrongly (a receive of another size) or a completion step failed
            # (e.g. a copy-back into a tensor given other memory meanwhile). Raised here, before
            # this rank's next post, it would make this rank alone skip a collective the others
            # post; it stays on that Work, whose wait() raises it.
            what = ("its completion step failed" if oldest.callback_error is exc
                    else "it completed with an error")
            logger.warning("%s: %s (%s: %s); raised by its wait(), not by this call",
                           oldest.description, what, type(exc).__name__, exc)

    def _work(
        self,
        request: MPI.Request,
        description: DescriptionLike,
        keepalive: tuple[object, ...],
    ) -> Work:
        return MPIWork(request, description, self._timeout, keepalive, self._inflight)

    def _datatype(self, dtype: torch.dtype) -> MPI.Datatype:
        found = self._datatypes.get(dtype)
        if found is None:
            found = self._datatypes[dtype] = predefined_datatype(dtype)
            if dtype in SUM_FAST:
                self._sum_datatypes[dtype] = found
        return found

    def _wire(self, tensor: torch.Tensor) -> torch.Tensor:
        """What a byte transfer (``MPI.BYTE``) of the contiguous ``tensor`` hands to
        :meth:`_prepare`: on the host the tensor itself (its view spans its ``nbytes`` whatever
        the dtype, and a uint8 view would cost a new tensor per call); with a device adapter its
        uint8 view (:func:`flat_bytes`), which the adapter stages element by element."""
        return tensor if self._adapter is None else flat_bytes(tensor)

    def _prepare(
        self, wire: torch.Tensor, *, read: bool = True, write: bool = True
    ) -> tuple[object, Callable[[], None] | None]:
        """Return a buffer MPI can use for the contiguous 1-D ``wire``, and what to run after.

        CPU: a zero-copy view of its memory and no finishing step. CUDA: the device adapter's buffer
        (a CuPy view, or a pinned host copy whose ``finish`` copies the result back); ``read``
        False skips staging the current values in, ``write`` False skips copying results back.
        """
        # A CUDA communicator only ever sees CUDA tensors (_check_tensor), so "has an adapter"
        # means "device tensor"; tests give a CPU communicator a fake adapter to run this path.
        if self._adapter is None:
            # A raw view of the tensor's memory (the Work keeps the tensor alive): cheaper per call
            # than wire.numpy() (benchmarks/call_overhead.py).
            return MPI_BUFFER.fromaddress(wire.data_ptr(), wire.nbytes), None
        buf, finish = self._adapter.prepare(wire, read=read, write=write)
        return buf, finish

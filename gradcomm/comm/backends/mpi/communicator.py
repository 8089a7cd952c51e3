"""The MPI backend: collectives over mpi4py on a duplicate of ``MPI.COMM_WORLD``.

Every MPI call of a communicator runs on its progress thread (:mod:`.progress`), in posting
order: collectives as MPI's blocking calls (``MPI_Allreduce``, ``MPI_Bcast``,
``MPI_Reduce_scatter_block``, ...), transfers as ``MPI_Isend``/``MPI_Irecv``. The caller gets an
:class:`~gradcomm.comm.backends.mpi.progress.MPIWork` at once and waits on it without polling.
CPU tensors are handed to MPI without a copy (``MPI.buffer.fromaddress`` views of their memory,
``MPI.IN_PLACE`` for all-reduce); MPI datatypes come from
:func:`mpi4py.util.dtlib.from_numpy_dtype` (decoded to the predefined type, which MPI's reduction
ops need).

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
                                               slow. all_reduce with 2 ranks, and MIN/MAX at
                                               any size: a user-defined MPI op adds the 16-bit
                                               data with torch (one rounding per element, so
                                               the result equals the float32 reference
                                               rounded back). Otherwise (and for
                                               reduce_scatter and reduce): upcast to a float32
                                               scratch buffer, reduce, round back once
                                               (``transfer_dtype`` float32).
ReduceOp.AVG                    emulated       MPI has no average: SUM, then divide
any dtype, data movement        native         moved as raw bytes (``MPI.BYTE``)
CUDA tensors (``device=cuda``)  as above       CuPy views when MPI is CUDA-aware; otherwise
                                               staged through pinned host memory, reported as
                                               emulated-slow (``GRADCOMM_MPI_CUDA_AWARE=0|1``
                                               overrides detection); fp16/bf16 always upcast
complex64, complex128           via real view  the base class reduces ``view_as_real`` (SUM/AVG)
other dtypes (float8, ...)      unsupported    reductions raise TypeError
==============================  =============  ===============================================

Failure behaviour: a collective that does not complete within the communicator's timeout (or the
timeout given to ``wait``) raises :class:`~gradcomm.CollectiveTimeoutError`; MPI cannot cancel a
started collective, so every later collective on the communicator raises RuntimeError while that
one is pending (a late peer that catches up makes it usable again). Under ``mpiexec`` with more
than one rank, creating a communicator installs (once per process, chaining the previous hook) a
:data:`sys.excepthook` that prints the traceback and calls ``MPI.COMM_WORLD.Abort(1)`` -- what
``python -m mpi4py`` does -- so an uncaught error on one rank ends the whole job instead of
leaving the other ranks in a collective. Set ``GRADCOMM_MPI_ABORT_ON_ERROR=0`` to opt out.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

try:
    from mpi4py import MPI
except ImportError as _exc:  # pragma: no cover - exercised by a subprocess test
    raise ImportError(
        "the mpi backend needs the mpi4py package and an MPI library: pip install mpi4py mpich"
    ) from _exc

from ...checks import displacements, flat_bytes
from ...communicator import Communicator, SplitPlan
from ...errors import BackendUnavailableError
from ...launch.launcher import (
    Launcher,
    LaunchInfo,
    check_launch_matches_mpi,
    cpus_per_local_process,
)
from ...types import Collective, ReduceOp, Support, SupportLevel
from ...work import DescriptionLike, Work
from .abort import abort_on_error_enabled, install_abort_hook
from .dtypes import HALF, MPI_BUFFER, mpi_op, predefined_datatype
from .ops16 import half_op, uses_user_op
from .progress import MPIWork, ProgressThread
from .scratch import ScratchPool
from .support import classify

if TYPE_CHECKING:  # pragma: no cover
    from mpi4py import MPI as MPIModule

__all__ = ["MPICommunicator"]

#: What a call reads and writes: (contiguous tensor, MPI reads it, MPI writes it).
_Wire = tuple[torch.Tensor, bool, bool]
#: Seconds close() waits for the progress thread to free the communicator.
_CLOSE_WAIT_S = 5.0


def _thread_level_names() -> dict[int, str]:
    return {MPI.THREAD_SINGLE: "single", MPI.THREAD_FUNNELED: "funneled",
            MPI.THREAD_SERIALIZED: "serialized", MPI.THREAD_MULTIPLE: "multiple"}


class MPICommunicator(Communicator):
    """Collectives through mpi4py on a private duplicate of ``MPI.COMM_WORLD``.

    Args:
        launch: rank and world size from the launcher's environment. MPI's own rank and size
            must agree; when the environment says a single process but MPI reports more (a
            launcher gradcomm does not recognise), MPI's rank, size and node-local rank are used.
        timeout: seconds each collective may take before :class:`~gradcomm.CollectiveTimeoutError`
            (``None``: forever).
        device: ``None`` or cpu for CPU tensors; a CUDA device for GPU tensors (CuPy views when MPI
            is CUDA-aware, else staged through pinned host memory; see
            :mod:`gradcomm.comm.backends.mpi.device`). ``cuda`` without an index means
            ``cuda:<local_rank mod device count>``.

    Raises:
        RuntimeError: MPI's rank/size disagree with ``launch``; MPI gives a thread level below
            ``MPI_THREAD_MULTIPLE`` (the progress thread calls MPI beside the caller).
        BackendUnavailableError: ``device`` is CUDA but no CUDA device is available.
        ValueError: ``device`` is neither cpu nor cuda, or timeout is not positive.

    The duplicate communicator isolates gradcomm's traffic from the user's own MPI calls; it is
    freed by :meth:`close`. With more than one rank, :func:`install_abort_hook` is called unless
    ``GRADCOMM_MPI_ABORT_ON_ERROR=0``.
    """

    backend = "mpi"
    receives_from_any_source = True  # MPI_ANY_SOURCE; the status names the sender
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
        provided = MPI.Query_thread()
        if provided < MPI.THREAD_MULTIPLE:
            raise RuntimeError(
                f"MPI gives thread level {_thread_level_names().get(provided, provided)!r}; the "
                "mpi backend needs 'multiple' (set mpi4py.rc.thread_level = 'multiple' before "
                "importing mpi4py.MPI)")
        world = MPI.COMM_WORLD
        if launch.launcher is Launcher.SINGLE and world.Get_size() > 1:
            launch = self._launch_from_mpi(world)
        else:
            check_launch_matches_mpi(world, launch)
        index: int | None = dev.index
        if dev.type == "cuda" and index is None:
            dev = torch.device("cuda", launch.local_rank % torch.cuda.device_count())
        super().__init__(rank=launch.rank, world_size=launch.world_size,
                         local_rank=launch.local_rank, device=dev, timeout=timeout)
        self._cuda_aware = False
        self._cuda_reason = ""
        adapter = None
        if dev.type == "cuda":
            from . import device as mpi_device  # lazy: needs cupy only on this branch

            torch.cuda.set_device(dev)  # this rank's GPU, not GPU 0, for contexts and copies
            self._cuda_aware, self._cuda_reason = mpi_device.cuda_aware_mpi()
            adapter = mpi_device.DeviceBufferAdapter(self._cuda_aware)
        self._attach(launch, world.Dup(), adapter)
        if launch.world_size > 1 and abort_on_error:
            install_abort_hook()

    def _attach(self, launch: LaunchInfo, comm: MPIModule.Comm, adapter: Any) -> None:
        """This communicator's state over ``comm`` (a duplicate of the world, or a split)."""
        self.launch = launch
        self._comm = comm  # type: ignore[assignment]  # Split's result: an Intracomm
        self._adapter = adapter
        self._scratch = ScratchPool()
        self._datatypes: dict[torch.dtype, MPI.Datatype] = {}
        self._support_cache: dict[tuple[torch.dtype, str], Support] = {}
        self._progress = ProgressThread(f"gradcomm-mpi-rank{launch.rank}", self._timeout)

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
        """The private duplicate of ``MPI.COMM_WORLD`` (do not free it; :meth:`close` does; do
        not call collectives on it: the progress thread's would interleave with them)."""
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
        """True when each process on this host has >= 2 CPU cores: one for the progress thread,
        which sits in MPI for a collective while the caller computes."""
        return cpus_per_local_process(self.launch.local_world_size) >= 2

    @property
    def cuda_aware(self) -> bool:
        """True when CUDA buffers go to MPI directly (only meaningful with a CUDA device)."""
        return self._cuda_aware

    # ------------------------------------------------------------------ capability
    def _supports(self, dtype: torch.dtype, device: torch.device | str | None) -> Support:
        """How ``dtype`` on ``device`` (default: this communicator's) is all-reduced (the table
        in the module docstring)."""
        dev_type = self.device.type if device is None else torch.device(device).type
        key = (dtype, dev_type)
        cached = self._support_cache.get(key)
        if cached is None:
            cached = self._support_cache[key] = classify(
                dtype, dev_type, self.device.type, self.world_size, self._cuda_aware,
                self._cuda_reason,
            )
        return cached

    def _supports_collective(self, collective: Collective, dtype: torch.dtype,
                             device: torch.device | None, base: Support) -> Support:
        if (collective in (Collective.REDUCE_SCATTER, Collective.REDUCE) and dtype in HALF
                and base.is_supported and base.transfer_dtype != torch.float32):
            # all_reduce's user-defined 16-bit op is not used here: always the upcast
            return Support(SupportLevel.EMULATED_SLOW, f"MPI has no fast {dtype} reduction: "
                           "upcast to float32, reduce, round back", torch.float32)
        return base

    # ------------------------------------------------------------------ collectives
    # Each hook makes the work and its MPI buffers (_work), then gives the work the call to post:
    # a partial of the bound mpi4py method, which the progress thread calls with no Python frame
    # of its own.
    def _all_reduce(self, tensor: torch.Tensor, op: ReduceOp, description: DescriptionLike) -> Work:
        if tensor.dtype in HALF:
            if self._adapter is None and uses_user_op(op, self.world_size):
                # MPI sees int16; the user op adds 16-bit floats with torch
                work, (buf,) = self._work(description, (tensor.view(torch.int16), True, True),
                                          as_bytes=False)
                return self._post(work, self.mpi_comm.Allreduce, MPI.IN_PLACE,
                                  [buf, MPI.INT16_T], half_op(tensor.dtype, op))
            return self._widened(self._all_reduce, tensor, op, description)
        work, (buf,) = self._work(description, (tensor, True, True), as_bytes=False)
        return self._post(work, self.mpi_comm.Allreduce, MPI.IN_PLACE,
                          [buf, self._datatype(tensor.dtype)], mpi_op(op, tensor.dtype))

    def _broadcast(self, tensor: torch.Tensor, src: int, description: DescriptionLike) -> Work:
        work, (buf,) = self._work(description, (tensor, True, True))
        return self._post(work, self.mpi_comm.Bcast, [buf, MPI.BYTE], src)

    def _all_gather(
        self, output: torch.Tensor, input: torch.Tensor, description: DescriptionLike
    ) -> Work:
        work, (send, recv) = self._work(description, (input, True, False), (output, False, True))
        return self._post(work, self.mpi_comm.Allgather, [send, MPI.BYTE], [recv, MPI.BYTE])

    def _all_gather_v(self, output: torch.Tensor, input: torch.Tensor, counts: list[int],
                      description: DescriptionLike) -> Work:
        size = input.element_size()
        recv_bytes = [c * size for c in counts]
        work, (send, recv) = self._work(description, (input, True, False), (output, False, True))
        return self._post(work, self.mpi_comm.Allgatherv, [send, MPI.BYTE],
                          [recv, (recv_bytes, displacements(recv_bytes)), MPI.BYTE])

    def _reduce_scatter(self, output: torch.Tensor, input: torch.Tensor, op: ReduceOp,
                        description: DescriptionLike) -> Work:
        if output.dtype in HALF:
            wide_out = torch.empty_like(output, dtype=torch.float32)
            work = self._reduce_scatter(wide_out, input.to(torch.float32), op, description)
            work.add_callback(lambda: output.copy_(wide_out))
            return work
        datatype, n = self._datatype(output.dtype), output.numel()
        work, (send, recv) = self._work(description, (input, True, False), (output, False, True),
                                        as_bytes=False)
        return self._post(work, self.mpi_comm.Reduce_scatter_block, [send, n, datatype],
                          [recv, n, datatype], mpi_op(op, output.dtype))

    def _all_to_all(self, output: torch.Tensor, input: torch.Tensor, output_counts: list[int],
                    input_counts: list[int], description: DescriptionLike) -> Work:
        size = input.element_size()
        send_bytes = [c * size for c in input_counts]
        recv_bytes = [c * size for c in output_counts]
        work, (send, recv) = self._work(description, (input, True, False), (output, False, True))
        if len(set(send_bytes)) == 1 and send_bytes == recv_bytes:  # even splits: MPI_Alltoall
            return self._post(work, self.mpi_comm.Alltoall, [send, MPI.BYTE], [recv, MPI.BYTE])
        return self._post(work, self.mpi_comm.Alltoallv,
                          [send, (send_bytes, displacements(send_bytes)), MPI.BYTE],
                          [recv, (recv_bytes, displacements(recv_bytes)), MPI.BYTE])

    def _reduce(self, tensor: torch.Tensor, dst: int, op: ReduceOp,
                description: DescriptionLike) -> Work:
        if tensor.dtype in HALF:
            return self._widened(lambda t, o, d: self._reduce(t, dst, o, d), tensor, op,
                                 description)
        datatype, mop = self._datatype(tensor.dtype), mpi_op(op, tensor.dtype)
        root = self.rank == dst
        work, (buf,) = self._work(description, (tensor, True, root), as_bytes=False)
        if root:
            return self._post(work, self.mpi_comm.Reduce, MPI.IN_PLACE, [buf, datatype], mop,
                              dst)
        return self._post(work, self.mpi_comm.Reduce, [buf, datatype], None, mop, dst)

    def _gather(self, output: torch.Tensor | None, input: torch.Tensor, dst: int,
                description: DescriptionLike) -> Work:
        if output is None:
            work, (send,) = self._work(description, (input, True, False))
            return self._post(work, self.mpi_comm.Gather, [send, MPI.BYTE], None, dst)
        work, (send, recv) = self._work(description, (input, True, False), (output, False, True))
        return self._post(work, self.mpi_comm.Gather, [send, MPI.BYTE], [recv, MPI.BYTE], dst)

    def _scatter(self, output: torch.Tensor, input: torch.Tensor | None, src: int,
                 description: DescriptionLike) -> Work:
        if input is None:
            work, (recv,) = self._work(description, (output, False, True))
            return self._post(work, self.mpi_comm.Scatter, None, [recv, MPI.BYTE], src)
        work, (recv, send) = self._work(description, (output, False, True), (input, True, False))
        return self._post(work, self.mpi_comm.Scatter, [send, MPI.BYTE], [recv, MPI.BYTE], src)

    def _barrier(self, description: DescriptionLike) -> Work:
        work, _ = self._work(description)
        return self._post(work, self.mpi_comm.Barrier)

    # ------------------------------------------------------------------ point-to-point
    # Posted non-blocking by the progress thread, which goes on with its queue: a transfer must
    # not wait in posting order for its match (see .progress).
    def _send(self, tensor: torch.Tensor, dst: int, tag: int, description: DescriptionLike) -> Work:
        work, (buf,) = self._work(description, (tensor, True, False))
        return self._post(work, self.mpi_comm.Isend, [buf, MPI.BYTE], dst, tag)

    def _recv(self, tensor: torch.Tensor, src: int, tag: int, description: DescriptionLike) -> Work:
        work, (buf,) = self._work(description, (tensor, False, True), expect_bytes=tensor.nbytes)
        return self._post(work, self.mpi_comm.Irecv, [buf, MPI.BYTE], src, tag)

    def _recv_any(self, tensor: torch.Tensor, tag: int, description: DescriptionLike) -> Work:
        return self._recv(tensor, MPI.ANY_SOURCE, tag, description)  # the status names the sender

    # ------------------------------------------------------------------ sub-communicators
    def _split_child(self, plan: SplitPlan) -> Communicator | None:
        """``Comm.Split`` of this communicator, run in order on its progress thread (every rank
        calls it; non-members get None)."""
        color = MPI.UNDEFINED if plan.color is None else plan.color
        comm = self.mpi_comm
        box: list[MPIModule.Comm] = []
        split = MPIWork(f"split #{plan.index} (mpi, rank {self.rank}/{self.world_size})",
                        self._timeout)
        self._progress.submit(split, lambda: box.append(comm.Split(color, plan.rank)))
        self._complete(split, False, None)
        if plan.color is None:
            return None
        return self._child_over(plan, box[0])

    def _subgroup_child(self, plan: SplitPlan) -> Communicator:
        """``Comm.Create_group`` of the members (``MPI_Comm_create_group``: only they call it;
        the tag tells apart successive groups of the same ranks), run in order on the progress
        thread."""
        comm = self.mpi_comm
        box: list[MPIModule.Comm] = []

        def create() -> None:
            group = comm.Get_group()
            members = group.Incl(list(plan.members))
            group.Free()
            try:
                box.append(comm.Create_group(members, tag=plan.index % 32768))  # TAG_UB >= 32767
            finally:
                members.Free()

        work = MPIWork(f"subgroup {list(plan.members)!r:.60} (mpi, rank {self.rank}/"
                       f"{self.world_size})", self._timeout)
        self._progress.submit(work, create)
        self._complete(work, False, None)
        return self._child_over(plan, box[0])

    def _child_over(self, plan: SplitPlan, comm: MPIModule.Comm) -> Communicator:
        """This backend's communicator of ``plan`` over ``comm``, with this one's device."""
        child = object.__new__(type(self))  # this backend's state over the new comm
        Communicator.__init__(child, rank=plan.rank, world_size=len(plan.members),
                              local_rank=plan.local_rank, device=self.device,
                              timeout=self._timeout)
        child._cuda_aware, child._cuda_reason = self._cuda_aware, self._cuda_reason
        child._attach(LaunchInfo(plan.rank, len(plan.members), plan.local_rank,
                                 plan.local_world_size, Launcher.EXPLICIT), comm, self._adapter)
        return child

    def _close(self) -> None:
        comm, self._comm = self._comm, None
        if comm is None or MPI.Is_finalized():
            self._progress.stop(0.0)
            return
        # Freed behind every call posted so far. A collective still pending (a timed-out one,
        # whose peer may be dead) would hold the thread, and the comm is then left to
        # MPI_Finalize; close() does not wait for it.
        freed = MPIWork("free", None)
        self._progress.submit(freed, lambda: comm.Free())
        stalled = self._stalls.stalled is not None
        self._progress.stop(0.0 if stalled else _CLOSE_WAIT_S)

    # ------------------------------------------------------------------ the hand-over
    def _work(self, description: DescriptionLike, *wires: _Wire, as_bytes: bool = True,
              expect_bytes: int | None = None) -> tuple[MPIWork, list[Any]]:
        """A work for one MPI call on the contiguous tensors of ``wires``, and their MPI buffers.

        Each wire is (tensor, MPI reads it, MPI writes it). Host memory goes as a zero-copy view
        (``MPI.buffer.fromaddress``); device memory through the adapter (CuPy views, or pinned
        host copies whose results it copies back when the work completes), as bytes unless
        ``as_bytes`` is False (the call gives a datatype: staged in the tensor's dtype). The work
        keeps the tensors and their storages alive until MPI is done.
        """
        bufs: list[Any] = []
        keep: list[object] = []
        finishes = []
        for tensor, read, write in wires:
            if self._adapter is None:
                buf = MPI_BUFFER.fromaddress(tensor.data_ptr(), tensor.nbytes)
                keep += (tensor, tensor.untyped_storage(), buf)
            else:
                wire = flat_bytes(tensor) if as_bytes else tensor
                buf, finish = self._adapter.prepare(wire, read=read, write=write)
                keep += (wire, wire.untyped_storage(), buf)
                finishes.append(finish)
            bufs.append(buf)
        work = MPIWork(description, self._timeout, tuple(keep), expect_bytes=expect_bytes)
        for finish in finishes:
            work.add_callback(finish)
        return work, bufs

    def _post(self, work: MPIWork, method: Callable[..., MPI.Request | None],
              *args: object) -> MPIWork:
        """Have the progress thread run ``method(*args)`` for ``work`` (posted when the
        communicator binds the work: :meth:`MPIWork.post_on`)."""
        work.post_on(self._progress, functools.partial(method, *args))
        return work

    def _widened(self, start: Callable[[torch.Tensor, ReduceOp, DescriptionLike], Work],
                 tensor: torch.Tensor, op: ReduceOp, description: DescriptionLike) -> Work:
        """``start`` on a float32 copy of the 16-bit ``tensor`` (from the scratch pool), the
        result rounded back once: MPI has no fast 16-bit reduction."""
        scratch = self._scratch.take(tensor.numel(), tensor.device)
        wide = scratch[: tensor.numel()]
        wide.copy_(tensor)
        work = start(wide, op, description)

        def round_back() -> None:
            tensor.copy_(wide)
            self._scratch.give(scratch)

        work.add_callback(round_back)
        return work

    def _datatype(self, dtype: torch.dtype) -> MPI.Datatype:
        found = self._datatypes.get(dtype)
        if found is None:
            found = self._datatypes[dtype] = predefined_datatype(dtype)
        return found


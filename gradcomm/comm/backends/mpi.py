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
                                               much slower than float32's. With 2
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

Progress: MPICH (and Open MPI by default) has no asynchronous progress thread, so an outstanding
non-blocking collective advances only while this process calls into MPI. :meth:`MPIWork.wait`
polls ``Request.Test()`` -- back to back for 1 ms, then with ``sched_yield()`` between bursts
for up to 1 s, then with sleeps growing to 1 ms -- and :meth:`MPIWork.is_completed` calls
``Test()`` once, so callers that poll ``is_completed()`` on in-flight work (the gradient manager
does, from its backward hooks) drive the transfer forward.

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
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from ..communicator import Communicator, flat_bytes
from ..errors import BackendUnavailableError
from ..launcher import Launcher, LaunchInfo, check_launch_matches_mpi, cpus_per_local_process
from ..mpi_abort import ABORT_ENV_VAR, abort_on_error_enabled, install_abort_hook
from ..types import ReduceOp, Support, SupportLevel
from ..work import Description, DescriptionLike, Work

if TYPE_CHECKING:  # pragma: no cover
    from mpi4py import MPI as MPIModule

try:
    from mpi4py import MPI
    from mpi4py.util import dtlib
except ImportError as _exc:  # pragma: no cover - exercised by a subprocess test
    raise ImportError(
        "the mpi backend needs the mpi4py package and an MPI library: pip install mpi4py mpich"
    ) from _exc

logger = logging.getLogger("gradcomm.comm.mpi")

# mpi4py 4 names it MPI.buffer; 3.x called the same class MPI.memory.
_MPI_BUFFER = getattr(MPI, "buffer", None) or MPI.memory

__all__ = [
    "MPICommunicator",
    "MPIWork",
    "install_abort_hook",
    "abort_on_error_enabled",
    "ABORT_ENV_VAR",
]

#: Environment variable that turns off the abort-on-uncaught-error hook when set to ``0``.

_NATIVE = frozenset(
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
_HALF = frozenset({torch.float16, torch.bfloat16})
#: Dtypes that :meth:`MPICommunicator.all_reduce` may post without the general path: MPI
#: reduces them natively, and SUM is MPI_SUM (for bool it is logical or, looked up in general).
_SHORTCUT_DTYPES = _NATIVE - {torch.bool}

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

# float16/bfloat16 SUM and PRODUCT use the 16-bit user-defined op (one rounding per add) only up
# to this many ranks: with two ranks each element is rounded once, exactly like the float32
# upcast, at half the bytes and without the two conversion passes. With more ranks the partial
# sums would be rounded to 16 bits at every step, so the upcast is used. MIN and MAX never round.
_USER_OP_MAX_WORLD = 2

# Polling schedule of MPIWork.wait, in bursts of _TESTS_PER_CHECK Test() calls: back to back
# for _YIELD_AFTER_S seconds (small and medium messages finish here), then separated by
# sched_yield() (a peer rank sharing this core gets to run; with ranks on busy cores this beat a
# pure Test() spin on large messages and lost nothing on medium ones) until _SPIN_S, then by
# sleeps doubling from _SLEEP_START_S up to _SLEEP_CAP_S, so a rank waiting for a late or dead
# peer stops burning a core. A transfer progresses only when Test() is called, so the yielding
# phase is long enough for any usual bucket (a 25 MiB one included).
_TESTS_PER_CHECK = 16
_YIELD_AFTER_S = 1e-3
_SPIN_S = 1.0
_SLEEP_START_S = 1e-5
_SLEEP_CAP_S = 1e-3



class MPIWork(Work):
    """Handle of one non-blocking MPI collective.

    Args:
        request: the ``MPI.Request`` returned by ``Iallreduce``/``Ibcast``/...
        description: what the collective is, for error messages.
        timeout: default timeout of :meth:`wait`, seconds (``None``: forever).
        keepalive: objects that must outlive the request: the tensors, and the storages of the
            memory MPI reads and writes (a tensor alone is not enough: ``t.data = ...`` or
            ``t.set_(...)`` while the collective is pending would free that memory).
        inflight: the communicator's list of pending works, which holds this one until its
            request completes (it removes itself then): MPI still reads and writes its buffers,
            and the standard forbids freeing a pending collective's request, so neither may die
            with a handle the caller dropped. Later collectives test the oldest pending work,
            which also runs its callbacks.

    ``_test`` calls ``Request.Test()`` (which also drives MPI's progress engine); ``_wait`` polls
    it until the request completes or the deadline passes, then raises :class:`TimeoutError`.
    """

    def __init__(
        self,
        request: MPI.Request,
        description: DescriptionLike,
        timeout: float | None,
        keepalive: tuple[object, ...] = (),
        inflight: list[MPIWork] | None = None,
    ) -> None:
        super().__init__(description, timeout)
        self._request = request
        # None once the request completed: nothing needs to outlive it any more.
        self._keepalive: tuple[object, ...] | None = keepalive
        self._inflight = inflight
        if inflight is not None:
            inflight.append(self)

    def _release(self) -> None:
        """The request completed: drop the buffers and leave the communicator's pending list."""
        self._keepalive = None
        inflight, self._inflight = self._inflight, None
        if inflight is not None:
            inflight.remove(self)

    def _test(self) -> bool:
        if self._request.Test():
            self._release()
            return True
        return False

    def _wait(self, timeout: float | None) -> None:
        test = self._request.Test
        now = time.perf_counter
        start = now()
        deadline = None if timeout is None else start + timeout
        pause = 0.0
        while True:
            for _ in range(_TESTS_PER_CHECK):
                if test():
                    self._release()
                    return
            t = now()
            if deadline is not None and t >= deadline:
                raise TimeoutError(f"{self.description}: MPI request still pending")
            waited = t - start
            if waited < _SPIN_S:
                if waited >= _YIELD_AFTER_S:
                    os.sched_yield()  # let a peer rank that shares this core run
            else:
                pause = min(max(pause * 2.0, _SLEEP_START_S), _SLEEP_CAP_S)
                time.sleep(pause)


_HalfReduce = Callable[[torch.Tensor, torch.Tensor], object]
_HALF_REDUCERS: dict[ReduceOp, _HalfReduce] = {
    ReduceOp.SUM: torch.Tensor.add_,
    ReduceOp.PRODUCT: torch.Tensor.mul_,
    ReduceOp.MIN: lambda acc, x: torch.minimum(acc, x, out=acc),
    ReduceOp.MAX: lambda acc, x: torch.maximum(acc, x, out=acc),
}
_half_ops: dict[tuple[torch.dtype, ReduceOp], MPI.Op] = {}
_half_ops_lock = threading.Lock()


def _half_op(dtype: torch.dtype, op: ReduceOp) -> MPI.Op:
    """A user-defined MPI op reducing 16-bit floats of ``dtype`` in place with torch (cached).

    MPI sees the data as ``MPI.INT16_T``; the op views its buffers as ``dtype`` tensors and
    applies ``op`` (torch rounds each result to ``dtype``). Commutative.
    """
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


class _ScratchPool:
    """Reusable float32 buffers for the fp16/bf16 upcast, keyed by device.

    A buffer is taken for the life of one collective and given back by its completion callback,
    so overlapping async collectives never share one.
    """

    def __init__(self, keep: int = 4) -> None:
        self._free: dict[torch.device, list[torch.Tensor]] = {}
        self._keep = keep
        self._lock = threading.Lock()

    def take(self, numel: int, device: torch.device) -> torch.Tensor:
        """A 1-D float32 buffer of at least ``numel`` elements on ``device`` (uninitialised)."""
        with self._lock:
            free = self._free.setdefault(device, [])
            fits = [i for i, b in enumerate(free) if b.numel() >= numel]
            if fits:
                best = min(fits, key=lambda i: free[i].numel())
                return free.pop(best)
        return torch.empty(numel, dtype=torch.float32, device=device)

    def give(self, buf: torch.Tensor) -> None:
        """Return a buffer from :meth:`take`; only the ``keep`` largest per device are kept."""
        with self._lock:
            free = self._free.setdefault(buf.device, [])
            free.append(buf)
            if len(free) > self._keep:
                free.sort(key=lambda b: b.numel(), reverse=True)
                del free[self._keep:]


def _predefined_datatype(dtype: torch.dtype) -> MPI.Datatype:
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
            :mod:`gradcomm.comm.backends.mpi_device`). ``cuda`` without an index means
            ``cuda:<local_rank mod device count>``.

    Raises:
        RuntimeError: MPI's rank/size disagree with ``launch``.
        BackendUnavailableError: ``device`` is CUDA but no CUDA device is available.
        ValueError: ``device`` is neither cpu nor cuda, or timeout is not positive.

    The duplicate communicator isolates gradcomm's traffic from the user's own MPI calls; it is
    freed by :meth:`close`. With more than one rank, :func:`install_abort_hook` is called unless
    ``GRADCOMM_MPI_ABORT_ON_ERROR=0``.
    """

    backend = "mpi"
    native_reduce_ops = frozenset({ReduceOp.SUM, ReduceOp.MIN, ReduceOp.MAX, ReduceOp.PRODUCT})

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
        super().__init__(
            rank=launch.rank,
            world_size=launch.world_size,
            local_rank=launch.local_rank,
            device=dev,
            timeout=timeout,
        )
        self.launch = launch
        self._comm: MPIModule.Intracomm | None = world.Dup()
        # Works whose requests have not completed, oldest first (see MPIWork).
        self._inflight: list[MPIWork] = []
        self._scratch = _ScratchPool()
        self._datatypes: dict[torch.dtype, MPI.Datatype] = {}
        self._support_cache: dict[tuple[torch.dtype, str], Support] = {}
        self._adapter: Any = None
        self._cuda_aware = False
        self._cuda_reason = ""
        if dev.type == "cuda":
            from . import mpi_device  # lazy: needs cupy only on this branch

            self._cuda_aware, self._cuda_reason = mpi_device.cuda_aware_mpi()
            self._adapter = mpi_device.DeviceBufferAdapter(self._cuda_aware)
        if launch.world_size > 1 and abort_on_error:
            install_abort_hook()

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
        """True for host memory: MPI reduces it where it lies, and an 8-byte all-reduce takes ~6 us.

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
            cached = self._support_cache[key] = self._classify(dtype, dev_type)
        return cached

    def _classify(self, dtype: torch.dtype, dev_type: str) -> Support:
        if dev_type != self.device.type:
            return Support(
                SupportLevel.UNSUPPORTED,
                f"this mpi communicator works on {self.device.type} tensors, not {dev_type} "
                "(pass device= to gradcomm.init)",
            )
        staged = dev_type == "cuda" and not self._cuda_aware
        stage_note = (
            f"; MPI is not CUDA-aware ({self._cuda_reason}), so data is staged through host memory"
            if staged
            else ""
        )
        if dtype in _NATIVE:
            if staged:
                return Support(SupportLevel.EMULATED_SLOW, stage_note[2:], dtype)
            return Support(SupportLevel.NATIVE, "", dtype)
        if dtype in _HALF:
            if dev_type == "cpu" and self.world_size <= _USER_OP_MAX_WORLD:
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

    # ------------------------------------------------------------------ collectives
    def all_reduce(
        self,
        tensor: torch.Tensor,
        op: ReduceOp | str = ReduceOp.SUM,
        *,
        async_op: bool = False,
        label: str | None = None,
    ) -> Work:
        """:meth:`Communicator.all_reduce` (same arguments, result and errors), with a shortcut.

        The common call -- SUM of a dense, contiguous CPU tensor of a dtype MPI reduces natively
        (not bool), whose (dtype, device) an earlier call has classified, with no profiler and no
        collective pending or stalled on this communicator -- is posted here: the same
        ``Iallreduce``, :class:`~gradcomm.comm.Description`, :class:`MPIWork` (``_work``) and
        wait (``_finish``) as the general path, without the nested calls of its checks and of
        its posting. Between 1 MiB all-reduces, whose traffic leaves the caches cold, such calls
        cost microseconds each (``benchmarks/call_overhead.py``).
        Every other call, including every one that raises, takes the general path.
        """
        if (op is ReduceOp.SUM and async_op.__class__ is bool
                and (label is None or label.__class__ is str)
                and self.profiler is None and self._adapter is None
                and not self._inflight and self._stalled is None and not self._closed
                and isinstance(tensor, torch.Tensor) and tensor.dtype in _SHORTCUT_DTYPES
                and tensor.layout is torch.strided):
            kind = self._tensor_kinds.get((tensor.dtype, tensor.device))
            comm = self._comm
            datatype = self._datatypes.get(tensor.dtype)
            numel = tensor.numel()
            if (kind is not None and kind[0] is None and comm is not None and datatype is not None
                    and numel and self._world_size > 1 and tensor.is_contiguous()
                    and not tensor.is_neg()):
                desc = Description("all_reduce", next(self._seq), numel, kind[2], op, label)
                buf = _MPI_BUFFER.fromaddress(tensor.data_ptr(), tensor.nbytes)
                request = comm.Iallreduce(MPI.IN_PLACE, [buf, datatype], MPI.SUM)
                request.Test()  # as in _all_reduce: a waiting peer gets this rank's data now
                work = self._work(request, desc, (tensor, tensor.untyped_storage(), buf))
                return self._finish(work, async_op, tensor)
        return super().all_reduce(tensor, op, async_op=async_op, label=label)

    def _all_reduce(self, tensor: torch.Tensor, op: ReduceOp, description: DescriptionLike) -> Work:
        comm = self._live_comm()
        dtype = tensor.dtype
        flat = tensor if tensor.dim() == 1 else tensor.view(-1)
        scratch: torch.Tensor | None = None
        if dtype in _HALF and self._half_user_op(op):
            wire = flat.view(torch.int16)
            mpi_op, datatype = _half_op(dtype, op), MPI.INT16_T
        else:
            if dtype in _HALF:
                scratch = self._scratch.take(flat.numel(), flat.device)
                wire = scratch[: flat.numel()]
                wire.copy_(flat)
            else:
                wire = flat
            if op is ReduceOp.SUM and wire.dtype is not torch.bool:  # the gradient path: no lookup
                mpi_op = MPI.SUM
            else:
                mpi_op = (_BOOL_OPS if wire.dtype == torch.bool else _MPI_OPS)[op]
            datatype = self._datatype(wire.dtype)
        buf, finish = self._prepare(wire)
        request = comm.Iallreduce(MPI.IN_PLACE, [buf, datatype], mpi_op)
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
        comm = self._live_comm()
        wire = flat_bytes(tensor)
        buf, finish = self._prepare(wire)
        work = self._work(comm.Ibcast([buf, MPI.BYTE], root=src), description,
                          (tensor, wire.untyped_storage(), buf))
        if finish is not None:
            work.add_callback(finish)
        return work

    def _all_gather(
        self, output: torch.Tensor, input: torch.Tensor, description: DescriptionLike
    ) -> Work:
        comm = self._live_comm()
        send_wire, recv_wire = flat_bytes(input), flat_bytes(output)
        send, finish_send = self._prepare(send_wire, write=False)
        recv, finish_recv = self._prepare(recv_wire, read=False)
        request = comm.Iallgather([send, MPI.BYTE], [recv, MPI.BYTE])
        work = self._work(request, description, (input, output, send_wire.untyped_storage(),
                                                 recv_wire.untyped_storage(), send, recv))
        for finish in (finish_send, finish_recv):
            if finish is not None:
                work.add_callback(finish)
        return work

    def _barrier(self, description: DescriptionLike) -> Work:
        return self._work(self._live_comm().Ibarrier(), description, ())

    def _close(self) -> None:
        comm, self._comm = self._comm, None
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
            # Drives the oldest pending collective, which may be one whose Work was dropped: it
            # completes (its callbacks run) and leaves the list, freeing its buffers.
            oldest = self._inflight[0]
            try:
                oldest.is_completed()
            except Exception as exc:
                if oldest._error is not exc:  # the transport failed, not a callback
                    raise
                # A completion step of that earlier collective failed (e.g. a copy-back into a
                # tensor that was given other memory meanwhile). Raised here, before this
                # collective is posted, it would make this rank alone skip a collective the
                # others post; it stays on that Work, whose wait() raises it.
                logger.warning("%s: its completion step failed (%s: %s); raised by its wait(), "
                               "not by this collective", oldest.description,
                               type(exc).__name__, exc)
        if self._comm is None:
            raise RuntimeError("mpi communicator is closed")
        return self._comm

    def _half_user_op(self, op: ReduceOp) -> bool:
        """Whether a float16/bfloat16 all-reduce with ``op`` uses the 16-bit user-defined op.

        Host buffers only (a user op cannot run on device memory); MIN and MAX at any world size
        (exact); SUM and PRODUCT up to ``_USER_OP_MAX_WORLD`` ranks (one rounding per element).
        """
        if self._adapter is not None:
            return False
        return op in (ReduceOp.MIN, ReduceOp.MAX) or self.world_size <= _USER_OP_MAX_WORLD

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
            found = self._datatypes[dtype] = _predefined_datatype(dtype)
        return found

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
            # A raw view of the tensor's memory (the Work keeps the tensor alive): cheaper than
            # wire.numpy(), whose cost grows between large collectives (cold caches;
            # benchmarks/call_overhead.py).
            return _MPI_BUFFER.fromaddress(wire.data_ptr(), wire.nbytes), None
        buf, finish = self._adapter.prepare(wire, read=read, write=write)
        return buf, finish

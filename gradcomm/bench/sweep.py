"""The all-reduce sweep: gradcomm's ``all_reduce`` timed beside the raw transport under it.

Timing follows nccl-tests: warm-up calls, a barrier, ``iters`` back-to-back blocking calls timed on
each rank, the mean per call, then the maximum over ranks (nccl-tests reduces its per-rank times
with ``-a``; the maximum is the conservative choice, the slowest rank bounds a step). Because
these machines are shared and noisy, the gradcomm and raw measurements are interleaved:
``repeats`` rounds alternate the two (swapping which goes first), and the reported time is the
median over rounds (``stat="min"``: the minimum; ``stat="call-median"``: the median single call).

The buffers hold values every op leaves unchanged (zeros; ones for ``prod``), so repeated in-place
reductions never overflow or produce denormals that would slow the arithmetic. After timing, one
all-reduce of rank-dependent values is checked against the exact result (the ``#wrong`` column).

The buffers live on the communicator's device. On a CUDA device every timed call is followed by
``torch.cuda.synchronize`` (NCCL and CUDA-aware MPI calls return before the GPU finishes), as
nccl-tests synchronises its stream before reading the clock.
"""

from __future__ import annotations

import datetime
import functools
import math
import os
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any, ClassVar

import torch
import torch.distributed as dist

from ..comm.communicator import Communicator
from ..comm.launch.launcher import detect_launch
from ..comm.launch.netaddr import publish_candidates
from ..comm.launch.reachability import first_answering
from ..comm.types import ReduceOp
from .metrics import algbw, busbw, dtype_name, op_name
from .results import SweepRow

__all__ = [
    "RawTransport",
    "TorchDistRaw",
    "MPIRaw",
    "make_raw_transport",
    "raw_transport_unavailable",
    "run_sweep",
    "measure",
]

# dtypes gloo and MPI reduce natively (16-bit floats have no standard MPI datatype).
_NATIVE_DTYPES = frozenset(
    {torch.float32, torch.float64, torch.int8, torch.uint8, torch.int32, torch.int64}
)


class RawTransport:
    """The transport under a gradcomm backend, called directly (the overhead baseline).

    Subclasses implement :meth:`supports`, :meth:`all_reduce` and :meth:`close`.
    """

    #: What the raw column measured, e.g. ``"torch.distributed (gloo)"``.
    name = "raw"
    #: The calls the raw column times and how gradcomm's differ, one sentence for the output.
    description = "the transport's own calls"

    def supports(self, dtype: torch.dtype, op: ReduceOp) -> bool:
        """True when the transport reduces ``dtype`` with ``op`` natively."""
        raise NotImplementedError

    def all_reduce(self, tensor: torch.Tensor, op: ReduceOp) -> None:
        """Reduce the contiguous ``tensor`` (on the communicator's device) in place, all ranks."""
        raise NotImplementedError

    def close(self) -> None:
        """Release what the transport holds."""


class TorchDistRaw(RawTransport):
    """``torch.distributed.all_reduce`` on a process group of its own (gloo, or nccl).

    The group is torch's default process group when none exists yet (the CLI's case), else a new
    group of every rank. Its rendezvous goes through ``comm``: rank 0 opens a TCPStore on a port
    the OS picks and broadcasts its candidate addresses -- ``MASTER_ADDR`` when set, else those of
    :func:`gradcomm.comm.launch.netaddr.publish_candidates` (127.0.0.1 on one host, never loopback
    across hosts) -- and each rank connects to the first that answers, so it never collides with
    the store gradcomm's own communicator opened at ``MASTER_ADDR:MASTER_PORT``, under torchrun
    and mpiexec alike. Across hosts gloo binds the interface gradcomm's communicator chose.

    Args:
        backend: torch.distributed backend name (``"gloo"``, ``"nccl"``).
        comm: a gradcomm communicator of the same ranks (used only for the rendezvous).
        timeout: seconds for the rendezvous and each collective.

    Raises:
        RuntimeError: the rendezvous failed.
    """

    _OPS: ClassVar[dict[ReduceOp, str]] = {
        ReduceOp.SUM: "SUM",
        ReduceOp.PRODUCT: "PRODUCT",
        ReduceOp.MIN: "MIN",
        ReduceOp.MAX: "MAX",
    }
    # gloo and NCCL reduce float16/bfloat16 themselves (gloo slowly, element by element), and
    # gradcomm hands them the 16-bit data unchanged, so the raw column compares like with like.
    _DTYPES: ClassVar[frozenset[torch.dtype]] = _NATIVE_DTYPES | {torch.float16, torch.bfloat16}

    def __init__(self, backend: str, comm: Communicator, timeout: float = 300.0) -> None:
        self._dist = dist
        self.name = f"torch.distributed ({backend})"
        self.description = (
            f"torch.distributed's blocking calls (all_reduce, reduce_scatter_tensor, ...) on a "
            f"{backend} process group of its own; gradcomm runs the same {backend} operations "
            "behind its checks and Work")
        self._owns_default = not dist.is_initialized()
        if not self._owns_default:
            self._group: dist.ProcessGroup | None = dist.new_group(backend=backend)
            return
        td = datetime.timedelta(seconds=timeout)
        store: dist.Store = dist.HashStore() if comm.world_size == 1 else _raw_store(comm, td)
        # gloo's default group binds the hostname's address (127.0.1.1 on Debian); bind it to
        # the interface gradcomm chose, through the variable init_process_group reads.
        interface = getattr(comm, "bind_interface", None)
        pinned = backend == "gloo" and interface is not None and not os.environ.get(
            "GLOO_SOCKET_IFNAME", "").strip()
        if pinned:
            os.environ["GLOO_SOCKET_IFNAME"] = str(interface)
        try:
            dist.init_process_group(
                backend, store=store, rank=comm.rank, world_size=comm.world_size, timeout=td
            )
        finally:
            if pinned:
                del os.environ["GLOO_SOCKET_IFNAME"]
        self._group = None

    def supports(self, dtype: torch.dtype, op: ReduceOp) -> bool:
        return dtype in self._DTYPES and op in self._OPS

    @property
    def group(self) -> dist.ProcessGroup | None:
        """The process group the raw calls use (None: torch's default group)."""
        return self._group

    def all_reduce(self, tensor: torch.Tensor, op: ReduceOp) -> None:
        red = getattr(self._dist.ReduceOp, self._OPS[op])
        self._dist.all_reduce(tensor, op=red, group=self._group)

    def close(self) -> None:
        if self._owns_default and self._dist.is_initialized():
            self._dist.destroy_process_group()
        elif self._group is not None:
            self._dist.destroy_process_group(self._group)


class MPIRaw(RawTransport):
    """mpi4py's ``Allreduce(MPI.IN_PLACE, buf, op)`` on a duplicate of ``MPI.COMM_WORLD``.

    A CPU tensor is handed to MPI as a NumPy view (no copy); a CUDA tensor directly, through its
    ``__cuda_array_interface__`` (mpi4py's GPU buffer protocol; only for a CUDA-aware MPI, see
    :func:`raw_transport_unavailable`), after the current CUDA stream is synchronised so MPI reads
    finished data. float16/bfloat16 have no standard MPI datatype, so they are not measured.

    Raises:
        ImportError: mpi4py is missing (pip install mpi4py).
    """

    name = "mpi4py"
    description = (
        "mpi4py's blocking calls (Allreduce, Reduce_scatter_block, Allgather, ...) on a Dup() of "
        "COMM_WORLD; gradcomm posts the non-blocking forms (Iallreduce, ...) and polls them "
        "under its timeout, and MPICH may pick other algorithms for those")
    _DTYPES: ClassVar[frozenset[torch.dtype]] = _NATIVE_DTYPES

    def __init__(self) -> None:
        try:
            from mpi4py import MPI
        except ImportError as exc:
            raise ImportError("the raw MPI measurement needs mpi4py: pip install mpi4py") from exc
        self._mpi = MPI
        self._comm = MPI.COMM_WORLD.Dup()
        self._ops = {
            ReduceOp.SUM: MPI.SUM,
            ReduceOp.PRODUCT: MPI.PROD,
            ReduceOp.MIN: MPI.MIN,
            ReduceOp.MAX: MPI.MAX,
        }

    def supports(self, dtype: torch.dtype, op: ReduceOp) -> bool:
        return dtype in self._DTYPES and op in self._ops

    @property
    def comm(self) -> Any:
        """The duplicate of ``MPI.COMM_WORLD`` the raw calls use."""
        return self._comm

    def mpi_op(self, op: ReduceOp) -> Any:
        """The MPI op of ``op`` (SUM, PRODUCT, MIN or MAX)."""
        return self._ops[op]

    def all_reduce(self, tensor: torch.Tensor, op: ReduceOp) -> None:
        if tensor.is_cuda:
            torch.cuda.current_stream(tensor.device).synchronize()
            self._comm.Allreduce(self._mpi.IN_PLACE, tensor, op=self._ops[op])
        else:
            self._comm.Allreduce(self._mpi.IN_PLACE, tensor.numpy(), op=self._ops[op])

    def close(self) -> None:
        self._comm.Free()


def _raw_store(comm: Communicator, timeout: datetime.timedelta) -> dist.Store:
    """A TCPStore of ``comm``'s ranks at a port the OS gave rank 0, found by the address rules
    of gradcomm's own rendezvous (candidates broadcast through ``comm``, first that answers).

    Raises:
        RuntimeError: on every rank, when some rank reaches none of the candidates.
    """
    launch = detect_launch()
    payload = torch.zeros(1024, dtype=torch.uint8)  # on the CPU, sent on comm.device
    server = None
    if comm.rank == 0:
        if launch.master_addr is not None:
            candidates = [launch.master_addr]
        else:
            candidates, _ = publish_candidates(launch.local_world_size == launch.world_size,
                                               os.environ)
        server = dist.TCPStore(candidates[0] if candidates else "127.0.0.1", 0, comm.world_size,
                               True, timeout=timeout, wait_for_workers=False)
        text = f"{','.join(candidates)} {server.port}".encode()[: payload.numel()]
        payload[: len(text)] = torch.tensor(list(text), dtype=torch.uint8)
    sent = payload.to(comm.device)
    comm.broadcast(sent, src=0)
    listed, port = bytes(sent.cpu()[sent.cpu() > 0].tolist()).decode().rsplit(" ", 1)
    candidates = [c for c in listed.split(",") if c]
    deadline = time.monotonic() + timeout.total_seconds()
    chosen, why = (candidates[0], "") if comm.rank == 0 else first_answering(
        candidates, int(port), deadline)
    failed = torch.tensor([0 if chosen else 1], dtype=torch.int32, device=comm.device)
    comm.all_reduce(failed)  # every rank learns of a failure, and raises with the others
    if int(failed.item()) or chosen is None:
        raise RuntimeError(f"raw transport: {int(failed.item())} rank(s) reached no address of "
                           f"rank 0's store ({why or 'see those ranks'}); set MASTER_ADDR")
    if server is not None:
        return server
    return dist.TCPStore(chosen, int(port), comm.world_size, False, timeout=timeout)


def raw_transport_unavailable(comm: Communicator) -> str | None:
    """Why :func:`make_raw_transport` gives no transport for ``comm`` (a sentence), or None.

    There is none for backends other than gloo, nccl and mpi, nor for mpi on a CUDA device when
    the MPI library is not CUDA-aware (``comm.cuda_aware`` False: mpi4py could not read the GPU
    buffer; gradcomm itself stages through host memory then).
    """
    backend = comm.backend
    if backend in ("gloo", "nccl"):
        return None
    if backend == "mpi":
        if comm.device.type == "cpu" or bool(getattr(comm, "cuda_aware", False)):
            return None
        return (f"MPI is not CUDA-aware here, so mpi4py cannot take {comm.device} buffers "
                "(gradcomm stages them through host memory)")
    return f"no raw transport is measured for the {backend} backend"


def make_raw_transport(comm: Communicator, timeout: float = 300.0) -> RawTransport | None:
    """The raw transport under ``comm``'s backend, on its device, or None when there is none.

    ``gloo``/``nccl``: :class:`TorchDistRaw`; ``mpi``: :class:`MPIRaw`. None (the reason:
    :func:`raw_transport_unavailable`) for other backends and for a non-CUDA-aware MPI on CUDA.
    """
    backend = comm.backend
    if raw_transport_unavailable(comm) is not None:
        return None
    if backend in ("gloo", "nccl"):
        return TorchDistRaw(backend, comm, timeout)
    if backend == "mpi":
        return MPIRaw()
    return None


#: What run_sweep can report (see its ``stat`` argument).
_STATS = ("median", "min", "call-median")


def _no_sync() -> None:
    pass


def _device_sync(device: torch.device) -> Callable[[], None]:
    """What waits for ``device``'s queued work: torch.cuda.synchronize on CUDA, else nothing."""
    if device.type == "cuda":
        return functools.partial(torch.cuda.synchronize, device)
    return _no_sync


def _timed(
    fn: Callable[[], object], iters: int, barrier: Callable[[], object],
    sync: Callable[[], None] = _no_sync,
) -> list[float]:
    """Per-call times of ``iters`` back-to-back calls after a barrier (their sum is the loop's).

    ``sync`` runs before the barrier and after every call, so on a GPU each time covers the
    finished collective, not only its launch.
    """
    clock = time.perf_counter
    sync()
    barrier()
    sync()
    out = []
    last = clock()
    for _ in range(iters):
        fn()
        sync()
        now = clock()
        out.append(now - last)
        last = now
    return out


def _expected(op: ReduceOp, world_size: int) -> float:
    # Rank r contributes (r % 2) + 1: ranks alternate 1, 2.
    twos = world_size // 2
    if op is ReduceOp.SUM:
        return float(world_size + twos)
    if op is ReduceOp.AVG:
        return (world_size + twos) / world_size
    if op is ReduceOp.PRODUCT:
        return float(2**twos)
    if op is ReduceOp.MIN:
        return 1.0
    return 2.0 if world_size > 1 else 1.0


def _count_wrong(tensor: torch.Tensor, op: ReduceOp, world_size: int) -> int:
    want = _expected(op, world_size)
    if tensor.is_floating_point():
        target = torch.tensor(want, dtype=torch.float64).to(tensor.device, tensor.dtype)
        tol = 4 * torch.finfo(tensor.dtype).eps
        ok = torch.isclose(tensor.double(), target.double(), rtol=tol, atol=0.0)
    else:  # integers wrap as the transport's arithmetic does
        target = torch.tensor(int(want), dtype=torch.int64).to(tensor.device, tensor.dtype)
        ok = tensor == target
    return int((~ok).sum())


def measure(
    comm: Communicator, ours: Callable[[], object], raw: Callable[[], object] | None, *,
    iters: int, warmup: int, repeats: int, stat: str, sync: Callable[[], None] = _no_sync,
) -> tuple[float, float | None]:
    """Seconds per call of ``ours`` and ``raw`` (None: not measured), as :func:`run_sweep` times.

    ``warmup`` untimed calls of each, then ``repeats`` interleaved rounds of ``iters`` calls
    (the order swapped every round); per rank the mean per call of each round and the median
    call, then the maximum over ranks (an all-reduce on ``comm``), then ``stat`` over rounds.
    Call on every rank.
    """
    variants: list[tuple[str, Callable[[], object]]] = [("ours", ours)]
    if raw is not None:
        variants.append(("raw", raw))
    for _ in range(warmup):
        for _, fn in variants:
            fn()
    calls: dict[str, list[list[float]]] = {name: [] for name, _ in variants}
    for rep in range(repeats):
        order = variants if rep % 2 == 0 else variants[::-1]
        for name, fn in order:
            calls[name].append(_timed(fn, iters, comm.barrier, sync))
    local = []
    for name in ("ours", "raw"):
        rounds = calls.get(name, [[0.0]] * repeats)
        local += [statistics.fmean(r) for r in rounds]
        local.append(statistics.median(t for r in rounds for t in r))
    times = torch.tensor(local, dtype=torch.float64, device=comm.device)
    comm.all_reduce(times, ReduceOp.MAX)
    times = times.cpu()
    per = repeats + 1
    picked = []
    for k in (0, 1):
        means = times[k * per: k * per + repeats].tolist()
        call_median = float(times[k * per + repeats])
        picked.append(call_median if stat == "call-median"
                      else min(means) if stat == "min" else statistics.median(means))
    return picked[0], (picked[1] if raw is not None else None)


def run_sweep(
    comm: Communicator,
    sizes: Sequence[int],
    dtype: torch.dtype,
    op: ReduceOp | str = ReduceOp.SUM,
    *,
    iters: int = 20,
    warmup: int = 5,
    repeats: int = 3,
    raw: RawTransport | None = None,
    progress: Callable[[SweepRow], Any] | None = None,
    stat: str = "median",
) -> list[SweepRow]:
    """Time ``comm.all_reduce`` (and ``raw``'s) for every size; call on every rank.

    Args:
        comm: the communicator under test; the buffers are made on ``comm.device`` (CUDA:
            synchronised around every timed call).
        sizes: message sizes in bytes (multiples of the element size; see ``size_sweep``).
        dtype: element type of the buffers.
        op: reduction op.
        iters: timed calls per round (nccl-tests' ``-n``).
        warmup: untimed calls before the first round (nccl-tests' ``-w``).
        repeats: interleaved rounds of (gradcomm, raw); the time is the max over ranks of
            ``stat`` of each rank's times.
        raw: the transport to compare with (taking tensors on ``comm.device``), or None to skip
            the raw column.
        progress: called on every rank with each finished row.
        stat: ``"median"`` (default) or ``"min"`` over rounds of the mean per call, or
            ``"call-median"``: the median of every single call's time, which, like the minimum,
            filters out calls slowed by other processes on a shared machine.

    Returns:
        One :class:`SweepRow` per size, identical on every rank.

    Raises:
        ValueError: ``iters``, ``repeats`` < 1, ``warmup`` < 0, a size that is not a positive
            multiple of the element size, or an unknown ``stat``.
        TypeError, ValueError, RuntimeError: as :meth:`Communicator.all_reduce`.
    """
    op = ReduceOp.coerce(op)
    if iters < 1 or repeats < 1 or warmup < 0:
        raise ValueError(
            f"need iters >= 1, repeats >= 1, warmup >= 0; got {iters}, {repeats}, {warmup}"
        )
    if stat not in _STATS:
        raise ValueError(f"stat must be one of {', '.join(_STATS)}, got {stat!r}")
    elem = torch.empty((), dtype=dtype).element_size()
    for size in sizes:
        if size < elem or size % elem:
            raise ValueError(f"size {size} is not a positive multiple of {dtype}'s {elem} bytes")
    use_raw = raw is not None and raw.supports(dtype, op)
    n = comm.world_size
    device = comm.device
    sync = _device_sync(device)
    rows: list[SweepRow] = []
    for size in sizes:
        count = size // elem
        fill = torch.ones if op is ReduceOp.PRODUCT else torch.zeros
        buf = fill(count, dtype=dtype, device=device)

        ours = functools.partial(comm.all_reduce, buf, op)
        raw_fn = functools.partial(raw.all_reduce, buf, op) if raw is not None and use_raw else None
        t_ours, t_raw = measure(comm, ours, raw_fn, iters=iters, warmup=warmup, repeats=repeats,
                                stat=stat, sync=sync)

        buf.fill_(comm.rank % 2 + 1)
        comm.all_reduce(buf, op)
        wrong = _count_wrong(buf, op, n)
        row = SweepRow(
            backend=comm.backend,
            transport=raw.name if raw is not None else "none",
            size=size,
            count=count,
            type=dtype_name(dtype),
            redop=op_name(op),
            world_size=n,
            time_us=t_ours * 1e6,
            algbw=algbw(size, t_ours),
            busbw=busbw(size, t_ours, n),
            raw_time_us=None if t_raw is None else t_raw * 1e6,
            raw_algbw=None if t_raw is None else algbw(size, t_raw),
            raw_busbw=None if t_raw is None else busbw(size, t_raw, n),
            wrong=wrong,
        )
        if not all(math.isfinite(v) for v in (row.time_us, row.algbw, row.busbw)):
            raise RuntimeError(f"non-finite measurement at {size} bytes: {row}")
        rows.append(row)
        if progress is not None:
            progress(row)
        del buf
    return rows

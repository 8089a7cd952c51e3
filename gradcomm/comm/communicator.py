"""The abstract collective interface every backend implements.

Public methods (``all_reduce``, ``broadcast``, ``all_gather``, ``barrier``) validate their arguments
on every rank before any transport call, so bad input raises the same error everywhere instead of
hanging. They then handle what is common to all backends -- world_size 1 (no collective at all),
non-contiguous tensors (copy-in/copy-out), ``ReduceOp.AVG`` on backends without a native average
(SUM, then divide) -- and hand a contiguous tensor to one abstract method per collective, in the
manner of ``cupyx.distributed``'s communicator base class.
"""

from __future__ import annotations

import abc
import itertools
from collections.abc import Callable
from typing import ClassVar, Protocol

import torch

from .errors import brief
from .types import ReduceOp, Support
from .work import CompletedWork, Description, DescriptionLike, Work, writing_into

__all__ = ["Communicator", "CollectiveObserver"]


class CollectiveObserver(Protocol):
    """Told of every collective a :class:`Communicator` issues (e.g. :mod:`gradcomm.profiler`).

    Attach one as ``comm.profiler``; ``None`` (the default) costs one attribute test per call.
    """

    def collective_started(
        self, op: str, tensor: torch.Tensor | None, label: str | None, async_op: bool
    ) -> Callable[[], None]:
        """Called just before the transport starts ``op`` on contiguous ``tensor`` (the output
        for ``all_gather``, None for ``barrier``); returns a function run once at completion."""
        ...

    def communicator_closed(self) -> None:
        """Called once by :meth:`Communicator.close`, after the transport is released."""
        ...

    def step(self) -> None:
        """Marks the end of a training step (the gradient reducer may call it after each
        backward's all-reduces complete); later collectives count in the next step."""
        ...


def _check_call_args(async_op: object, label: object = None) -> None:
    """TypeError unless ``async_op`` is a bool and ``label`` a str or None (a truthy string such as
    ``"no"`` would otherwise silently make the call asynchronous)."""
    if async_op.__class__ is not bool:
        kind = type(async_op)  # numpy.bool prints as "bool": name its module too
        name = (kind.__name__ if kind.__module__ == "builtins"
                else f"{kind.__module__}.{kind.__name__}")
        raise TypeError(f"async_op must be a Python bool (True or False), got {name} {async_op!r}")
    if label is not None and not isinstance(label, str):
        raise TypeError(f"label must be a str or None, got {type(label).__name__}")


def _check_writable(tensor: torch.Tensor, opname: str) -> None:
    """Raise ValueError if some elements of ``tensor`` share one memory location (an
    ``expand()``-ed view, stride 0): a collective's result cannot be written into it (``copy_``
    would refuse after the transfer), so it is refused before, at every world size."""
    if tensor.numel() and not tensor.is_contiguous() and any(
        st == 0 and n > 1 for n, st in zip(tensor.shape, tensor.stride(), strict=True)
    ):
        raise ValueError(
            f"{opname}: the tensor has several elements at one memory location (stride 0, e.g. "
            f"from expand(); shape {tuple(tensor.shape)}, stride {tensor.stride()}); pass a "
            ".clone()"
        )


def _plain(tensor: torch.Tensor, written_by: str | None = None) -> torch.Tensor:
    """``tensor`` itself when a transport can use its memory as it is; else a contiguous copy.

    A copy is made for non-contiguous tensors and for the lazy negative and conjugate views
    (``t.conj().imag``, ``torch.Tensor.conj()``), which keep their sign in a bit of the tensor,
    not in memory: a transport reading raw memory would reduce the wrong values (MIN and MAX
    swapped). Callers copy the result back into ``tensor``, which honours the bits.

    Raises:
        ValueError: from :func:`_check_writable` when ``written_by`` (the collective's name) is
            given, i.e. the result will be written into ``tensor``.
    """
    if tensor.is_contiguous() and not tensor.is_neg() and not tensor.is_conj():
        return tensor
    if written_by is not None:
        _check_writable(tensor, written_by)
    return tensor.resolve_conj().resolve_neg().contiguous()


def _overlap(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether the memory of two contiguous tensors overlaps (by address, so also for separate
    storages over one buffer, e.g. two ``torch.from_numpy`` views of one array)."""
    a0, b0 = a.data_ptr(), b.data_ptr()
    return a0 < b0 + b.nbytes and b0 < a0 + a.nbytes


def flat_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """The memory of a contiguous ``tensor`` as a 1-D uint8 view (no copy).

    Shape ``(tensor.numel() * tensor.element_size(),)``. A one-element tensor counts as contiguous
    whatever its stride (``torch.zeros(2)[::2]`` has stride 2), which ``Tensor.view(torch.uint8)``
    rejects, so it is viewed with stride 1 first (the same single element).
    """
    flat = tensor.reshape(-1)
    if flat.numel() == 1 and flat.stride(0) != 1:
        flat = flat.as_strided((1,), (1,))
    return flat.view(torch.uint8)


class Communicator(abc.ABC):
    """A group of ``world_size`` processes that run collectives on tensors of one device type.

    All collectives work in place on the given tensor and preserve its dtype and shape. Each
    returns a :class:`~gradcomm.comm.Work`; with ``async_op=False`` (default) it is already
    complete. Every rank must call the same collectives in the same order with tensors of the same
    numel and dtype.

    After a wait times out, no transport can cancel the collective, and one issued behind it would
    wait for it: every new collective raises RuntimeError at once while the timed-out one is
    still pending (a late peer that catches up makes the communicator usable again; a collective
    that failed leaves it unusable).

    Args:
        rank: this process's index, ``0 <= rank < world_size``.
        world_size: number of processes.
        local_rank: index among the processes on this host.
        device: device the collectives' tensors live on (``cpu`` or ``cuda:<i>``).
        timeout: seconds a collective may take before :meth:`Work.wait` raises
            :class:`~gradcomm.CollectiveTimeoutError`; ``None`` waits forever.

    Raises:
        ValueError: rank, world_size or timeout out of range.
    """

    #: Name of the backend, as given to :func:`gradcomm.init` (``"gloo"``, ``"mpi"``, ...).
    backend: ClassVar[str] = "abstract"
    #: Reduction ops the transport performs itself; others are emulated by the base class.
    native_reduce_ops: ClassVar[frozenset[ReduceOp]] = frozenset(
        {ReduceOp.SUM, ReduceOp.MIN, ReduceOp.MAX, ReduceOp.PRODUCT}
    )

    def __init__(
        self,
        *,
        rank: int,
        world_size: int,
        local_rank: int,
        device: torch.device | str,
        timeout: float | None,
    ) -> None:
        if world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {world_size}")
        if not 0 <= rank < world_size:
            raise ValueError(f"rank must be in [0, {world_size}), got {rank}")
        if local_rank < 0:
            raise ValueError(f"local_rank must be >= 0, got {local_rank}")
        if timeout is not None and timeout <= 0:
            raise ValueError(f"timeout must be a positive number of seconds or None, got {timeout}")
        self._rank = rank
        self._world_size = world_size
        self._local_rank = local_rank
        self._device = torch.device(device)
        self._timeout = timeout
        self._closed = False
        # A collective whose wait timed out: new ones are refused until it completes. Works are
        # told of _note_stalled through this bound method, made once rather than per collective.
        self._stalled: Work | None = None
        self._stall_note = self._note_stalled
        self._seq = itertools.count()
        # Per (dtype, device) of the tensors seen: the error to raise for them (None: none) and
        # the tail of their descriptions, so a collective's device and dtype checks cost one dict
        # lookup. ``tensor.device.type`` makes a new str on each read, which between two
        # collectives (cold caches) is a visible share of a call (benchmarks/call_overhead.py).
        self._tensor_kinds: dict[
            tuple[torch.dtype, torch.device], tuple[type[Exception] | None, str, str]
        ] = {}
        #: Optional :class:`CollectiveObserver` told of every collective (None: off).
        self.profiler: CollectiveObserver | None = None

    # ------------------------------------------------------------------ properties
    @property
    def rank(self) -> int:
        """Index of this process in the group, ``0 <= rank < world_size``."""
        return self._rank

    @property
    def world_size(self) -> int:
        """Number of processes in the group."""
        return self._world_size

    @property
    def local_rank(self) -> int:
        """Index of this process among those on the same host."""
        return self._local_rank

    @property
    def device(self) -> torch.device:
        """Device of the tensors this communicator reduces."""
        return self._device

    @property
    def timeout(self) -> float | None:
        """Default timeout of every collective, in seconds (``None``: wait forever)."""
        return self._timeout

    @property
    def closed(self) -> bool:
        """True after :meth:`close`."""
        return self._closed

    @property
    def background_progress(self) -> bool:
        """Whether a collective started with ``async_op=True`` advances while the caller computes.

        True when the transport moves data on its own -- a device stream (NCCL), or a transport
        thread with a CPU core to itself (gloo with >= 2 cores per process on the host) -- and False
        when it advances only inside calls into it (MPI without an asynchronous progress thread) or
        its thread must share the training thread's only core. Only then can overlapping the
        all-reduce with backward hide its time; :class:`~gradcomm.GradientReducer` picks its first
        bucket size from it. This base implementation returns False.
        """
        return False

    @property
    def cheap_collectives(self) -> bool:
        """Whether one more collective costs less than a pass over a few MiB of the tensor's memory.

        :class:`~gradcomm.GradientReducer` then reduces large gradients in place, one collective
        each, instead of copying them into a shared bucket (its ``in_place_min_mb``). True for
        MPI on host memory (a small all-reduce costs microseconds, and MPI reduces the tensor where
        it lies); False here, and so for gloo (a small all-reduce costs a hundred times more, with
        a handoff to the transport's thread), where the extra collectives cost more than the
        copies they save.
        """
        return False

    # ------------------------------------------------------------------ capability
    def supports(self, dtype: torch.dtype, device: torch.device | str | None = None) -> Support:
        """Say how this backend reduces tensors of ``dtype`` on ``device`` (default: its device).

        Complex dtypes get the answer for their real dtype (complex64: float32), with a reason
        saying so: :meth:`all_reduce` reduces them (SUM and AVG only) as their real view.

        Raises:
            TypeError: ``dtype`` is not a :class:`torch.dtype` (e.g. the string ``"float32"``),
                or ``device`` is not None, a str or a :class:`torch.device`.
            ValueError: ``device`` is a string torch does not know.
            RuntimeError: the communicator is closed (its transport may be gone; the answer
                would describe a communicator that can no longer be used).
        """
        if not isinstance(dtype, torch.dtype):
            raise TypeError(f"supports() takes a torch.dtype, got {type(dtype).__name__} "
                            f"{dtype!r} (e.g. torch.float32)")
        if device is not None and not isinstance(device, torch.device):
            if not isinstance(device, str):
                raise TypeError(f"supports() takes a device as a str or torch.device, got "
                                f"{type(device).__name__} {device!r}")
            try:
                device = torch.device(device)
            except RuntimeError as exc:  # torch's message lists the device types it knows
                raise ValueError(f"device {device!r} is not a torch device: {exc}") from None
        if self._closed:
            raise RuntimeError(f"{self.backend} communicator is closed")
        if dtype.is_complex:
            real = torch.empty(0, dtype=dtype).real.dtype
            part = self._supports(real, device)
            if not part.is_supported:
                return part
            why = (f"{dtype} is reduced (SUM or AVG only) as its {real} real view "
                   "(torch.view_as_real)")
            return Support(part.level, f"{why}; {part.reason}" if part.reason else why,
                           part.transfer_dtype)
        return self._supports(dtype, device)

    @abc.abstractmethod
    def _supports(self, dtype: torch.dtype, device: torch.device | str | None) -> Support:
        """The backend's answer for :meth:`supports` (``dtype`` is a torch.dtype)."""

    # ------------------------------------------------------------------ collectives
    def all_reduce(
        self,
        tensor: torch.Tensor,
        op: ReduceOp | str = ReduceOp.SUM,
        *,
        async_op: bool = False,
        label: str | None = None,
    ) -> Work:
        """Reduce ``tensor`` element-wise across all ranks, in place; every rank gets the result.

        Args:
            tensor: any shape, on this communicator's device type; non-contiguous tensors are
                handled by a contiguous copy that is written back on completion. Complex tensors
                are reduced (SUM or AVG) as their real view.
            op: a :class:`ReduceOp` or its name; ``AVG`` needs a floating-point dtype.
            async_op: return at once with a pending :class:`Work`.
            label: names the data in error messages and profiles (e.g. ``"bucket 3"``).

        Returns:
            A :class:`Work`; ``tensor`` holds the result after ``Work.wait()``.

        Raises:
            TypeError: not a tensor, sparse, unsupported dtype, ``AVG`` on a non-float dtype,
                ``async_op`` not a bool or ``label`` not a str.
            ValueError: unknown op name, a tensor on the wrong device type, or one whose
                elements share memory (``expand()``).
            RuntimeError: the communicator is closed.
        """
        if op.__class__ is not ReduceOp:  # the common case skips a classmethod call
            op = ReduceOp.coerce(op)
        _check_call_args(async_op, label)
        self._check_open()
        try:
            tail = self._check_tensor(tensor, "all_reduce")
        except TypeError:
            if not (isinstance(tensor, torch.Tensor) and tensor.is_complex()):
                raise
            return self._all_reduce_complex(tensor, op, async_op, label)
        if op is ReduceOp.AVG and not (tensor.is_floating_point() or tensor.is_complex()):
            raise TypeError(
                f"ReduceOp.AVG needs a floating-point tensor, got {tensor.dtype}; "
                "use ReduceOp.SUM and divide, or cast first"
            )
        numel = tensor.numel()
        if self._world_size == 1 or numel == 0:
            _check_writable(tensor, "all_reduce")
            return CompletedWork(target=tensor)
        buf = _plain(tensor, "all_reduce")
        desc = Description("all_reduce", next(self._seq), numel, tail, op, label)
        done = (
            None
            if self.profiler is None
            else self.profiler.collective_started("all_reduce", buf, label, async_op)
        )
        if op is ReduceOp.SUM or op in self.native_reduce_ops:  # SUM first: no enum hashing
            work = self._all_reduce(buf, op, desc)
        elif op is ReduceOp.AVG:
            work = self._emulated_avg(buf, desc)
        else:  # pragma: no cover - a backend that lacks SUM is a programming error
            raise TypeError(f"{self.backend} backend does not support {op}")
        if done is not None:
            work.add_callback(done)
        if buf is not tensor:
            work.add_callback(lambda: tensor.copy_(buf))
        return self._finish(work, async_op, tensor)

    def _all_reduce_complex(
        self, tensor: torch.Tensor, op: ReduceOp, async_op: bool, label: str | None
    ) -> Work:
        """SUM or AVG of a complex tensor as the same op on its real view
        (:func:`torch.view_as_real`: real and imaginary parts are summed independently), as
        torch.distributed does for backends without complex support. No transport here reduces
        complex numbers, and MIN, MAX and PRODUCT are not element-wise on that view."""
        if op not in (ReduceOp.SUM, ReduceOp.AVG):
            raise TypeError(f"all_reduce: complex tensors ({tensor.dtype}) can be reduced with "
                            f"SUM or AVG, not {op.name}")
        # A conjugate view has no real view: reduce its resolved copy and write that back.
        buf = tensor.resolve_conj() if tensor.is_conj() else tensor
        work = self.all_reduce(torch.view_as_real(buf), op, async_op=True, label=label)
        if buf is not tensor:
            if work.is_completed():
                with writing_into(tensor):
                    tensor.copy_(buf)
            else:
                work.add_callback(lambda: tensor.copy_(buf))
        return self._finish(work, async_op, tensor)

    def _emulated_avg(self, buf: torch.Tensor, desc: DescriptionLike) -> Work:
        """AVG as SUM then divide. 16-bit floats are summed in float32 and rounded once at the
        end, so an average of in-range values never overflows (fp16 40000 + 40000 would) and
        matches the float32 reference cast back to the dtype."""
        world_size = self._world_size
        if buf.dtype in (torch.float16, torch.bfloat16):
            wide = buf.to(torch.float32)
            work = self._all_reduce(wide, ReduceOp.SUM, desc)
            work.add_callback(lambda: buf.copy_(wide.div_(world_size)))
        else:
            work = self._all_reduce(buf, ReduceOp.SUM, desc)
            work.add_callback(lambda: buf.div_(world_size))
        return work

    def broadcast(self, tensor: torch.Tensor, src: int = 0, *, async_op: bool = False) -> Work:
        """Copy rank ``src``'s ``tensor`` into ``tensor`` on every other rank, in place.

        Args:
            tensor: same shape and dtype on every rank.
            src: rank that sends, ``0 <= src < world_size``.
            async_op: return at once with a pending :class:`Work`.

        Raises:
            TypeError: not a tensor, sparse, or ``async_op`` not a bool.
            ValueError: ``src`` out of range, wrong device, or elements that share memory
                (``expand()``).
            RuntimeError: the communicator is closed.
        """
        _check_call_args(async_op)
        self._check_open()
        tail = self._check_tensor(tensor, "broadcast", reduction=False)
        if isinstance(src, bool) or not isinstance(src, int):
            raise TypeError(f"src must be an int rank, got {type(src).__name__}")
        if not 0 <= src < self._world_size:
            raise ValueError(f"src must be in [0, {self._world_size}), got {src}")
        if self._world_size == 1 or tensor.numel() == 0:
            _check_writable(tensor, "broadcast")
            return CompletedWork(target=tensor)
        buf = _plain(tensor, "broadcast")
        done = (
            None
            if self.profiler is None
            else self.profiler.collective_started("broadcast", buf, None, async_op)
        )
        desc = Description("broadcast", next(self._seq), buf.numel(), tail, f"src={src}")
        work = self._broadcast(buf, src, desc)
        if done is not None:
            work.add_callback(done)
        if buf is not tensor:
            work.add_callback(lambda: tensor.copy_(buf))
        return self._finish(work, async_op, tensor)

    def all_gather(
        self, output: torch.Tensor, input: torch.Tensor, *, async_op: bool = False
    ) -> Work:
        """Gather every rank's ``input`` into ``output``, concatenated in rank order.

        Semantics of :func:`torch.distributed.all_gather_into_tensor`: ``output`` holds
        ``world_size * input.numel()`` elements of ``input``'s dtype; rank ``r``'s data lands in
        ``output.view(-1)[r * n:(r + 1) * n]`` with ``n = input.numel()``.

        Raises:
            TypeError: not tensors, dtypes differ, or ``async_op`` not a bool.
            ValueError: ``output.numel()`` is not ``world_size * input.numel()``, wrong device,
                or ``output``'s elements share memory (``expand()``).
            RuntimeError: closed.
        """
        _check_call_args(async_op)
        self._check_open()
        tail = self._check_tensor(input, "all_gather", reduction=False)
        self._check_tensor(output, "all_gather", reduction=False)
        if output.dtype != input.dtype:
            raise TypeError(f"all_gather output dtype {output.dtype} != input dtype {input.dtype}")
        if output.numel() != self._world_size * input.numel():
            raise ValueError(
                f"all_gather output must hold world_size * input.numel() = "
                f"{self._world_size} * {input.numel()} elements, got {output.numel()}"
            )
        if self._world_size == 1 or input.numel() == 0:
            _check_writable(output, "all_gather")
            with writing_into(output):
                output.copy_(input.reshape(output.shape))
            return CompletedWork(target=output)
        src = _plain(input)
        out = _plain(output, "all_gather")
        if _overlap(src, out):
            # input is (part of) output, e.g. this rank's own slot: transports read input while
            # writing output, and MPI rejects aliased buffers, so send a copy.
            src = src.clone()
        done = (
            None
            if self.profiler is None
            else self.profiler.collective_started("all_gather", out, None, async_op)
        )
        desc = Description("all_gather", next(self._seq), src.numel(), tail)
        work = self._all_gather(out.view(-1), src.view(-1), desc)
        if done is not None:
            work.add_callback(done)
        if out is not output:
            work.add_callback(lambda: output.copy_(out))
        return self._finish(work, async_op, output)

    def barrier(self) -> None:
        """Block until every rank has called :meth:`barrier` (within the timeout).

        Raises:
            CollectiveTimeoutError: not every rank arrived within the timeout.
            RuntimeError: the communicator is closed.
        """
        self._check_open()
        if self._world_size == 1:
            return
        done = (
            None
            if self.profiler is None
            else self.profiler.collective_started("barrier", None, None, False)
        )
        work = self._barrier(
            f"barrier #{next(self._seq)} ({self.backend}, rank {self._rank}/{self._world_size})"
        )
        if done is not None:
            work.add_callback(done)
        self._finish(work, False, None)

    def close(self) -> None:
        """Release the transport's resources; later collectives raise RuntimeError. Idempotent."""
        if not self._closed:
            self._closed = True
            self._close()
            if self.profiler is not None:
                self.profiler.communicator_closed()

    def __enter__(self) -> Communicator:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return (
            f"<{type(self).__name__} backend={self.backend} rank={self._rank}/{self._world_size} "
            f"local_rank={self._local_rank} device={self._device}>"
        )

    # ------------------------------------------------------------------ backend hooks
    @abc.abstractmethod
    def _all_reduce(self, tensor: torch.Tensor, op: ReduceOp, description: DescriptionLike) -> Work:
        """Start an all-reduce of a contiguous, non-empty tensor with an op in native_reduce_ops."""

    @abc.abstractmethod
    def _broadcast(self, tensor: torch.Tensor, src: int, description: DescriptionLike) -> Work:
        """Start a broadcast of a contiguous, non-empty tensor."""

    @abc.abstractmethod
    def _all_gather(
        self, output: torch.Tensor, input: torch.Tensor, description: DescriptionLike
    ) -> Work:
        """Start an all-gather of contiguous 1-D tensors (``output`` is world_size times longer)."""

    @abc.abstractmethod
    def _barrier(self, description: DescriptionLike) -> Work:
        """Start a barrier."""

    @abc.abstractmethod
    def _close(self) -> None:
        """Release the transport (called once)."""

    # ------------------------------------------------------------------ helpers
    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError(f"{self.backend} communicator is closed")
        if self._stalled is not None:
            self._check_stalled(self._stalled)

    def _note_stalled(self, work: Work) -> None:
        if self._stalled is None:
            self._stalled = work

    def _check_stalled(self, stalled: Work) -> None:
        """Forget ``stalled`` once it has completed (running its callbacks); raise RuntimeError
        while it is pending, or for good when it failed."""
        try:
            done = stalled.is_completed()
        except RuntimeError as exc:
            raise RuntimeError(
                f"{self.backend} communicator is unusable: {brief(stalled.description, 90)}, "
                f"which timed out, then failed: {brief(str(exc), 60)}"
            ) from exc
        if not done:
            raise RuntimeError(
                f"{self.backend} communicator is unusable while {brief(stalled.description, 95)}"
                ", which timed out, is still pending; wait() on its Work again"
            )
        self._stalled = None

    def _check_tensor(self, tensor: object, opname: str, *, reduction: bool = True) -> str:
        """Raise on a tensor this communicator cannot take; return its description tail."""
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"{opname} expects a torch.Tensor, got {type(tensor).__name__}")
        if tensor.layout is not torch.strided:
            raise TypeError(
                f"{opname} expects a dense (strided) tensor, got layout {tensor.layout}"
            )
        kind = self._tensor_kinds.get((tensor.dtype, tensor.device))
        if kind is None:
            kind = self._tensor_kind(tensor)
        error, reason, tail = kind
        if error is not None and (reduction or error is ValueError):
            raise error(f"{opname}: {reason}")
        return tail

    def _tensor_kind(self, tensor: torch.Tensor) -> tuple[type[Exception] | None, str, str]:
        """Classify (and cache) ``tensor``'s (dtype, device): (error class or None, why, tail).

        ValueError: a device type other than this communicator's (raised for every collective);
        TypeError: a dtype :meth:`supports` calls unsupported (raised for reductions only).
        """
        dtype, device = tensor.dtype, tensor.device
        tail = f" {dtype} on {device} ({self.backend}, rank {self._rank}/{self._world_size})"
        error: type[Exception] | None = None
        if device.type != self._device.type:
            error = ValueError
            reason = (f"tensor is on {device}, but this {self.backend} communicator works on "
                      f"{self._device}")
        else:
            support = self._supports(dtype, device)  # complex: UNSUPPORTED, see all_reduce
            reason = support.reason
            if not support.is_supported:
                error = TypeError
        kind = self._tensor_kinds[(dtype, device)] = (error, reason, tail)
        return kind

    def _finish(self, work: Work, async_op: bool, target: torch.Tensor | None) -> Work:
        """Wait unless ``async_op``; callbacks write into ``target`` (see :func:`writing_into`;
        None: under :func:`torch.no_grad`)."""
        if target is not None:  # also for callbacks the caller adds later (inference tensors)
            work._target = target
        work._on_timeout = self._stall_note
        if not async_op:
            work.wait()
        return work

"""The abstract collective interface every backend implements.

Every public collective -- ``all_reduce``, ``broadcast``, ``all_gather``, ``barrier`` here;
``reduce_scatter`` and ``all_to_all`` (:mod:`~gradcomm.comm._shard_ops`), ``reduce``, ``gather``
and ``scatter`` (:mod:`~gradcomm.comm._rooted_ops`) and the object collectives
(:mod:`~gradcomm.comm._object_ops`) in mixins -- takes one path: its arguments are checked on
every rank before any transport call (:mod:`~gradcomm.comm._validation`), so bad input raises the
same error everywhere instead of hanging; what is common to all backends is handled in the base
classes -- world_size 1 (no collective at all), non-contiguous tensors (copy-in/copy-out,
:mod:`~gradcomm.comm._tensors`), ``ReduceOp.AVG`` on backends without a native average and
complex tensors (:mod:`~gradcomm.comm._emulation`) -- and ``_issue``
(:mod:`~gradcomm.comm._issue`) hands contiguous tensors to one backend hook per collective
(``_all_reduce``, ``_broadcast``, ...), in the manner of ``cupyx.distributed``'s communicator base
class, tells the profiler, and lets a timed-out collective block the next ones
(:mod:`~gradcomm.comm._stalls`). A new collective is a check in ``validation``, a public method
that calls ``_issue`` (in a mixin module), and one hook per backend.
"""

from __future__ import annotations

import abc
import itertools
from typing import ClassVar

import torch

from ._consistency import ConsistencyCheck, DebugLevel, DebugSetting
from ._emulation import average, reduce_complex
from ._issue import IssuePath
from ._object_ops import ObjectOps
from ._p2p import PointToPoint
from ._rooted_ops import RootedOps
from ._shard_ops import ShardOps
from ._split import Splitting
from ._stalls import StallGuard
from ._support import collective_support
from ._tensors import flat, overlap, plain
from ._tensors import flat_bytes as flat_bytes  # re-exported: the backends' byte views
from ._validation import (
    TensorChecks,
    check_all_gather,
    check_avg,
    check_call_args,
    check_src,
    check_supports_args,
    check_writable,
)
from .observer import CollectiveObserver
from .types import Collective, ReduceOp, Support
from .work import CompletedWork, Description, DescriptionLike, Work, writing_into

__all__ = ["Communicator", "CollectiveObserver"]


class Communicator(ShardOps, RootedOps, ObjectOps, PointToPoint, Splitting, IssuePath,
                   DebugSetting, abc.ABC):
    """A group of ``world_size`` processes that run collectives on tensors of one device type.

    All collectives work in place on the given tensor and preserve its dtype and shape. Each
    returns a :class:`~gradcomm.comm.Work`; with ``async_op=False`` (default) it is already
    complete. Every rank must call the same collectives in the same order with tensors of the same
    numel and dtype. Point-to-point transfers are :class:`~gradcomm.comm._p2p.PointToPoint`'s,
    sub-communicators :class:`~gradcomm.comm._split.Splitting`'s.

    While a collective whose wait timed out is still pending, every new one raises RuntimeError
    at once (see :mod:`~gradcomm.comm._stalls`). The constructor's arguments (rank, world_size,
    local_rank, device, timeout) and their checks are :class:`~gradcomm.comm._group.GroupMember`'s.
    """

    #: Name of the backend, as given to :func:`gradcomm.init` (``"gloo"``, ``"mpi"``, ...).
    backend: ClassVar[str] = "abstract"
    #: Reduction ops the transport performs itself; others are emulated by the base class.
    native_reduce_ops: ClassVar[frozenset[ReduceOp]] = frozenset({ReduceOp.SUM, ReduceOp.MIN,
                                                                  ReduceOp.MAX, ReduceOp.PRODUCT})

    def __init__(self, *, rank: int, world_size: int, local_rank: int,
                 device: torch.device | str, timeout: float | None) -> None:
        super().__init__(rank=rank, world_size=world_size, local_rank=local_rank, device=device,
                         timeout=timeout)
        self._closed = False
        self._seq = itertools.count()
        self._p2p_seq = itertools.count()  # transfers, numbered apart from collectives
        self._stalls = StallGuard(self.backend)
        self._stall_note = self._stalls.note  # bound once, not per collective (Work.bind)
        self._checks = TensorChecks(self.backend, self._device, f"rank {rank}/{world_size}",
                                    self._supports)
        self._kinds = self._checks.kinds  # the cache itself: one lookup less per call
        self._plain_kinds = self._checks.plain
        self._on_cpu = self._device.type == "cpu"
        self._consistency = ConsistencyCheck(self._all_gather, self._complete, world_size, device)
        self._plain_checks = type(self)._check_tensor is Communicator._check_tensor
        self.debug = DebugLevel.OFF  # sets _cached_checks
        #: Optional :class:`CollectiveObserver` told of every collective (None: off).
        self.profiler: CollectiveObserver | None = None

    @property
    def closed(self) -> bool:
        """True after :meth:`close`."""
        return self._closed

    @property
    def background_progress(self) -> bool:
        """Whether a collective started with ``async_op=True`` advances while the caller computes.

        True when the transport moves data on its own (a device stream; a transport thread with a
        CPU core to itself); False when it advances only inside calls into it (MPI without a
        progress thread) or shares the training thread's only core, and in this base class. Only
        then can overlapping hide the all-reduce's time; :class:`~gradcomm.GradientReducer`
        sizes its first bucket by it."""
        return False

    @property
    def cheap_collectives(self) -> bool:
        """Whether one more collective costs less than a pass over a few MiB of the tensor's memory.

        :class:`~gradcomm.GradientReducer` then reduces large gradients in place, one collective
        each, instead of copying them into a shared bucket (its ``in_place_min_mb``): True for
        MPI on host memory, False here and so for gloo (a handoff to the transport's thread)."""
        return False

    def supports(self, dtype: torch.dtype, device: torch.device | str | None = None,
                 collective: Collective | str = Collective.ALL_REDUCE) -> Support:
        """Say how this backend runs ``collective`` on tensors of ``dtype`` on ``device``.

        ``device`` defaults to the communicator's; ``collective`` (a :class:`Collective` or its
        name, e.g. ``"reduce_scatter"``) to all_reduce. Reductions answer per dtype; collectives
        that move data (broadcast, all_gather, all_to_all, gather, scatter) take any dtype as
        bytes. Where a backend lacks an op natively the answer is EMULATED_SLOW and says how.
        Complex dtypes get all_reduce's answer for their real dtype (complex64: float32), with a
        reason saying so; the other reductions do not take them.

        Raises:
            TypeError: ``dtype`` is not a :class:`torch.dtype` (e.g. the string ``"float32"``),
                ``device`` is not None, a str or a :class:`torch.device`, or ``collective``
                neither a Collective nor a str.
            ValueError: ``device`` is a string torch does not know, or ``collective`` a name of
                no collective.
            RuntimeError: the communicator is closed (its transport may be gone).
        """
        dev = check_supports_args(dtype, device)
        coll = Collective.coerce(collective)
        if self._closed:
            raise RuntimeError(f"{self.backend} communicator is closed")
        return collective_support(coll, dtype, dev, self)

    @abc.abstractmethod
    def _supports(self, dtype: torch.dtype, device: torch.device | str | None) -> Support:
        """The backend's answer for :meth:`supports` (``dtype`` is a torch.dtype)."""

    # ------------------------------------------------------------------ collectives
    def all_reduce(self, tensor: torch.Tensor, op: ReduceOp | str = ReduceOp.SUM, *,
                   async_op: bool = False, label: str | None = None) -> Work:
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
        if op is ReduceOp.SUM and (label is None or label.__class__ is str):
            tail = self._fast_tail(tensor, async_op)  # the short path: see _issue
            if tail is not None:
                desc = Description("all_reduce", next(self._seq), tensor.numel(), tail, op, label)
                return self._complete(self._all_reduce(tensor, op, desc), async_op, tensor)
        return self._checked_all_reduce(tensor, op, async_op, label)

    def _checked_all_reduce(self, tensor: torch.Tensor, op: ReduceOp | str, async_op: bool,
                            label: str | None) -> Work:
        """:meth:`all_reduce` with its full checks (every call that raises comes here)."""
        if op.__class__ is not ReduceOp:  # the common case skips a classmethod call
            op = ReduceOp.coerce(op)
        check_call_args(async_op, label)
        self._check_open()
        try:
            tail = self._check_tensor(tensor, "all_reduce")
        except TypeError:
            if not (isinstance(tensor, torch.Tensor) and tensor.is_complex()):
                raise
            work = reduce_complex(self.all_reduce, tensor, op, label)
            return self._complete(work, async_op, tensor)
        check_avg(tensor, op)
        numel = tensor.numel()
        if self._world_size == 1 or numel == 0:
            check_writable(tensor, "all_reduce")
            return CompletedWork(target=tensor)
        buf = plain(tensor, "all_reduce")
        desc = Description("all_reduce", next(self._seq), numel, tail, op, label)
        if op is ReduceOp.SUM or op in self.native_reduce_ops:  # SUM first: no enum hashing
            return self._issue("all_reduce", self._all_reduce, (buf, op), desc, tensor, buf,
                               label, async_op)
        if op is ReduceOp.AVG:
            return self._issue("all_reduce", average, (self._all_reduce, self._world_size, buf),
                               desc, tensor, buf, label, async_op)
        raise TypeError(f"{self.backend} backend does not support {op}")  # pragma: no cover

    def broadcast(self, tensor: torch.Tensor, src: int = 0, *, async_op: bool = False) -> Work:
        """Copy rank ``src``'s ``tensor`` into ``tensor`` on every other rank, in place.

        Args:
            tensor: same shape and dtype on every rank.
            src: rank that sends, ``0 <= src < world_size``.
            async_op: return at once with a pending :class:`Work`.

        Raises:
            TypeError: not a tensor, sparse, or ``async_op`` not a bool.
            ValueError: ``src`` out of range, wrong device, or elements sharing memory (expand()).
            RuntimeError: the communicator is closed.
        """
        tail = self._fast_tail(tensor, async_op)  # the short path: see _issue
        if tail is not None and src.__class__ is int and 0 <= src < self._world_size:
            desc = Description("broadcast", next(self._seq), tensor.numel(), tail, f"src={src}",
                               root=src)
            return self._complete(self._broadcast(tensor, src, desc), async_op, tensor)
        check_call_args(async_op)
        self._check_open()
        tail = self._check_tensor(tensor, "broadcast", reduction=False)
        check_src(src, self._world_size)
        if self._world_size == 1 or tensor.numel() == 0:
            check_writable(tensor, "broadcast")
            return CompletedWork(target=tensor)
        buf = plain(tensor, "broadcast")
        desc = Description("broadcast", next(self._seq), buf.numel(), tail, f"src={src}", root=src)
        return self._issue("broadcast", self._broadcast, (buf, src), desc, tensor, buf, None,
                           async_op)

    def all_gather(self, output: torch.Tensor, input: torch.Tensor,
                   output_split_sizes: list[int] | None = None, *,
                   async_op: bool = False) -> Work:
        """Gather every rank's ``input`` into ``output``, concatenated in rank order.

        Semantics of :func:`torch.distributed.all_gather_into_tensor`: ``output`` holds
        ``world_size * input.numel()`` elements of ``input``'s dtype; rank ``r``'s data lands in
        ``output.view(-1)[r * n:(r + 1) * n]`` with ``n = input.numel()``. With
        ``output_split_sizes`` (rank ``r``'s rows along dim 0, ``sum`` = ``output.shape[0]``) the
        ranks' first dimensions may differ (MPI's Allgatherv; see :meth:`_all_gather_uneven`).

        Raises:
            TypeError: not tensors, dtypes differ, or ``async_op`` not a bool.
            ValueError: ``output.numel()`` is not ``world_size * input.numel()``, wrong device,
                or ``output``'s elements share memory (``expand()``).
            RuntimeError: the communicator is closed.
        """
        tail = self._fast_tail(input, async_op)  # the short path: see _issue
        if (tail is not None and output_split_sizes is None
                and self._plain_tail(output) is not None and self._chunks_fit(output, input)):
            desc = Description("all_gather", next(self._seq), input.numel(), tail)
            work = self._all_gather(flat(output), flat(input), desc)
            return self._complete(work, async_op, output)
        check_call_args(async_op)
        self._check_open()
        if output_split_sizes is not None:
            return self._all_gather_uneven(output, input, output_split_sizes, async_op)
        tail = self._check_tensor(input, "all_gather", reduction=False)
        self._check_tensor(output, "all_gather", reduction=False)
        check_all_gather(output, input, self._world_size)
        if self._world_size == 1 or input.numel() == 0:
            check_writable(output, "all_gather")
            with writing_into(output):
                output.copy_(input.reshape(output.shape))
            return CompletedWork(target=output)
        src = plain(input)
        out = plain(output, "all_gather")
        if overlap(src, out):
            # input is (part of) output, e.g. this rank's own slot: transports read input while
            # writing output, and MPI rejects aliased buffers, so send a copy.
            src = src.clone()
        desc = Description("all_gather", next(self._seq), src.numel(), tail)
        return self._issue("all_gather", self._all_gather, (flat(out), flat(src)), desc,
                           output, out, None, async_op)

    def barrier(self) -> None:
        """Block until every rank has called :meth:`barrier` (within the timeout).

        Raises:
            CollectiveTimeoutError: not every rank arrived within the timeout.
            RuntimeError: the communicator is closed.
        """
        self._check_open()
        if self._world_size == 1:
            return
        desc = Description("barrier", next(self._seq), 0,
                           f" ({self.backend}, rank {self._rank}/{self._world_size})")
        self._issue("barrier", self._barrier, (), desc, None, None, None, False)

    def close(self) -> None:
        """Release the transport's resources; later collectives raise RuntimeError. Idempotent."""
        if not self._closed:
            self._closed = True
            self._close_children()  # before the transport they may share
            self._close()
            if self.profiler is not None:
                self.profiler.communicator_closed()

    def __enter__(self) -> Communicator:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return (f"<{type(self).__name__} backend={self.backend} rank={self._rank}/"
                f"{self._world_size} local_rank={self._local_rank} device={self._device}>")

    # ------------------------------------------------------------------ backend hooks
    @abc.abstractmethod
    def _all_reduce(self, tensor: torch.Tensor, op: ReduceOp, description: DescriptionLike) -> Work:
        """Start an all-reduce of a contiguous, non-empty tensor with an op in native_reduce_ops."""

    @abc.abstractmethod
    def _broadcast(self, tensor: torch.Tensor, src: int, description: DescriptionLike) -> Work:
        """Start a broadcast of a contiguous, non-empty tensor."""

    @abc.abstractmethod
    def _all_gather(self, output: torch.Tensor, input: torch.Tensor,
                    description: DescriptionLike) -> Work:
        """Start an all-gather of contiguous 1-D tensors (``output`` is world_size times longer)."""

    @abc.abstractmethod
    def _barrier(self, description: DescriptionLike) -> Work:
        """Start a barrier."""

    @abc.abstractmethod
    def _close(self) -> None:
        """Release the transport (called once)."""

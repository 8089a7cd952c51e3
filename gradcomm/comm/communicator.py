"""The collective interface every backend implements: :class:`Communicator`.

One class, read in torch.distributed's order: the group (construction, properties, ``supports``,
``split``), point-to-point (``send``, ``recv``, ``batch_isend_irecv``), the collectives
(``broadcast`` ... ``barrier``), ``close``; then the one path every call takes, and the backend
hooks. Each public operation checks its arguments on every rank before any transport call
(:mod:`~gradcomm.comm.checks`), so bad input raises the same error everywhere instead of hanging;
handles what is common to all backends -- world_size 1 (no collective at all), non-contiguous
tensors (copy-in/copy-out), ``ReduceOp.AVG`` on backends without a native average and complex
tensors (:mod:`~gradcomm.comm.emulation`) -- and hands contiguous tensors to :meth:`_issue`, which
compares the call across ranks at ``GRADCOMM_DEBUG=detail``
(:class:`~gradcomm.comm.consistency.ConsistencyCheck`), tells the profiler and starts one backend
hook per operation (``_all_reduce``, ``_broadcast``, ...), in the manner of ``cupyx.distributed``'s
communicator base class. A new collective is a public method here and one hook per backend.
"""

from __future__ import annotations

import abc
import collections
import dataclasses
import enum
import hashlib
import itertools
import logging
import math
import os
import pickle
import socket
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from operator import attrgetter
from typing import ClassVar, NamedTuple

import torch

from .checks import (
    TensorChecks,
    check_all_gather,
    check_avg,
    check_call_args,
    check_rank_arg,
    check_reduce_scatter,
    check_same_dtype,
    check_splits,
    check_src,
    check_supports_args,
    check_writable,
    displacements,
    flat,
    overlap,
    plain,
)
from .consistency import ConsistencyCheck, DebugLevel
from .emulation import average, complex_support, emulated, reduce_complex
from .observer import CollectiveObserver
from .types import Collective, ReduceOp, Support, SupportLevel
from .work import (
    CompletedWork,
    Description,
    DescriptionLike,
    StallGuard,
    Work,
    writing_into,
)

__all__ = [
    "Communicator",
    "CollectiveObserver",
    "P2PKind",
    "P2POp",
    "Transfer",
    "SplitPlan",
    "HOST_ID_VARIABLE",
    "TAG_LIMIT",
    "host_key",
]

logger = logging.getLogger("gradcomm.comm")

#: Tags are ints in ``[0, TAG_LIMIT)``: MPI guarantees ``MPI_TAG_UB >= 32767``.
TAG_LIMIT = 1 << 15
#: The variable naming this rank's host for :meth:`Communicator.split_by_host` (default: hostname).
HOST_ID_VARIABLE = "GRADCOMM_HOST_ID"
_SPLIT_LIMIT = 1 << 62  # colors and keys are int64 on the wire
# Codes of a split argument's kind in the exchange.
_NONE, _INT, _BAD_TYPE, _BAD_VALUE = 0, 1, 2, 3


# ----------------------------------------------------------------------------- point-to-point
class P2PKind(enum.Enum):
    """Direction of one :class:`P2POp`."""

    SEND = "send"
    RECV = "recv"


_KINDS = {"send": P2PKind.SEND, "isend": P2PKind.SEND, "recv": P2PKind.RECV,
          "irecv": P2PKind.RECV}


def _kind(op: object) -> P2PKind:
    """``op`` as a P2PKind: itself, or by its name (a string, or a send/recv method's)."""
    if isinstance(op, P2PKind):
        return op
    # the text of a str subclass too (numpy's str_, a str-valued enum member)
    name = str.__str__(op) if isinstance(op, str) else getattr(op, "__name__", None)
    kind = _KINDS.get(name) if isinstance(name, str) else None
    if kind is None:
        raise ValueError(
            f"P2POp op must be 'send', 'recv' or a communicator's send/recv, got {op!r}")
    return kind


class P2POp:
    """One transfer for :meth:`Communicator.batch_isend_irecv` (torch's ``P2POp``); read-only.

    Fields ``op`` (a :class:`P2PKind`), ``tensor``, ``peer`` and ``tag``, as given to the
    constructor. Compared and hashed by identity, as torch's ``P2POp``.
    """

    __slots__ = ("_op", "_peer", "_tag", "_tensor")

    def __init__(self, op: P2PKind | str | Callable[..., object], tensor: torch.Tensor,
                 peer: int, tag: int = 0) -> None:
        """Build one transfer.

        Args:
            op: ``"send"``/``"recv"``, a :class:`P2PKind`, or a communicator's ``send``/``recv``
                method (as torch takes ``dist.isend``/``dist.irecv``); stored as a P2PKind.
            tensor: the data to send, or the buffer to receive into.
            peer: the other rank.
            tag: matches a send with a receive (ignored by NCCL, which matches in order).

        Raises:
            ValueError: ``op`` names neither direction.
        """
        self._op = _kind(op)
        self._tensor = tensor
        self._peer = peer
        self._tag = tag

    op = property(attrgetter("_op"), doc="The direction, a :class:`P2PKind`.")
    tensor = property(attrgetter("_tensor"), doc="The data to send, or the buffer to receive "
                      "into.")
    peer = property(attrgetter("_peer"), doc="The other rank.")
    tag = property(attrgetter("_tag"), doc="The tag, which matches a send with a receive.")

    def __repr__(self) -> str:
        t = self._tensor
        what = (f"{t.__class__.__name__} {list(t.shape)} {t.dtype}"
                if isinstance(t, torch.Tensor) else repr(t))
        return f"P2POp({self._op.value!r}, {what}, peer={self._peer!r}, tag={self._tag!r})"


class Transfer(NamedTuple):
    """A checked transfer, as the backends' ``_post_batch`` receives it: the caller's tensor and
    the contiguous buffer the transport uses (the same tensor unless a copy was needed)."""

    kind: P2PKind
    tensor: torch.Tensor
    buf: torch.Tensor
    peer: int  # ANY_SOURCE: a receive from any rank (Communicator.recv's src=None)
    tag: int
    desc: Description


#: :attr:`Transfer.peer` of a receive from any rank.
ANY_SOURCE = -1


def _check_peer(peer: object, name: str, rank: int, world_size: int) -> int:
    """TypeError unless ``peer`` is an int (not a bool); ValueError unless it is another rank."""
    check_rank_arg(name, peer, world_size)
    if peer == rank:
        raise ValueError(f"{name}={peer} is this rank: a transfer to itself needs no transport; "
                         "copy the tensor instead")
    return peer  # type: ignore[return-value]  # an int, checked above


def _check_tag(tag: object) -> int:
    """TypeError unless ``tag`` is an int; ValueError unless ``0 <= tag < TAG_LIMIT``."""
    if isinstance(tag, bool) or not isinstance(tag, int):
        raise TypeError(f"tag must be an int, got {type(tag).__name__}")
    if not 0 <= tag < TAG_LIMIT:
        raise ValueError(f"tag must be in [0, {TAG_LIMIT}), got {tag}")
    return tag


# ----------------------------------------------------------------------------- groups
def host_key(host: str | None = None) -> int:
    """A 56-bit id of ``host`` (default: ``GRADCOMM_HOST_ID``, else the hostname)."""
    name = host if host is not None else (os.environ.get(HOST_ID_VARIABLE, "").strip()
                                          or socket.gethostname())
    return int.from_bytes(hashlib.sha256(name.encode()).digest()[:7], "big")


def _split_code(value: object) -> tuple[int, int]:
    if value is None:
        return _NONE, 0
    if isinstance(value, bool) or not isinstance(value, int):
        return _BAD_TYPE, 0
    if not 0 <= value < _SPLIT_LIMIT:
        return _BAD_VALUE, 0
    return _INT, value


@dataclass(frozen=True)
class SplitPlan:
    """Where this rank lands in a split, the same on every rank of the parent.

    Attributes:
        index: this split's number on the parent (0, 1, ...), which names its store prefix.
        color: this rank's color (None: not a member; then the other fields are empty).
        members: the parent ranks of the new communicator, in its rank order.
        rank: this rank's index in ``members``.
        local_rank: index among the members on this rank's host.
        local_world_size: number of members on this rank's host.
        kind: ``"split"``, or ``"subgroup"`` for :meth:`Communicator.subgroup` (then ``index``
            counts the groups of these members and ``color`` is a hash of them).
    """

    index: int
    color: int | None
    members: tuple[int, ...]
    rank: int
    local_rank: int
    local_world_size: int
    kind: str = "split"

    @property
    def prefix(self) -> str:
        """The store prefix of the new group: unique per split (or subgroup) and color."""
        return f"gradcomm/{self.kind}{self.index}/color{self.color}/"


_Row = tuple[int, int, int, int, int]  # (color code, color, key code, key, host) of one rank


def _plan(index: int, rows: list[_Row], rank: int) -> SplitPlan:
    """``rank``'s :class:`SplitPlan` of split number ``index`` from every rank's ``rows``."""
    code, color = rows[rank][0], rows[rank][1]
    if code == _NONE:
        return SplitPlan(index, None, (), 0, 0, 0)

    def order(r: int) -> tuple[int, int]:
        return (rows[r][3] if rows[r][2] == _INT else r, r)

    members = tuple(sorted((r for r, row in enumerate(rows)
                            if row[0] == _INT and row[1] == color), key=order))
    same_host = [m for m in members if rows[m][4] == rows[rank][4]]
    return SplitPlan(index, color, members, members.index(rank), same_host.index(rank),
                     len(same_host))


# ----------------------------------------------------------------------------- objects
def _pickled(obj: object) -> tuple[bytes, str]:
    """``obj``'s pickle and no error, or no bytes and the error's text."""
    try:
        return pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL), ""
    except Exception as exc:  # noqa: BLE001 - every rank must learn of the failure
        return b"", f"{type(exc).__name__}: {exc}"[:120]


def _root_buffer(opname: str, buffer: object, other: torch.Tensor, world_size: int) -> torch.Tensor:
    """The root's ``buffer``, checked: TypeError/ValueError unless it is a tensor that holds
    ``world_size`` times ``other``."""
    if not isinstance(buffer, torch.Tensor):
        raise TypeError(f"{opname}: the root needs a tensor of world_size * {other.numel()} "
                        f"elements, got {type(buffer).__name__}")
    check_same_dtype(opname, buffer, other)
    if buffer.numel() != world_size * other.numel():
        raise ValueError(f"{opname}: the root's buffer must hold world_size * numel = "
                         f"{world_size} * {other.numel()} elements, got {buffer.numel()}")
    return buffer


class Communicator(abc.ABC):
    """A group of ``world_size`` processes that run collectives on tensors of one device type.

    All collectives work in place on the given tensor and preserve its dtype and shape. Each
    returns a :class:`~gradcomm.comm.Work`; with ``async_op=False`` (default) it is already
    complete. Every rank must call the same collectives in the same order with tensors of the
    same numel and dtype (``debug="detail"`` checks that). While a collective whose wait timed out
    is still pending, every new one raises RuntimeError at once (no transport can cancel a started
    collective, and one issued behind it would wait for it).

    Args:
        rank: this process's index, ``0 <= rank < world_size``.
        world_size: number of processes.
        local_rank: index among the processes on this host.
        device: device the collectives' tensors live on (``cpu`` or ``cuda:<i>``).
        timeout: seconds a collective may take before :meth:`Work.wait` raises
            :class:`~gradcomm.CollectiveTimeoutError`; ``None`` waits forever.

    Raises:
        ValueError: rank, world_size, local_rank or timeout out of range.
    """

    #: Name of the backend, as given to :func:`gradcomm.init` (``"gloo"``, ``"mpi"``, ...).
    backend: ClassVar[str] = "abstract"
    #: Whether tensors must be on the communicator's device itself, not just of its type.
    exact_device: ClassVar[bool] = False
    #: Whether :meth:`recv` takes ``src=None`` (from any rank): gloo and mpi.
    receives_from_any_source: ClassVar[bool] = False
    #: Reduction ops the transport performs itself; others are emulated by this class.
    native_reduce_ops: ClassVar[frozenset[ReduceOp]] = frozenset({ReduceOp.SUM, ReduceOp.MIN,
                                                                  ReduceOp.MAX, ReduceOp.PRODUCT})

    def __init__(self, *, rank: int, world_size: int, local_rank: int,
                 device: torch.device | str, timeout: float | None) -> None:
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
        self._seq = itertools.count()  # collectives, numbered alike on every rank
        self._p2p_seq = itertools.count()  # transfers, numbered apart (only two ranks see one)
        self._split_count = 0
        self._subgroup_counts: dict[tuple[int, ...], int] = {}
        self._children: list[weakref.ref[Communicator]] = []
        # The helpers of the one path (_issue), composed.
        self._checks = TensorChecks(self.backend, self._device, f"rank {rank}/{world_size}",
                                    self._supports, self.exact_device)
        self._stalls = StallGuard(self.backend)
        # Works returned pending that nobody has seen complete yet, oldest first (see _issue).
        self._unobserved: collections.deque[Work] = collections.deque()
        self._consistency = ConsistencyCheck(self._all_gather, self._complete, world_size,
                                             self._device)
        #: Optional :class:`CollectiveObserver` told of every collective (None: off).
        self.profiler: CollectiveObserver | None = None

    # ================================================================== the group
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
    def debug(self) -> DebugLevel:
        """What is compared across ranks before each collective: :attr:`DebugLevel.OFF`
        (default) nothing, :attr:`DebugLevel.DETAIL` every collective.

        Set it (a DebugLevel or ``"off"``/``"detail"``) alike on every rank, between collectives;
        :func:`gradcomm.init` sets it from its ``debug`` argument or ``GRADCOMM_DEBUG``.

        Raises:
            TypeError: (setting) not a DebugLevel or str. ValueError: a string naming no level.
        """
        return self._consistency.level

    @debug.setter
    def debug(self, level: DebugLevel | str) -> None:
        self._consistency.level = DebugLevel.coerce(level)

    @property
    def background_progress(self) -> bool:
        """Whether a collective started with ``async_op=True`` advances while the caller computes.

        True when the transport moves data on its own (a device stream; a transport thread with a
        CPU core to itself); False when it shares the training thread's only core, and in this
        base class. Only then can overlapping hide the all-reduce's time;
        :class:`~gradcomm.GradientReducer` sizes its first bucket by it."""
        return False

    @property
    def cheap_collectives(self) -> bool:
        """Whether one more collective costs less than a pass over a few MiB of the tensor's memory.

        :class:`~gradcomm.GradientReducer` then reduces large gradients in place, one collective
        each, instead of copying them into a shared bucket (its ``in_place_min_mb``): True for
        MPI on host memory, False here and so for gloo."""
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
        if coll is Collective.ALL_REDUCE:
            return (complex_support(dtype, dev, self._supports) if dtype.is_complex
                    else self._supports(dtype, dev))
        if coll.reduces:
            if dtype.is_complex:
                return Support(SupportLevel.UNSUPPORTED, f"{coll.value} does not take complex "
                               "tensors; all_reduce reduces them as their real view")
            base = self._supports(dtype, dev)
        elif (self._device.type if dev is None else dev.type) != self._device.type:
            base = Support(SupportLevel.UNSUPPORTED, f"this {self.backend} communicator works "
                           f"on {self._device.type} tensors, not {dev}")
        else:
            base = Support(SupportLevel.NATIVE, "", dtype)
        if (coll is Collective.REDUCE_SCATTER
                and type(self)._reduce_scatter is Communicator._reduce_scatter):
            base = emulated(base, "reduce_scatter runs as an all_reduce of the whole input "
                            "(world_size times the traffic)")
        if (coll is Collective.ALL_GATHER_V
                and type(self)._all_gather_v is Communicator._all_gather_v):
            base = emulated(base, "all_gather with uneven sizes pads every input to the largest "
                            "(world_size * largest moved)")
        return self._supports_collective(coll, dtype, dev, base)

    def split(self, color: int | None, key: int | None = None) -> Communicator | None:
        """A new communicator of the ranks that pass the same ``color`` (``MPI_Comm_split``).

        Collective: every rank of this communicator must call it. The arguments of all ranks are
        exchanged first (one all-gather of five int64 per rank), so a bad color or key raises the
        same error on every rank. The child has its own rank, world_size, local_rank (among its
        members on its host), profiler (None) and this communicator's timeout; closing this
        communicator closes its children first.

        Args:
            color: an int ``>= 0``, or None for "not a member" (that rank gets None).
            key: orders the members (ties and None: by rank here); an int ``>= 0`` or None.

        Returns:
            The new communicator (its ``rank`` is the position by ``(key, rank)``), or None.

        Raises:
            TypeError: on every rank, when some rank's color or key is neither an int nor None.
            ValueError: on every rank, when some rank's color or key is negative or >= 2**62.
            RuntimeError: this communicator is closed.
        """
        self._check_open()
        rows = self._exchange_split_args(color, key, host_key())
        return self._new_child(rows)

    def subgroup(self, ranks: Sequence[int]) -> Communicator:
        """A new communicator of ``ranks`` of this one, built by those ranks alone.

        Not collective over this communicator (``MPI_Comm_create_group``, unlike :meth:`split`):
        only the members call it, and members that make several groups of the same ranks make
        them in the same order (torch's ``new_group`` calls a backend's group creator on the
        members only). The child's local rank comes from one small all-gather on it.

        Args:
            ranks: distinct ranks of this communicator, in the new one's rank order; this rank
                among them.

        Returns:
            The new communicator (``rank`` is this rank's index in ``ranks``); this
            communicator's device and timeout, profiler None; closed when this one is.

        Raises:
            TypeError: ``ranks`` is not a sequence of ints.
            ValueError: ``ranks`` is empty, repeats a rank, names one out of range, or lacks
                this rank.
            NotImplementedError: the backend cannot build a group on its members alone
                (cupy-nccl).
            RuntimeError: this communicator is closed.
        """
        if isinstance(ranks, (str, bytes)) or not isinstance(ranks, Sequence) or any(
                isinstance(r, bool) or not isinstance(r, int) for r in ranks):
            raise TypeError(f"subgroup: ranks must be a sequence of ints, got {ranks!r:.80}")
        members = tuple(ranks)
        if not members or len(set(members)) != len(members):
            raise ValueError(f"subgroup: ranks must be distinct and not empty, got "
                             f"{members!r:.80}")
        if not all(0 <= r < self._world_size for r in members) or self._rank not in members:
            raise ValueError(f"subgroup: ranks must lie in [0, {self._world_size}) and include "
                             f"this rank {self._rank}, got {members!r:.80}")
        self._check_open()
        index = self._subgroup_counts.get(members, 0)
        self._subgroup_counts[members] = index + 1
        digest = hashlib.sha256(repr(members).encode()).digest()[:7]
        rank = members.index(self._rank)
        child = self._subgroup_child(SplitPlan(index, int.from_bytes(digest, "big"), members,
                                               rank, rank, len(members), kind="subgroup"))
        if child.world_size > 1:  # which members share this rank's host
            mine = torch.tensor([host_key()], dtype=torch.int64, device=self._device)
            hosts = torch.empty(child.world_size, dtype=torch.int64, device=self._device)
            child.all_gather(hosts, mine)
            keys = hosts.tolist()
            same = [i for i, h in enumerate(keys) if h == keys[rank]]
            child._set_local(same.index(rank), len(same))
        self._children.append(weakref.ref(child))
        return child

    def split_by_host(self, host: str | None = None) -> tuple[Communicator, Communicator]:
        """``(intra, inter)``: the ranks on this rank's host, and those of every host with this
        rank's ``intra.rank`` (one per host, ordered by rank). Collective.

        Args:
            host: this rank's host name; default ``GRADCOMM_HOST_ID`` (to fake a grouping on one
                machine, e.g. 4 ranks as 2 hosts x 2), else :func:`socket.gethostname`.

        Raises:
            TypeError: ``host`` is not a str or None (on this rank only: a local argument).
            RuntimeError: this communicator is closed.
        """
        if host is not None and not isinstance(host, str):
            raise TypeError(f"host must be a str or None, got {type(host).__name__}")
        self._check_open()
        rows = self._exchange_split_args(0, None, host_key(host))
        hosts: dict[int, int] = {}
        for row in rows:
            hosts.setdefault(row[4], len(hosts))
        place = [sum(1 for r in rows[:i] if r[4] == row[4]) for i, row in enumerate(rows)]
        intra = self._new_child([(_INT, hosts[r[4]], _NONE, 0, r[4]) for r in rows])
        # inter: one host each, so each member is "local" to itself
        inter = self._new_child([(_INT, place[i], _NONE, 0, i) for i in range(len(rows))])
        if intra is None or inter is None:  # pragma: no cover - every rank has a color here
            raise RuntimeError("split_by_host: a rank was left without a communicator")
        return intra, inter

    # ================================================================== point-to-point
    def send(self, tensor: torch.Tensor, dst: int, tag: int = 0, *,
             async_op: bool = False) -> Work:
        """Send ``tensor`` to rank ``dst``, which receives it with :meth:`recv`.

        A transfer involves two ranks, so its checks run on the calling rank alone: a bad
        argument raises there, and the peer, which cannot know, waits until its timeout.
        Whether the two sides agree (same number of bytes, matching tags) only the transport
        sees: MPI and the thread backend raise RuntimeError from ``wait()`` on a size mismatch;
        gloo accepts a shorter message silently and aborts the receiving process on a longer
        one; NCCL (no tags) does not check. Send and receive the same dtype and numel.

        Args:
            tensor: any shape and dtype, on this communicator's device; non-contiguous tensors
                are sent as a contiguous copy.
            dst: the receiving rank, ``0 <= dst < world_size``, not this rank.
            tag: ``0 <= tag < 2**15``; matches the receive with the same tag (in order).
            async_op: return at once with a pending :class:`Work` (do not modify ``tensor``
                before it completes).

        Raises:
            TypeError: not a tensor, sparse, ``dst``/``tag`` not an int, ``async_op`` not a bool.
            ValueError: ``dst`` out of range or this rank, tag out of range, wrong device.
            RuntimeError: the communicator is closed.
        """
        self._begin(async_op)
        return self._post_transfer(self._prepare_transfer(P2PKind.SEND, tensor, dst, tag),
                                   async_op)

    def recv(self, tensor: torch.Tensor, src: int | None, tag: int = 0, *,
             async_op: bool = False) -> Work:
        """Receive into ``tensor``, in place, what rank ``src`` sends with :meth:`send`.

        Args:
            tensor: the buffer, same dtype and numel as the sent tensor; non-contiguous buffers
                receive into a contiguous copy written back on completion.
            src: the sending rank, ``0 <= src < world_size``, not this rank; None: the first
                message with ``tag`` from any rank (where :attr:`receives_from_any_source`;
                the work's :attr:`~Work.source` then names the sender once it is complete).
            tag: the tag the sender used.
            async_op: return at once with a pending :class:`Work`.

        Raises:
            TypeError: not a tensor, sparse, ``src``/``tag`` not an int, ``async_op`` not a bool.
            ValueError: ``src`` out of range or this rank (or None at world_size 1), tag out of
                range, wrong device, elements sharing memory (``expand()``).
            NotImplementedError: ``src=None`` on a backend that receives from named ranks only
                (nccl, cupy-nccl).
            RuntimeError: the communicator is closed; from ``wait()``, a size mismatch on mpi
                (see :meth:`send`).
        """
        self._begin(async_op)
        if src is None and not self.receives_from_any_source:
            raise NotImplementedError(f"the {self.backend} backend receives from a named rank "
                                      "only; pass src")
        if src is None and self._world_size == 1:
            raise ValueError("recv from any rank: world_size is 1, no other rank can send")
        work = self._post_transfer(
            self._prepare_transfer(P2PKind.RECV, tensor, src, tag, any_source=src is None),
            async_op)
        if src is not None:
            work.source = src
        return work

    def batch_isend_irecv(self, ops: Sequence[P2POp]) -> list[Work]:
        """Post every transfer of ``ops`` at once; return their pending works, in order.

        The semantics of :func:`torch.distributed.batch_isend_irecv`: no order of the list can
        deadlock (the transfers are non-blocking, and on NCCL grouped or ordered per pair of
        ranks), and every rank may pass a different list. Every op is checked before any is
        posted, so a bad one posts nothing on this rank.

        Raises:
            TypeError: ``ops`` is not a sequence of :class:`P2POp`; a bad op (as :meth:`send`).
            ValueError: a bad op (as :meth:`send`/:meth:`recv`).
            RuntimeError: the communicator is closed.
        """
        if not isinstance(ops, Sequence) or not all(isinstance(o, P2POp) for o in ops):
            raise TypeError("batch_isend_irecv takes a list of P2POp")
        self._check_open()
        prepared = [self._prepare_transfer(o.op, o.tensor, o.peer, o.tag) for o in ops]
        return self._post_batch(prepared)

    # ================================================================== collectives
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
        self._begin(async_op)
        tail = self._checks.check(tensor, "broadcast", reduction=False)
        check_src(src, self._world_size)
        if self._world_size == 1 or tensor.numel() == 0:
            check_writable(tensor, "broadcast")
            return CompletedWork(target=tensor)
        buf = plain(tensor, "broadcast")
        desc = Description("broadcast", next(self._seq), buf.numel(), tail, f"src={src}", root=src)
        return self._issue("broadcast", self._broadcast, (flat(buf), src), desc, tensor, buf,
                           None, async_op)

    def broadcast_object(self, obj: object, src: int = 0) -> object:
        """Return rank ``src``'s ``obj`` on every rank (``obj`` is ignored on the others).

        As torch.distributed's ``broadcast_object_list``: the object is pickled into a uint8
        tensor on the communicator's device, its size broadcast first, then the bytes. A rank
        whose object cannot be pickled tells the others through the size (-1), so every rank
        raises instead of waiting. Unpickling runs code chosen by the sender: use it only among
        ranks of one job.

        Raises:
            TypeError: ``src`` not an int; on every rank, ``src``'s object cannot be pickled
                (the message names its error).
            ValueError: ``src`` out of range.
            RuntimeError: the communicator is closed.
            CollectiveTimeoutError: a rank did not take part within the timeout.
        """
        check_rank_arg("src", src, self._world_size)
        self._check_open()
        mine = self._rank == src
        data, error = _pickled(obj) if mine or self._world_size == 1 else (b"", "")
        if self._world_size == 1:
            if error:
                raise TypeError(f"broadcast_object: rank {src}'s object cannot be pickled: {error}")
            return pickle.loads(data)
        size = torch.tensor([-1 if error else len(data)], dtype=torch.int64, device=self._device)
        self.broadcast(size, src)
        n = int(size.item())
        if n < 0:
            why = f": {error}" if error else ""
            raise TypeError(f"broadcast_object: rank {src}'s object cannot be pickled{why}")
        payload = (torch.frombuffer(bytearray(data), dtype=torch.uint8).to(self._device)
                   if mine else torch.empty(n, dtype=torch.uint8, device=self._device))
        self.broadcast(payload, src)
        return obj if mine else pickle.loads(payload.cpu().numpy().tobytes())

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
        op = ReduceOp.coerce(op)
        self._begin(async_op, label)
        try:
            tail = self._checks.check(tensor, "all_reduce")
        except TypeError:
            if not (isinstance(tensor, torch.Tensor) and tensor.is_complex()):
                raise
            work = reduce_complex(self.all_reduce, tensor, op, label)
            return self._complete(work, async_op, tensor)
        if op is ReduceOp.AVG:
            check_avg(tensor, op)
        numel = tensor.numel()
        if self._world_size == 1 or numel == 0:
            check_writable(tensor, "all_reduce")
            return CompletedWork(target=tensor)
        buf = plain(tensor, "all_reduce")
        desc = Description("all_reduce", next(self._seq), numel, tail, op, label)
        if op in self.native_reduce_ops:
            return self._issue("all_reduce", self._all_reduce, (flat(buf), op), desc, tensor,
                               buf, label, async_op)

        def start(o: torch.Tensor, i: torch.Tensor, native: ReduceOp, d: DescriptionLike) -> Work:
            return self._all_reduce(o, native, d)

        one = flat(buf)  # in place: input is output
        return self._issue("all_reduce", average, (start, self._world_size, one, one), desc,
                           tensor, buf, label, async_op)

    def reduce(self, tensor: torch.Tensor, dst: int = 0, op: ReduceOp | str = ReduceOp.SUM, *,
               async_op: bool = False, label: str | None = None) -> Work:
        """Reduce ``tensor`` element-wise across ranks into rank ``dst``'s ``tensor``, in place.

        As :func:`torch.distributed.reduce`: only ``dst``'s tensor holds the result; the others'
        may be overwritten with partial results. Dtypes, ``AVG`` and 16-bit floats follow
        :meth:`all_reduce`'s rules (``supports(dtype, collective="reduce")``).

        Raises:
            TypeError: not a tensor, a dtype the backend cannot reduce, ``AVG`` on integers,
                ``dst`` not an int, ``async_op`` not a bool.
            ValueError: ``dst`` out of range, unknown op name, wrong device type, or elements
                sharing memory.
            RuntimeError: the communicator is closed.
        """
        op = ReduceOp.coerce(op)
        self._begin(async_op, label)
        tail = self._checks.check(tensor, "reduce")
        check_rank_arg("dst", dst, self._world_size)
        check_avg(tensor, op)
        check_writable(tensor, "reduce")
        if self._world_size == 1 or tensor.numel() == 0:
            return CompletedWork(target=tensor)
        buf = plain(tensor, "reduce")
        desc = Description("reduce", next(self._seq), buf.numel(), tail, op, f"dst={dst}",
                           root=dst)
        if op in self.native_reduce_ops:
            return self._issue("reduce", self._reduce, (flat(buf), dst, op), desc, tensor, buf,
                               label, async_op)

        def start(o: torch.Tensor, i: torch.Tensor, native: ReduceOp, d: DescriptionLike) -> Work:
            return self._reduce(o, dst, native, d)

        one = flat(buf)  # in place: input is output
        return self._issue("reduce", average, (start, self._world_size, one, one), desc, tensor,
                           buf, label, async_op)

    def all_gather(self, output: torch.Tensor, input: torch.Tensor,
                   output_split_sizes: list[int] | None = None, *,
                   async_op: bool = False) -> Work:
        """Gather every rank's ``input`` into ``output``, concatenated in rank order.

        Semantics of :func:`torch.distributed.all_gather_into_tensor`: ``output`` holds
        ``world_size * input.numel()`` elements of ``input``'s dtype; rank ``r``'s data lands in
        ``output.view(-1)[r * n:(r + 1) * n]`` with ``n = input.numel()``.

        With ``output_split_sizes`` (rank ``r``'s rows along dim 0, summing to
        ``output.shape[0]``) the ranks' first dimensions may differ (MPI's Allgatherv): rank
        ``r``'s ``input`` has ``output_split_sizes[r]`` rows and ``output``'s shape after dim 0.
        Every rank must pass the same sizes; a rank cannot see the others', so a mismatch is
        caught only by the transport.

        Raises:
            TypeError: not tensors, dtypes differ, sizes not ints, or ``async_op`` not a bool.
            ValueError: ``output.numel()`` is not ``world_size * input.numel()`` (sizes: not
                matching as above), wrong device, or ``output``'s elements share memory.
            RuntimeError: the communicator is closed.
        """
        self._begin(async_op)
        tail = self._checks.check(input, "all_gather", reduction=False)
        self._checks.check(output, "all_gather", reduction=False)
        if output_split_sizes is not None:
            return self._all_gather_uneven(output, input, output_split_sizes, tail, async_op)
        check_all_gather(output, input, self._world_size)
        if self._world_size == 1 or input.numel() == 0:
            check_writable(output, "all_gather")
            with writing_into(output):
                output.copy_(input.reshape(output.shape))
            return CompletedWork(target=output)
        src, out = self._distinct(plain(input), plain(output, "all_gather"))
        desc = Description("all_gather", next(self._seq), src.numel(), tail)
        return self._issue("all_gather", self._all_gather, (flat(out), flat(src)), desc,
                           output, out, None, async_op, like=src)

    def _all_gather_uneven(self, output: torch.Tensor, input: torch.Tensor,
                           output_split_sizes: list[int], tail: str, async_op: bool) -> Work:
        check_same_dtype("all_gather", output, input)
        w, r = self._world_size, self._rank
        rows = check_splits("all_gather", "output_split_sizes", output_split_sizes, output, w)
        if input.dim() == 0 or input.shape[1:] != output.shape[1:] or input.shape[0] != rows[r]:
            raise ValueError(f"all_gather: input shape {tuple(input.shape)} must be "
                             f"({rows[r]}, *{tuple(output.shape[1:])}) on rank {r} "
                             f"(output_split_sizes[{r}] rows, output's shape after dim 0)")
        check_writable(output, "all_gather")
        if w == 1 or output.numel() == 0:
            with writing_into(output):
                output.copy_(input)
            return CompletedWork(target=output)
        row = math.prod(input.shape[1:])
        src, out = self._distinct(plain(input), plain(output, "all_gather"))
        splits = tuple(n * row for n in rows)  # equal on every rank, unlike the input's size
        desc = Description("all_gather", next(self._seq), out.numel(), tail, "uneven",
                           splits=splits)
        return self._issue("all_gather", self._all_gather_v, (flat(out), flat(src), list(splits)),
                           desc, output, out, None, async_op, like=src)

    def all_gather_object(self, obj: object) -> list[object]:
        """Return every rank's ``obj``, in rank order (this rank's is a copy, via pickle).

        As torch.distributed's ``all_gather_object``: sizes are all-gathered first, then every
        rank's bytes padded to the largest.

        Raises:
            TypeError: on every rank, some rank's object cannot be pickled (the message names
                the first such rank).
            RuntimeError: the communicator is closed; a rank's size exchange shows that it
                called another collective (seen when what it sent is not a size).
            CollectiveTimeoutError: a rank did not take part within the timeout.
        """
        self._check_open()
        w = self._world_size
        data, error = _pickled(obj)
        mine = torch.tensor([-1 if error else len(data)], dtype=torch.int64, device=self._device)
        sizes = torch.empty(w, dtype=torch.int64, device=self._device)
        self.all_gather(sizes, mine)
        counts = [int(n) for n in sizes.tolist()]
        if min(counts) < 0:
            bad = next(r for r, n in enumerate(counts) if n < 0)
            if counts[bad] != -1:  # not a size: that rank called another collective
                raise RuntimeError(f"all_gather_object: rank {bad} sent no object size; ranks "
                                   "called different collectives (GRADCOMM_DEBUG=detail names it)")
            why = f": {error}" if error else ""
            raise TypeError(f"all_gather_object: rank {bad}'s object cannot be pickled{why}")
        width = max(counts)
        padded = torch.zeros(width, dtype=torch.uint8)
        if data:
            padded[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        out = torch.empty(w * width, dtype=torch.uint8, device=self._device)
        self.all_gather(out, padded.to(self._device))
        raw = out.cpu().numpy().tobytes()
        return [pickle.loads(raw[r * width:r * width + n]) for r, n in enumerate(counts)]

    def gather(self, output: torch.Tensor | None, input: torch.Tensor, dst: int = 0, *,
               async_op: bool = False) -> Work:
        """Gather every rank's ``input`` into rank ``dst``'s ``output``, in rank order.

        As torch.distributed's ``gather`` with all_gather's layout: the root's ``output`` holds
        ``world_size`` chunks of ``input``'s shape (chunk ``r`` is
        ``output.view(-1)[r * n:(r + 1) * n]``). What only the root can check (its buffer's size)
        raises on the root alone; the other ranks then fail with the timeout.

        Args:
            output: on ``dst``, ``world_size * input.numel()`` elements of ``input``'s dtype;
                None on the other ranks (a tensor given there is ignored).
            input: same shape and dtype on every rank.
            dst: the root rank.

        Raises:
            TypeError: not tensors, dtypes differ, ``dst`` not an int, ``async_op`` not a bool,
                or (on ``dst`` only) ``output`` not a tensor.
            ValueError: ``dst`` out of range, wrong device type, or (on ``dst`` only) ``output``
                of the wrong size or with elements sharing memory.
            RuntimeError: the communicator is closed.
        """
        self._begin(async_op)
        tail = self._checks.check(input, "gather", reduction=False)
        check_rank_arg("dst", dst, self._world_size)
        root = self._rank == dst
        target: torch.Tensor | None = None
        if root:
            target = _root_buffer("gather", output, input, self._world_size)
            self._checks.check(target, "gather", reduction=False)
            check_writable(target, "gather")
        if self._world_size == 1 or input.numel() == 0:
            if target is not None:
                with writing_into(target):
                    target.copy_(input.reshape(target.shape))
            return CompletedWork(target=target)
        src = plain(input)
        out = None
        if target is not None:
            src, out = self._distinct(src, plain(target, "gather"))
        desc = Description("gather", next(self._seq), src.numel(), tail, f"dst={dst}", root=dst)
        return self._issue("gather", self._gather,
                           (None if out is None else flat(out), flat(src), dst), desc,
                           target, out, None, async_op, like=src)

    def scatter(self, output: torch.Tensor, input: torch.Tensor | None, src: int = 0, *,
                async_op: bool = False) -> Work:
        """Send chunk ``r`` of rank ``src``'s ``input`` to rank ``r``'s ``output``.

        As torch.distributed's ``scatter`` with all_gather's layout (see :meth:`gather`).

        Args:
            output: same shape and dtype on every rank.
            input: on ``src``, ``world_size * output.numel()`` elements of ``output``'s dtype;
                None on the other ranks (a tensor given there is ignored).
            src: the root rank.

        Raises:
            TypeError: not tensors, dtypes differ, ``src`` not an int, ``async_op`` not a bool,
                or (on ``src`` only) ``input`` not a tensor.
            ValueError: ``src`` out of range, wrong device type, ``output``'s elements sharing
                memory, or (on ``src`` only) ``input`` of the wrong size.
            RuntimeError: the communicator is closed.
        """
        self._begin(async_op)
        tail = self._checks.check(output, "scatter", reduction=False)
        check_rank_arg("src", src, self._world_size)
        check_writable(output, "scatter")
        chunks: torch.Tensor | None = None
        if self._rank == src:
            chunks = _root_buffer("scatter", input, output, self._world_size)
            self._checks.check(chunks, "scatter", reduction=False)
        if self._world_size == 1 or output.numel() == 0:
            if chunks is not None:
                with writing_into(output):
                    output.copy_(chunks.reshape(output.shape))
            return CompletedWork(target=output)
        out = plain(output, "scatter")
        inp = None
        if chunks is not None:
            inp, out = self._distinct(plain(chunks), out)
        desc = Description("scatter", next(self._seq), out.numel(), tail, f"src={src}", root=src)
        return self._issue("scatter", self._scatter,
                           (flat(out), None if inp is None else flat(inp), src), desc,
                           output, out, None, async_op)

    def reduce_scatter(self, output: torch.Tensor, input: torch.Tensor,
                       op: ReduceOp | str = ReduceOp.SUM, *, async_op: bool = False,
                       label: str | None = None) -> Work:
        """Reduce ``input`` element-wise across ranks; rank ``r`` gets the ``r``-th chunk.

        Semantics of :func:`torch.distributed.reduce_scatter_tensor`: ``input`` holds
        ``world_size`` chunks of ``output.numel()`` elements (in memory order, i.e. along dim 0
        when ``input.shape[0] == world_size * output.shape[0]``); ``output`` receives the reduction
        of chunk ``rank`` over all ranks. ``AVG``, 16-bit floats and the dtypes follow
        :meth:`all_reduce`'s rules (``supports(dtype, collective="reduce_scatter")``).

        Args:
            output: any shape, ``n`` elements; non-contiguous outputs are written back.
            input: ``world_size * n`` elements of ``output``'s dtype and device type.
            op: a :class:`ReduceOp` or its name.
            async_op: return at once with a pending :class:`Work`.
            label: names the data in error messages and profiles.

        Raises:
            TypeError: not tensors, dtypes differ, a dtype the backend cannot reduce (complex
                included), ``AVG`` on integers, ``async_op`` not a bool.
            ValueError: unknown op name, ``input.numel() != world_size * output.numel()``, a
                wrong device type, or ``output``'s elements share memory (``expand()``).
            RuntimeError: the communicator is closed.
        """
        op = ReduceOp.coerce(op)
        self._begin(async_op, label)
        tail = self._checks.check(input, "reduce_scatter")
        self._checks.check(output, "reduce_scatter")
        check_reduce_scatter(output, input, self._world_size)
        check_avg(input, op)
        check_writable(output, "reduce_scatter")
        n = output.numel()
        if self._world_size == 1 or n == 0:
            with writing_into(output):
                output.copy_(input.reshape(output.shape))
            return CompletedWork(target=output)
        src, out = self._distinct(plain(input), plain(output, "reduce_scatter"))
        desc = Description("reduce_scatter", next(self._seq), n, tail, op, label)
        if op in self.native_reduce_ops:
            return self._issue("reduce_scatter", self._reduce_scatter,
                               (flat(out), flat(src), op), desc, output, out, label, async_op,
                               like=src)
        return self._issue("reduce_scatter", average,
                           (self._reduce_scatter, self._world_size, flat(out), flat(src)), desc,
                           output, out, label, async_op, like=src)

    def all_to_all(self, output: torch.Tensor, input: torch.Tensor,
                   output_split_sizes: list[int] | None = None,
                   input_split_sizes: list[int] | None = None, *,
                   async_op: bool = False) -> Work:
        """Send rows of ``input`` to every rank and receive theirs into ``output``.

        Semantics of :func:`torch.distributed.all_to_all_single`: ``input`` is split along dim 0
        into ``world_size`` parts of ``input_split_sizes`` rows (None: equal parts); part ``j``
        goes to rank ``j``. ``output`` is split likewise by ``output_split_sizes``; its part
        ``i`` receives rank ``i``'s part for this rank. Both tensors have the same dtype and the
        same shape after dim 0. Rank ``i``'s ``input_split_sizes[j]`` must equal rank ``j``'s
        ``output_split_sizes[i]``: a rank cannot see the others' sizes, so a mismatch is not
        caught by these checks (the transport fails or times out; see docs/collectives.md).

        Raises:
            TypeError: not tensors, dtypes differ, split sizes not ints, or ``async_op`` not a bool.
            ValueError: 0-d tensors, shapes after dim 0 differ, split sizes of the wrong length,
                negative, or not summing to dim 0 (None: dim 0 not divisible by world_size), a
                wrong device type, or ``output``'s elements share memory.
            RuntimeError: the communicator is closed.
        """
        w = self._world_size
        self._begin(async_op)
        tail = self._checks.check(input, "all_to_all", reduction=False)
        self._checks.check(output, "all_to_all", reduction=False)
        check_same_dtype("all_to_all", output, input)
        send = check_splits("all_to_all", "input_split_sizes", input_split_sizes, input, w)
        recv = check_splits("all_to_all", "output_split_sizes", output_split_sizes, output, w)
        if output.shape[1:] != input.shape[1:]:
            raise ValueError(f"all_to_all: output shape {tuple(output.shape)} and input shape "
                             f"{tuple(input.shape)} differ after dim 0")
        check_writable(output, "all_to_all")
        if w == 1:
            if output.shape != input.shape:
                raise ValueError(f"all_to_all: at world_size 1 output shape {tuple(output.shape)}"
                                 f" must equal input shape {tuple(input.shape)}")
            with writing_into(output):
                output.copy_(input)
            return CompletedWork(target=output)
        # every rank takes part, even one that sends and receives nothing (sizes differ by rank)
        row = math.prod(input.shape[1:])  # elements per row
        src, out = self._distinct(plain(input), plain(output, "all_to_all"))
        desc = Description("all_to_all", next(self._seq), src.numel(), tail)
        counts = ([n * row for n in recv], [n * row for n in send])
        return self._issue("all_to_all", self._all_to_all, (flat(out), flat(src), *counts), desc,
                           output, out, None, async_op, like=src)

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
        """Release the transport's resources; later collectives raise RuntimeError. Idempotent.

        Closes the communicators :meth:`split` made from this one first."""
        if self._closed:
            return
        self._closed = True
        children, self._children = self._children, []
        for ref in children:  # before the transport they may share
            child = ref()
            if child is not None:
                child.close()
        self._close()
        if self.profiler is not None:
            self.profiler.communicator_closed()

    def abort(self) -> None:
        """End this communicator at once; callable from any thread (for fault tolerance, see
        :mod:`gradcomm.elastic`).

        A wait in progress on one of its works raises RuntimeError within about 0.1 s, later
        collectives raise RuntimeError, and the transport's resources are released by
        :meth:`close`, which may then block until the collectives still running in the transport
        end (gloo cannot cancel them: they end when the peers close their connections, or at the
        timeout). Idempotent. Use it to leave a group whose peer died or stalled; the
        communicator cannot be used again.

        Raises:
            NotImplementedError: the backend cannot (mpi: MPI cannot leave a communicator whose
                peer died; this base class).
        """
        raise NotImplementedError(f"the {self.backend} backend cannot abort a communicator")

    def __enter__(self) -> Communicator:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return (f"<{type(self).__name__} backend={self.backend} rank={self._rank}/"
                f"{self._world_size} local_rank={self._local_rank} device={self._device}>")

    # ================================================================== the one path
    def _begin(self, async_op: object, label: object = None) -> None:
        """The checks every operation starts with: ``async_op`` a bool and ``label`` a str or
        None (:func:`check_call_args` raises), the communicator open and not stalled
        (:meth:`_check_open` raises). Each condition is tested here and its check called only to
        raise: every rank pays this on every call."""
        if async_op.__class__ is not bool or not (label is None or label.__class__ is str):
            check_call_args(async_op, label)
        if self._closed or self._stalls.stalled is not None:
            self._check_open()

    def _check_open(self) -> None:
        """RuntimeError when closed, or while a timed-out collective is still pending."""
        if self._closed:
            raise RuntimeError(f"{self.backend} communicator is closed")
        if self._stalls.stalled is not None:
            self._stalls.check()

    @staticmethod
    def _distinct(src: torch.Tensor,
                  out: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(src, out)``, with ``src`` copied when it shares memory with ``out`` (e.g. this
        rank's own slot of an all_gather): transports read the input while writing the output,
        and MPI rejects aliased buffers."""
        return (src.clone() if overlap(src, out) else src), out

    def _issue(self, opname: str, hook: Callable[..., Work], args: tuple[object, ...],
               description: Description, target: torch.Tensor | None,
               buf: torch.Tensor | None, label: str | None, async_op: bool, *,
               like: torch.Tensor | None = None) -> Work:
        """Start ``hook(*args, description)``: the hand-over of every checked collective.

        Args:
            opname: the collective's name (consistency check, profiler).
            target: the caller's tensor that receives the result (None: nothing written here).
            buf: the contiguous tensor the transport writes (``target`` itself, or a stand-in
                copied back into ``target`` on completion); the profiler's size.
            like: a tensor every rank passes, whose dtype and device the cross-rank check uses
                (default ``buf``; gather's root-only output is not one).
        """
        if self._unobserved:
            self._finish_unobserved()
        consistency = self._consistency
        if consistency.level is not DebugLevel.OFF and consistency.wants(opname):
            consistency.check(opname, description, buf if like is None else like)
        profiler = self.profiler
        if profiler is None:
            work = hook(*args, description)
        else:
            done = profiler.collective_started(opname, buf, label, async_op)
            work = hook(*args, description)
            work.add_callback(done)
        if buf is not target and buf is not None and target is not None:
            dst, src = target, buf
            work.add_callback(lambda: dst.copy_(src))
        return self._complete(work, async_op, target)

    def _complete(self, work: Work, async_op: bool, target: torch.Tensor | None) -> Work:
        """Bind ``work`` to ``target`` and the stall guard (see Work.bind); wait unless async."""
        work.bind(target, self._stalls.note)
        if async_op:
            self._unobserved.append(work)
        else:
            work.wait()
        return work

    def _finish_unobserved(self) -> None:
        """Finish the pending works returned earlier that have completed, oldest first: their
        completion steps (a copy-back into a non-contiguous tensor, the division of an emulated
        AVG) run even when the caller dropped the :class:`Work`, at the latest at the next
        operation. An error there is logged, and kept for that work's ``wait()``: raised here,
        it would make this rank alone skip the operation the others start. A work handed off
        (:meth:`Work.hand_off`) is dropped untested: its waiter, perhaps on another thread,
        finishes it."""
        pending = self._unobserved
        while pending:
            work = pending[0]
            if work._handed_off:
                pending.popleft()
                continue
            try:
                if not work.is_completed():
                    return
            except Exception as exc:  # noqa: BLE001 - kept on the work; see the docstring
                what = ("its completion step failed" if work.callback_error is exc
                        else "it failed")
                logger.warning("%s: %s (%s: %s); raised by its wait(), not by this call",
                               work.description, what, type(exc).__name__, exc)
            pending.popleft()

    def _prepare_transfer(self, kind: P2PKind, tensor: torch.Tensor, peer: int | None,
                          tag: int, *, any_source: bool = False) -> Transfer:
        """Check one transfer; ``any_source`` (from :meth:`recv`, which checked that the
        backend takes it): ``peer`` None is a receive from any rank."""
        name = "dst" if kind is P2PKind.SEND else "src"
        tail = self._checks.check(tensor, kind.value, reduction=False)
        if not any_source:
            _check_peer(peer, name, self._rank, self._world_size)
        elif peer is not None:  # pragma: no cover - recv passes any_source for src None only
            raise ValueError("a receive from any rank takes no src")
        _check_tag(tag)
        if kind is P2PKind.RECV:
            check_writable(tensor, "recv")
        buf = plain(tensor, kind.value if kind is P2PKind.RECV else None)
        # numbered apart from collectives: only two ranks see a transfer, and debug mode
        # compares the collective sequence numbers of every rank
        desc = Description(kind.value, next(self._p2p_seq), buf.numel(), tail,
                           f"{name}={'any' if peer is None else peer} tag={tag}")
        return Transfer(kind, tensor, buf, ANY_SOURCE if peer is None else peer, tag, desc)

    def _post_transfer(self, p: Transfer, async_op: bool) -> Work:
        """Post one checked transfer (the path of send, recv and each op of a batch)."""
        if p.buf.numel() == 0:  # nothing moves; both sides see an empty tensor
            return self._complete(CompletedWork(str(p.desc), target=p.tensor), async_op,
                                  p.tensor)
        # A receive writes back into a non-contiguous tensor; a send has nothing to write.
        target = p.tensor if p.kind is P2PKind.RECV else None
        if p.peer == ANY_SOURCE:
            return self._issue(p.kind.value, self._recv_any, (flat(p.buf), p.tag), p.desc,
                               target, p.buf, None, async_op)
        hook = self._send if p.kind is P2PKind.SEND else self._recv
        return self._issue(p.kind.value, hook, (flat(p.buf), p.peer, p.tag), p.desc, target,
                           p.buf, None, async_op)

    def _exchange_split_args(self, color: object, key: object, host: int) -> list[_Row]:
        """Every rank's (color code, color, key code, key, host), checked on every rank."""
        mine = (*_split_code(color), *_split_code(key), host)
        if self._world_size == 1:
            rows = [mine]
        else:
            local = torch.tensor(mine, dtype=torch.int64, device=self._device)
            out = torch.empty(self._world_size * 5, dtype=torch.int64, device=self._device)
            self.all_gather(out, local)
            values = out.tolist()
            rows = [tuple(values[i * 5:(i + 1) * 5]) for i in range(self._world_size)]
        for r, row in enumerate(rows):
            for code, what in ((row[0], "color"), (row[2], "key")):
                if code == _BAD_TYPE:
                    raise TypeError(f"split: rank {r} passed a {what} that is not an int or None; "
                                    "every rank must pass an int >= 0 or None")
                if code == _BAD_VALUE:
                    raise ValueError(f"split: rank {r} passed a {what} outside [0, 2**62)")
        return rows

    def _new_child(self, rows: list[_Row]) -> Communicator | None:
        """This rank's communicator of the next split of ``rows`` (every rank calls it)."""
        plan = _plan(self._split_count, rows, self._rank)
        self._split_count += 1
        child = self._split_child(plan)  # every rank calls it: some backends split collectively
        if child is not None:
            self._children.append(weakref.ref(child))
        return child

    def _set_local(self, local_rank: int, local_world_size: int) -> None:
        """Set this communicator's place on its host (a subgroup learns it once built)."""
        self._local_rank = local_rank
        launch = getattr(self, "launch", None)
        if launch is not None:
            self.launch = dataclasses.replace(launch, local_rank=local_rank,
                                              local_world_size=local_world_size)

    # ================================================================== backend hooks
    # Each receives contiguous 1-D tensors the public method checked, on this communicator's
    # device, and returns a Work at once (completed or pending).
    @abc.abstractmethod
    def _supports(self, dtype: torch.dtype, device: torch.device | str | None) -> Support:
        """The backend's all_reduce answer for :meth:`supports` (``dtype`` is a torch.dtype)."""

    def _supports_collective(self, collective: Collective, dtype: torch.dtype,
                             device: torch.device | None, base: Support) -> Support:
        """The backend's answer for ``supports(dtype, device, collective)``, given ``base`` (the
        dtype's reduction answer for reductions, NATIVE for data movement on the right device
        type). This default returns ``base``; a backend that emulates an op says so here."""
        return base

    @abc.abstractmethod
    def _all_reduce(self, tensor: torch.Tensor, op: ReduceOp, description: DescriptionLike) -> Work:
        """Start an all-reduce with an op in native_reduce_ops."""

    @abc.abstractmethod
    def _broadcast(self, tensor: torch.Tensor, src: int, description: DescriptionLike) -> Work:
        """Start a broadcast."""

    @abc.abstractmethod
    def _all_gather(self, output: torch.Tensor, input: torch.Tensor,
                    description: DescriptionLike) -> Work:
        """Start an all-gather (``output`` is world_size times longer)."""

    def _all_gather_v(self, output: torch.Tensor, input: torch.Tensor, counts: list[int],
                      description: DescriptionLike) -> Work:
        """Start an all-gather of ``counts[r]`` elements from rank ``r``.

        This default is an emulation over ``_all_gather``: every input padded to the largest
        count, gathered, and the pieces copied out (``world_size * max(counts)`` moved).
        """
        width = max(counts)
        padded = input.new_zeros(width)
        padded[: input.numel()] = input
        gathered = output.new_empty(self._world_size * width)
        work = self._all_gather(gathered, padded, description)

        def unpad() -> None:
            for r, (at, n) in enumerate(zip(displacements(counts), counts, strict=True)):
                output[at:at + n] = gathered[r * width:r * width + n]

        work.add_callback(unpad)
        return work

    def _reduce_scatter(self, output: torch.Tensor, input: torch.Tensor, op: ReduceOp,
                        description: DescriptionLike) -> Work:
        """Start a reduce-scatter (``input`` world_size times longer) with an op in
        native_reduce_ops.

        This default is an emulation: an all-reduce of a copy of ``input``, then this rank's
        chunk copied out (``world_size`` times the traffic of a native reduce-scatter).
        """
        n = output.numel()
        acc = input.clone()
        work = self._all_reduce(acc, op, description)
        chunk = acc[self._rank * n:(self._rank + 1) * n]
        work.add_callback(lambda: output.copy_(chunk))
        return work

    def _all_to_all(self, output: torch.Tensor, input: torch.Tensor, output_counts: list[int],
                    input_counts: list[int], description: DescriptionLike) -> Work:
        """Start an all-to-all; ``*_counts`` are element counts per rank (rank order, summing
        to each tensor's numel)."""
        raise NotImplementedError(f"the {self.backend} backend has no all_to_all")

    def _reduce(self, tensor: torch.Tensor, dst: int, op: ReduceOp,
                description: DescriptionLike) -> Work:
        """Start a reduce into rank ``dst`` (op in native_reduce_ops). This default is an
        emulation: an all-reduce (every rank gets the result)."""
        return self._all_reduce(tensor, op, description)

    def _gather(self, output: torch.Tensor | None, input: torch.Tensor, dst: int,
                description: DescriptionLike) -> Work:
        """Start a gather (``output`` None except on ``dst``)."""
        raise NotImplementedError(f"the {self.backend} backend has no gather")

    def _scatter(self, output: torch.Tensor, input: torch.Tensor | None, src: int,
                 description: DescriptionLike) -> Work:
        """Start a scatter (``input`` None except on ``src``)."""
        raise NotImplementedError(f"the {self.backend} backend has no scatter")

    @abc.abstractmethod
    def _barrier(self, description: DescriptionLike) -> Work:
        """Start a barrier."""

    def _send(self, tensor: torch.Tensor, dst: int, tag: int,
              description: DescriptionLike) -> Work:
        """Start a send; it must not wait for the matching receive to be posted."""
        raise NotImplementedError(f"the {self.backend} backend has no send")

    def _recv(self, tensor: torch.Tensor, src: int, tag: int,
              description: DescriptionLike) -> Work:
        """Start a receive."""
        raise NotImplementedError(f"the {self.backend} backend has no recv")

    def _recv_any(self, tensor: torch.Tensor, tag: int, description: DescriptionLike) -> Work:
        """Start a receive from any rank (only where :attr:`receives_from_any_source`); the
        work sets its :attr:`~Work.source` when it completes."""
        raise NotImplementedError(f"the {self.backend} backend has no receive from any rank")

    def _post_batch(self, prepared: list[Transfer]) -> list[Work]:
        """Post every checked transfer of a batch, in order; a backend whose transfers may block
        each other (NCCL) orders or groups them instead."""
        return [self._post_transfer(p, True) for p in prepared]

    def _split_child(self, plan: SplitPlan) -> Communicator | None:
        """Build this rank's communicator of ``plan`` (None when ``plan.color`` is None).

        Called on every rank of the parent, members or not, in the same order."""
        raise NotImplementedError(f"the {self.backend} backend cannot split")

    def _subgroup_child(self, plan: SplitPlan) -> Communicator:
        """Build this rank's communicator of ``plan`` (``kind="subgroup"``), called on the
        members only; ``local_rank`` is set afterwards."""
        raise NotImplementedError(f"the {self.backend} backend cannot build a group on its "
                                  "members alone")

    @abc.abstractmethod
    def _close(self) -> None:
        """Release the transport (called once)."""

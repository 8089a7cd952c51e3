"""Point-to-point transfers: ``send``, ``recv`` and ``batch_isend_irecv`` of a communicator.

torch.distributed's names and semantics: ``send(tensor, dst, tag)`` and ``recv(tensor, src,
tag)`` move one tensor between two ranks; a :class:`P2POp` list given to
:meth:`PointToPoint.batch_isend_irecv` is posted at once, so a ring exchange (every rank sends to
``rank + 1`` and receives from ``rank - 1``) cannot deadlock whatever the order of the list.

What is checked where: unlike a collective, a transfer involves two ranks only, so its checks run
on the calling rank alone -- the peer is an int in ``[0, world_size)`` and not this rank, the tag an
int in ``[0, 2**15)`` (the smallest tag bound MPI guarantees), the tensor one this communicator
takes, a ``recv`` buffer writable. A bad argument raises on that rank, before any transport call;
its peer, which cannot know, waits until the communicator's timeout
(:class:`~gradcomm.CollectiveTimeoutError`). Whether the two sides agree -- same number of
bytes, matching tags -- only the transport sees, and not every one checks: MPI and the thread
backend raise RuntimeError from ``wait()`` on a size mismatch; gloo accepts a shorter message
silently and aborts the receiving process on a longer one; NCCL (no tags) does not check.
Send and receive the same dtype and numel (docs/p2p-and-groups.md).
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Sequence
from operator import attrgetter
from typing import NamedTuple

import torch

from ._issue import IssuePath
from ._tensors import plain
from ._validation import check_call_args, check_writable
from .work import Description, DescriptionLike, Work, writing_into

__all__ = ["P2PKind", "P2POp", "PointToPoint", "TAG_LIMIT", "Transfer", "check_peer", "check_tag",
           "post_in_pair_order"]

#: Tags are ints in ``[0, TAG_LIMIT)``: MPI guarantees ``MPI_TAG_UB >= 32767``.
TAG_LIMIT = 1 << 15


class P2PKind(enum.Enum):
    """Direction of one :class:`P2POp`."""

    SEND = "send"
    RECV = "recv"


class P2POp:
    """One transfer for :meth:`PointToPoint.batch_isend_irecv` (torch's ``P2POp``); read-only.

    Fields ``op`` (a :class:`P2PKind`), ``tensor``, ``peer`` and ``tag``, as given to the
    constructor. Compared and hashed by identity, as torch's ``P2POp``. A class with slots: a
    ring exchange builds two per call, and its constructor costs a third of a named tuple's or
    a frozen dataclass's (``benchmarks/call_overhead.py --op sendrecv``).
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
        # the common spelling is looked up without a call
        self._op = (_KINDS.get(op) if op.__class__ is str else None) or _kind(op)
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


_KINDS = {"send": P2PKind.SEND, "isend": P2PKind.SEND, "recv": P2PKind.RECV,
          "irecv": P2PKind.RECV}


def _kind(op: object) -> P2PKind:
    """``op`` as a P2PKind: itself, or by its name (a string, or a send/recv method's)."""
    if op.__class__ is P2PKind:
        return op
    # the text of a str subclass too (numpy's str_, a str-valued enum member)
    name = str.__str__(op) if isinstance(op, str) else getattr(op, "__name__", None)
    kind = _KINDS.get(name) if isinstance(name, str) else None
    if kind is None:
        raise ValueError(
            f"P2POp op must be 'send', 'recv' or a communicator's send/recv, got {op!r}")
    return kind


def check_peer(peer: object, name: str, rank: int, world_size: int) -> int:
    """TypeError unless ``peer`` is an int (not a bool); ValueError unless it is another rank."""
    if isinstance(peer, bool) or not isinstance(peer, int):
        raise TypeError(f"{name} must be an int rank, got {type(peer).__name__}")
    if not 0 <= peer < world_size:
        raise ValueError(f"{name} must be in [0, {world_size}), got {peer}")
    if peer == rank:
        raise ValueError(f"{name}={peer} is this rank: a transfer to itself needs no transport; "
                         "copy the tensor instead")
    return peer


def check_tag(tag: object) -> int:
    """TypeError unless ``tag`` is an int; ValueError unless ``0 <= tag < TAG_LIMIT``."""
    if isinstance(tag, bool) or not isinstance(tag, int):
        raise TypeError(f"tag must be an int, got {type(tag).__name__}")
    if not 0 <= tag < TAG_LIMIT:
        raise ValueError(f"tag must be in [0, {TAG_LIMIT}), got {tag}")
    return tag


class PointToPoint(IssuePath):
    """The point-to-point half of :class:`~gradcomm.comm.Communicator` (a mixin).

    Backends implement ``_send(tensor, dst, tag, description)`` and ``_recv(tensor, src, tag,
    description)`` on contiguous, non-empty tensors, returning a :class:`Work` at once, and
    ``_post_batch`` when posting one after another could deadlock (NCCL).
    """

    def send(self, tensor: torch.Tensor, dst: int, tag: int = 0, *,
             async_op: bool = False) -> Work:
        """Send ``tensor`` to rank ``dst``, which receives it with :meth:`recv`.

        Args:
            tensor: any shape and dtype, on this communicator's device; non-contiguous tensors
                are sent as a contiguous copy. The receiver's buffer must have the same dtype
                and numel (only the transport can check; see the module docstring).
            dst: the receiving rank, ``0 <= dst < world_size``, not this rank.
            tag: ``0 <= tag < 2**15``; matches the receive with the same tag (in order).
            async_op: return at once with a pending :class:`Work` (do not modify ``tensor``
                before it completes).

        Raises:
            TypeError: not a tensor, sparse, ``dst``/``tag`` not an int, ``async_op`` not a bool.
            ValueError: ``dst`` out of range or this rank, tag out of range, wrong device.
            RuntimeError: the communicator is closed.
        """
        tail = self._plain_transfer(tensor, dst, tag, async_op)
        if tail is not None:
            desc = Description("send", next(self._p2p_seq), tensor.numel(), tail,
                               f"dst={dst} tag={tag}")
            return self._complete(self._send(tensor, dst, tag, desc), async_op, None)
        return self._p2p(P2PKind.SEND, tensor, dst, tag, async_op)

    def recv(self, tensor: torch.Tensor, src: int, tag: int = 0, *,
             async_op: bool = False) -> Work:
        """Receive into ``tensor``, in place, what rank ``src`` sends with :meth:`send`.

        Args:
            tensor: the buffer, same dtype and numel as the sent tensor; non-contiguous buffers
                receive into a contiguous copy written back on completion.
            src: the sending rank, ``0 <= src < world_size``, not this rank.
            tag: the tag the sender used.
            async_op: return at once with a pending :class:`Work`.

        Raises:
            TypeError: not a tensor, sparse, ``src``/``tag`` not an int, ``async_op`` not a bool.
            ValueError: ``src`` out of range or this rank, tag out of range, wrong device,
                elements sharing memory (``expand()``).
            RuntimeError: the communicator is closed; from ``wait()``, a size mismatch on mpi
                (gloo accepts a shorter message silently and aborts on a longer one; NCCL does
                not check: see the module docstring).
        """
        tail = self._plain_transfer(tensor, src, tag, async_op)
        if tail is not None:  # contiguous, so no two elements at one address: writable
            desc = Description("recv", next(self._p2p_seq), tensor.numel(), tail,
                               f"src={src} tag={tag}")
            return self._complete(self._recv(tensor, src, tag, desc), async_op, tensor)
        return self._p2p(P2PKind.RECV, tensor, src, tag, async_op)

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
        if not (ops.__class__ is list or isinstance(ops, Sequence)) or not all(
                o.__class__ is P2POp or isinstance(o, P2POp) for o in ops):
            raise TypeError("batch_isend_irecv takes a list of P2POp")
        self._check_open()
        prepared = [self._prepare_p2p(o.op, o.tensor, o.peer, o.tag) for o in ops]
        return self._post_batch(prepared)

    # ------------------------------------------------------------------ internals
    def _plain_transfer(self, tensor: object, peer: object, tag: object,
                        async_op: object) -> str | None:
        """``tensor``'s description tail when a transfer may take the short path (see _issue):
        :meth:`_fast_tail` vouches for the state and ``tensor``, ``peer`` is an int rank other
        than this one and ``tag`` passes :func:`check_tag`; else None."""
        tail = self._fast_tail(tensor, async_op)
        if (tail is not None and peer.__class__ is int and 0 <= peer < self._world_size
                and peer != self._rank and tag.__class__ is int and 0 <= tag < TAG_LIMIT):
            return tail
        return None

    def _p2p(self, kind: P2PKind, tensor: torch.Tensor, peer: int, tag: int,
             async_op: bool) -> Work:
        check_call_args(async_op)
        self._check_open()
        prepared = self._prepare_p2p(kind, tensor, peer, tag)
        return self._post_one(prepared, async_op)

    def _prepare_p2p(self, kind: P2PKind, tensor: torch.Tensor, peer: int,
                     tag: int) -> Transfer:
        name = "dst" if kind is P2PKind.SEND else "src"
        tail = self._plain_transfer(tensor, peer, tag, False)
        if tail is not None:
            buf = tensor  # contiguous, so also writable
        else:
            tail = self._check_tensor(tensor, kind.value, reduction=False)
            check_peer(peer, name, self._rank, self._world_size)
            check_tag(tag)
            if kind is P2PKind.RECV:
                check_writable(tensor, "recv")
            buf = plain(tensor, kind.value if kind is P2PKind.RECV else None)
        # numbered apart from collectives: only two ranks see a transfer, and debug mode
        # compares the collective sequence numbers of every rank
        desc = Description(kind.value, next(self._p2p_seq), buf.numel(), tail,
                           f"{name}={peer} tag={tag}")
        return Transfer(kind, tensor, buf, peer, tag, desc)

    def _post_one(self, p: Transfer, async_op: bool) -> Work:
        if p.buf.numel() == 0:  # nothing moves; both sides see an empty tensor
            return self._complete(_done(p), async_op, p.tensor)
        hook = self._send if p.kind is P2PKind.SEND else self._recv
        # A receive writes back into a non-contiguous tensor; a send has nothing to write.
        target = p.tensor if p.kind is P2PKind.RECV else None
        return self._issue(p.kind.value, hook, (p.buf, p.peer, p.tag), p.desc, target, p.buf,
                           None, async_op)

    def _post_batch(self, prepared: list[Transfer]) -> list[Work]:
        """Post every prepared transfer; backends whose transfers may block override this."""
        return [self._post_one(p, True) for p in prepared]

    def _send(self, tensor: torch.Tensor, dst: int, tag: int,
              description: DescriptionLike) -> Work:
        raise NotImplementedError(f"the {self.backend} backend has no send")

    def _recv(self, tensor: torch.Tensor, src: int, tag: int,
              description: DescriptionLike) -> Work:
        raise NotImplementedError(f"the {self.backend} backend has no recv")


class Transfer(NamedTuple):
    """A checked transfer: the caller's tensor, the contiguous buffer the transport uses (a
    named tuple: cheaper to build than a dataclass, two per ring exchange)."""

    kind: P2PKind
    tensor: torch.Tensor
    buf: torch.Tensor
    peer: int
    tag: int
    desc: Description


def _done(p: Transfer) -> Work:
    from .work import CompletedWork

    return CompletedWork(str(p.desc), target=p.tensor)


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


def copy_into(dst: torch.Tensor, src: torch.Tensor) -> None:
    """Write ``src`` into the received buffer ``dst`` (a result written in place)."""
    with writing_into(dst):
        dst.copy_(src.reshape(dst.shape))

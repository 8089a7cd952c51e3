"""Sub-communicators: ``split(color, key)`` and ``split_by_host()`` of a communicator.

``split`` has ``MPI_Comm_split``'s semantics: every rank of the parent calls it; the ranks that
pass the same int ``color`` form one new communicator, ordered by ``(key, parent rank)``
(``key=None``: the parent rank); a rank passing ``color=None`` (``MPI_UNDEFINED``) gets None.
The arguments of all ranks are exchanged first (one all-gather of five int64 per rank on the
parent), so a bad color or key -- one rank passing a str, a float or a negative int -- raises the
same error on every rank instead of leaving the others waiting.

Each backend builds the new group its own way (:meth:`Splitting._split_child`): gloo and nccl a
new process group over the parent's store under a prefix of its own, mpi ``Comm.Split``,
cupy-nccl a new NCCL communicator whose unique id goes round the parent. A child has its own
rank, world_size, local_rank (among its members on its host), profiler (None) and the parent's
timeout; closing the parent closes its children first.

Hosts: a rank's host is ``GRADCOMM_HOST_ID`` when set (to fake a grouping on one machine,
e.g. 4 ranks as 2 hosts x 2), else :func:`socket.gethostname`.
"""

from __future__ import annotations

import hashlib
import os
import socket
import weakref
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from ._issue import IssuePath

if TYPE_CHECKING:  # pragma: no cover
    from .communicator import Communicator
    from .work import Work

__all__ = ["HOST_ID_VARIABLE", "SplitPlan", "Splitting", "host_key"]

#: The variable naming this rank's host for :meth:`Splitting.split_by_host` (default: hostname).
HOST_ID_VARIABLE = "GRADCOMM_HOST_ID"
_LIMIT = 1 << 62  # colors and keys are int64 on the wire
# Codes of an argument's kind in the exchange.
_NONE, _INT, _BAD_TYPE, _BAD_VALUE = 0, 1, 2, 3


def host_key(host: str | None = None) -> int:
    """A 56-bit id of ``host`` (default: ``GRADCOMM_HOST_ID``, else the hostname)."""
    name = host if host is not None else (os.environ.get(HOST_ID_VARIABLE, "").strip()
                                          or socket.gethostname())
    return int.from_bytes(hashlib.sha256(name.encode()).digest()[:7], "big")


def _code(value: object) -> tuple[int, int]:
    if value is None:
        return _NONE, 0
    if isinstance(value, bool) or not isinstance(value, int):
        return _BAD_TYPE, 0
    if not 0 <= value < _LIMIT:
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
    """

    index: int
    color: int | None
    members: tuple[int, ...]
    rank: int
    local_rank: int
    local_world_size: int

    @property
    def prefix(self) -> str:
        """The store prefix of the new group: unique per split and color."""
        return f"gradcomm/split{self.index}/color{self.color}/"


class Splitting(IssuePath):
    """The sub-communicator half of :class:`~gradcomm.comm.Communicator` (a mixin)."""

    if TYPE_CHECKING:  # Communicator's
        def all_gather(self, output: torch.Tensor, input: torch.Tensor, *,
                       async_op: bool = False) -> Work: ...

    _split_count = 0
    _children: list[weakref.ref[Communicator]] | None = None

    def split(self, color: int | None, key: int | None = None) -> Communicator | None:
        """A new communicator of the ranks that pass the same ``color`` (``MPI_Comm_split``).

        Collective: every rank of this communicator must call it.

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
        rows = self._exchange(color, key, host_key())
        return self._child(self._plan(rows, self._rank))

    def split_by_host(self, host: str | None = None) -> tuple[Communicator, Communicator]:
        """``(intra, inter)``: the ranks on this rank's host, and those of every host with this
        rank's ``intra.rank`` (one per host, ordered by rank). Collective.

        Args:
            host: this rank's host name; default ``GRADCOMM_HOST_ID``, else the hostname.

        Raises:
            TypeError: ``host`` is not a str or None (on this rank only: a local argument).
            RuntimeError: this communicator is closed.
        """
        if host is not None and not isinstance(host, str):
            raise TypeError(f"host must be a str or None, got {type(host).__name__}")
        self._check_open()
        rows = self._exchange(0, None, host_key(host))
        hosts: dict[int, int] = {}
        for row in rows:
            hosts.setdefault(row[4], len(hosts))
        place = [sum(1 for r in rows[:i] if r[4] == row[4]) for i, row in enumerate(rows)]
        intra_rows = [(_INT, hosts[r[4]], _NONE, 0, r[4]) for r in rows]
        # inter: one host each, so each member is "local" to itself
        inter_rows = [(_INT, place[i], _NONE, 0, i) for i, r in enumerate(rows)]
        intra = self._child(self._plan(intra_rows, self._rank))
        inter = self._child(self._plan(inter_rows, self._rank))
        if intra is None or inter is None:  # pragma: no cover - every rank has a color here
            raise RuntimeError("split_by_host: a rank was left without a communicator")
        return intra, inter

    # ------------------------------------------------------------------ internals
    def _exchange(self, color: object, key: object,
                  host: int) -> list[tuple[int, int, int, int, int]]:
        """Every rank's (color code, color, key code, key, host), checked on every rank."""
        mine = (*_code(color), *_code(key), host)
        if self._world_size == 1:
            rows = [mine]
        else:
            local = torch.tensor(mine, dtype=torch.int64, device=self._device)
            out = torch.empty(self._world_size * 5, dtype=torch.int64, device=self._device)
            self.all_gather(out, local)
            flat = out.tolist()
            rows = [tuple(flat[i * 5:(i + 1) * 5]) for i in range(self._world_size)]
        for r, row in enumerate(rows):
            for code, what in ((row[0], "color"), (row[2], "key")):
                if code == _BAD_TYPE:
                    raise TypeError(f"split: rank {r} passed a {what} that is not an int or None; "
                                    "every rank must pass an int >= 0 or None")
                if code == _BAD_VALUE:
                    raise ValueError(f"split: rank {r} passed a {what} outside [0, 2**62)")
        return rows

    def _plan(self, rows: list[tuple[int, int, int, int, int]], rank: int) -> SplitPlan:
        index = self._split_count
        self._split_count = index + 1
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

    def _child(self, plan: SplitPlan) -> Communicator | None:
        child = self._split_child(plan)  # every rank calls it: some backends split collectively
        if child is not None:
            if self._children is None:
                self._children = []
            self._children.append(weakref.ref(child))
        return child

    def _close_children(self) -> None:
        children, self._children = self._children or [], None
        for ref in children:
            child = ref()
            if child is not None:
                child.close()

    def _split_child(self, plan: SplitPlan) -> Communicator | None:
        """Build this rank's communicator of ``plan`` (None when ``plan.color`` is None).

        Called on every rank of the parent, members or not, in the same order."""
        raise NotImplementedError(f"the {self.backend} backend cannot split")

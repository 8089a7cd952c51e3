"""Point-to-point transfers (``Isend``/``Irecv`` of the tensor's bytes) and sub-communicators
(``Comm.Split``) over MPI: a mixin of :class:`~gradcomm.comm.backends.mpi.MPICommunicator`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from mpi4py import MPI

from ..._p2p import P2PKind, Transfer
from ..._split import SplitPlan
from ...communicator import Communicator
from ...launcher import Launcher, LaunchInfo
from ...work import DescriptionLike, Work
from .work import MPIWork

if TYPE_CHECKING:  # pragma: no cover
    from mpi4py import MPI as MPIModule

__all__ = ["MPIGroupOps"]


class MPIGroupOps:
    """send/recv and split over MPI (see the module docstring)."""

    if TYPE_CHECKING:  # provided by MPICommunicator
        device: torch.device
        _timeout: float | None
        @property
        def mpi_comm(self) -> MPIModule.Intracomm: ...  # no pending work driven; raises if closed
        _inflight: list[MPIWork]
        _adapter: Any
        _cuda_aware: bool
        _cuda_reason: str

        def _live_comm(self) -> MPIModule.Intracomm: ...
        def _wire(self, tensor: torch.Tensor) -> torch.Tensor: ...
        def _prepare(self, wire: torch.Tensor, *, read: bool = True,
                     write: bool = True) -> tuple[object, Callable[[], None] | None]: ...
        def _attach(self, launch: LaunchInfo, comm: MPIModule.Comm) -> None: ...
        def _post_one(self, p: Transfer, async_op: bool) -> Work: ...
        def _drive_oldest(self) -> None: ...

    # ------------------------------------------------------------------ point-to-point
    # A transfer is posted before the oldest pending work is driven, not after as for the
    # collectives (_live_comm): a pending receive driven first could make its whole copy inside
    # that Test() while the peer waits for this rank's next send, which serialises a ring
    # exchange's two transfers (benchmarks/call_overhead.py --op sendrecv). Inside a batch
    # nothing is driven until every transfer is posted.
    _batching = False

    def _send(self, tensor: torch.Tensor, dst: int, tag: int, description: DescriptionLike) -> Work:
        wire = self._wire(tensor)
        buf, _ = self._prepare(wire, write=False)  # staged in (device), nothing to copy back
        work = MPIWork(self.mpi_comm.Isend([buf, MPI.BYTE], dst, tag), description,
                       self._timeout, (tensor, wire.untyped_storage(), buf), self._inflight)
        self._drive_older(work)
        return work

    def _recv(self, tensor: torch.Tensor, src: int, tag: int, description: DescriptionLike) -> Work:
        wire = self._wire(tensor)
        buf, finish = self._prepare(wire, read=False)
        work = MPIWork(self.mpi_comm.Irecv([buf, MPI.BYTE], src, tag), description,
                       self._timeout, (tensor, wire.untyped_storage(), buf), self._inflight,
                       expect_bytes=wire.nbytes)
        if finish is not None:
            work.add_callback(finish)
        self._drive_older(work)
        return work

    def _post_batch(self, prepared: list[Transfer]) -> list[Work]:
        """Post the receives, then the sends (each kind in the list's order, so tags still
        match in order): a peer's send then finds its receive posted, and its data moves
        without waiting for this rank's next post. Then drive the oldest pending work if it is
        older than the batch."""
        works: list[Work | None] = [None] * len(prepared)
        older = self._inflight[0] if self._inflight else None
        self._batching = True
        try:
            for kind in (P2PKind.RECV, P2PKind.SEND):
                for i, p in enumerate(prepared):
                    if p.kind is kind:
                        works[i] = self._post_one(p, True)
        finally:
            self._batching = False
        if older is not None and self._inflight and self._inflight[0] is older:
            self._drive_oldest()
        return [w for w in works if w is not None]

    def _drive_older(self, work: MPIWork) -> None:
        """Drive the oldest pending work if it is older than the just-posted ``work`` (outside a
        batch), so works the caller dropped are released as transfers go on."""
        if not self._batching and self._inflight and self._inflight[0] is not work:
            self._drive_oldest()

    # ------------------------------------------------------------------ sub-communicators
    def _split_child(self, plan: SplitPlan) -> Communicator | None:
        """``Comm.Split`` of this communicator (every rank calls it; non-members get None)."""
        color = MPI.UNDEFINED if plan.color is None else plan.color
        comm = self._live_comm().Split(color, plan.rank)
        if plan.color is None:
            return None
        child = object.__new__(type(self))  # this backend's state over the new comm
        assert isinstance(child, Communicator)  # MPIGroupOps is only a base of MPICommunicator
        Communicator.__init__(child, rank=plan.rank, world_size=len(plan.members),
                              local_rank=plan.local_rank, device=self.device,
                              timeout=self._timeout)
        child._attach(LaunchInfo(plan.rank, len(plan.members), plan.local_rank,
                                 plan.local_world_size, Launcher.EXPLICIT), comm)
        child._adapter, child._cuda_aware = self._adapter, self._cuda_aware
        child._cuda_reason = self._cuda_reason
        return child

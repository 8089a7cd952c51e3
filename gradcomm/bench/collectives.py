"""Sweeps of the collectives other than all_reduce, beside the raw transport, as nccl-tests.

Sizes follow nccl-tests: ``size`` is the bytes of the larger buffer of one rank -- the input of
reduce_scatter and scatter (root), the output of all_gather and gather (root), the buffer of
all_to_all, broadcast and reduce, what each rank sends for sendrecv -- and
``busbw = algbw * factor`` with nccl-tests' factors
(:func:`bus_factor`). The raw column calls the same collective of the transport directly:
``torch.distributed`` (``reduce_scatter_tensor``, ``all_gather_into_tensor``,
``all_to_all_single``, ``broadcast``, ``reduce``, ``gather``, ``scatter``) or mpi4py
(``Reduce_scatter_block``, ``Allgather``, ``Alltoall``, ``Bcast``, ``Reduce``, ``Gather``,
``Scatter``; for sendrecv -- every rank sends to ``rank + 1`` and receives from ``rank - 1`` at
once, as nccl-tests' ``sendrecv_perf`` -- torch's ``batch_isend_irecv`` and mpi4py's
``Sendrecv``, beside gradcomm's ``batch_isend_irecv``). Timing is
:func:`~gradcomm.bench.sweep.measure`'s. After timing, one call on rank-dependent data is checked
(the ``#wrong`` column).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from .._profile_records import bus_factor as profile_bus_factor
from ..comm import P2POp
from ..comm.communicator import Communicator
from ..comm.types import Collective, ReduceOp
from .metrics import algbw, dtype_name, op_name
from .results import SweepRow
from .sweep import MPIRaw, RawTransport, TorchDistRaw, _device_sync, measure

__all__ = ["SWEPT", "bus_factor", "run_collective_sweep"]

#: The collectives :func:`run_collective_sweep` measures (all_reduce: :func:`run_sweep`).
SWEPT = (Collective.REDUCE_SCATTER, Collective.ALL_GATHER, Collective.ALL_TO_ALL,
         Collective.BROADCAST, Collective.REDUCE, Collective.GATHER, Collective.SCATTER,
         Collective.SENDRECV)


def bus_factor(collective: Collective, world_size: int) -> float:
    """nccl-tests' bus-bandwidth factor: all_reduce ``2(n-1)/n``; reduce_scatter, all_gather,
    all_to_all, gather and scatter ``(n-1)/n``; broadcast, reduce and sendrecv 1 (the
    profiler's)."""
    return profile_bus_factor(collective.value, world_size)


class _Case:
    """The buffers of one collective at one size, and its gradcomm and raw calls."""

    def __init__(self, comm: Communicator, collective: Collective, size: int,
                 dtype: torch.dtype, op: ReduceOp) -> None:
        n, dev = comm.world_size, comm.device
        elem = torch.empty((), dtype=dtype).element_size()
        if collective in (Collective.BROADCAST, Collective.REDUCE, Collective.SENDRECV):
            self.chunk = self.count = max(1, size // elem)
        else:  # world_size equal chunks (all_to_all: of its one buffer size)
            self.chunk = max(1, size // elem // n)
            self.count = self.chunk * n
        fill = torch.ones if op is ReduceOp.PRODUCT else torch.zeros
        self.big = fill(self.count, dtype=dtype, device=dev)
        self.other = fill(self.chunk if collective is not Collective.ALL_TO_ALL else self.count,
                          dtype=dtype, device=dev)
        self.right, self.left = (comm.rank + 1) % n, (comm.rank - 1) % n  # sendrecv's peers
        self.collective, self.op, self.comm = collective, op, comm
        self.root = comm.rank == 0

    def ours(self) -> Callable[[], object]:
        """gradcomm's blocking call."""
        comm, big, other, op, root = self.comm, self.big, self.other, self.op, self.root
        if self.collective is Collective.SENDRECV:
            return self._sendrecv
        return {
            Collective.REDUCE_SCATTER: lambda: comm.reduce_scatter(other, big, op),
            Collective.ALL_GATHER: lambda: comm.all_gather(big, other),
            Collective.ALL_TO_ALL: lambda: comm.all_to_all(big, other),
            Collective.BROADCAST: lambda: comm.broadcast(big, 0),
            Collective.REDUCE: lambda: comm.reduce(big, 0, op),
            Collective.GATHER: lambda: comm.gather(big if root else None, other, 0),
            Collective.SCATTER: lambda: comm.scatter(other, big if root else None, 0),
        }[self.collective]

    def _sendrecv(self) -> None:
        if self.comm.world_size == 1:  # no peer: nothing moves (as all_reduce at world_size 1)
            return
        ops = [P2POp("send", self.big, self.right), P2POp("recv", self.other, self.left)]
        for work in self.comm.batch_isend_irecv(ops):
            work.wait()

    def raw(self, raw: RawTransport) -> Callable[[], object] | None:
        """The transport's own blocking call (None: no raw call for this transport)."""
        if self.collective is Collective.SENDRECV and self.comm.world_size == 1:
            return None
        if isinstance(raw, TorchDistRaw):
            return self._torch(raw)
        if isinstance(raw, MPIRaw):
            return self._mpi(raw)
        return None

    def _torch(self, raw: TorchDistRaw) -> Callable[[], object]:
        import torch.distributed as dist

        g, big, other, root = raw.group, self.big, self.other, self.root
        red = getattr(dist.ReduceOp, "PRODUCT" if self.op is ReduceOp.PRODUCT else self.op.name)
        chunks = list(big.chunk(self.comm.world_size))
        # torch 2.13 renamed the tensor forms (the old names warn); older torch has only those
        reduce_scatter = getattr(dist, "reduce_scatter_single", dist.reduce_scatter_tensor)
        all_gather = getattr(dist, "all_gather_single", dist.all_gather_into_tensor)
        if self.collective is Collective.SENDRECV:
            right, left = self.right, self.left

            def sendrecv() -> None:
                ops = [dist.P2POp(dist.isend, big, right, g),
                       dist.P2POp(dist.irecv, other, left, g)]
                for work in dist.batch_isend_irecv(ops):
                    work.wait()

            return sendrecv
        return {
            Collective.REDUCE_SCATTER: lambda: reduce_scatter(other, big, red, g),
            Collective.ALL_GATHER: lambda: all_gather(big, other, g),
            Collective.ALL_TO_ALL: lambda: dist.all_to_all_single(big, other, group=g),
            Collective.BROADCAST: lambda: dist.broadcast(big, 0, g),
            Collective.REDUCE: lambda: dist.reduce(big, 0, red, g),
            Collective.GATHER: lambda: dist.gather(other, chunks if root else None, 0, g),
            Collective.SCATTER: lambda: dist.scatter(other, chunks if root else None, 0, g),
        }[self.collective]

    def _mpi(self, raw: MPIRaw) -> Callable[[], object]:
        from mpi4py import MPI

        c, root = raw.comm, self.root
        big, other = self.big.numpy(), self.other.numpy()
        mop = raw.mpi_op(self.op) if self.collective.reduces else None
        in_place: Any = MPI.IN_PLACE
        if self.collective is Collective.SENDRECV:
            right, left = self.right, self.left
            return lambda: c.Sendrecv(big, right, recvbuf=other, source=left)
        return {
            Collective.REDUCE_SCATTER: lambda: c.Reduce_scatter_block(big, other, mop),
            Collective.ALL_GATHER: lambda: c.Allgather(other, big),
            Collective.ALL_TO_ALL: lambda: c.Alltoall(other, big),
            Collective.BROADCAST: lambda: c.Bcast(big, 0),
            Collective.REDUCE: lambda: c.Reduce(in_place if root else big, big if root else None,
                                                mop, 0),
            Collective.GATHER: lambda: c.Gather(other, big if root else None, 0),
            Collective.SCATTER: lambda: c.Scatter(big if root else None, other, 0),
        }[self.collective]

    def wrong(self) -> int:
        """Elements that differ from the expected result of one call on rank-valued data."""
        n, r = self.comm.world_size, self.comm.rank
        c, dtype = self.collective, self.big.dtype
        idx = torch.arange(self.count, device=self.big.device) // self.chunk  # chunk -> rank
        if c in (Collective.REDUCE_SCATTER, Collective.REDUCE):
            src = self.big
            src.fill_(1)
            want_sum = 1 if self.op in (ReduceOp.MIN, ReduceOp.MAX, ReduceOp.PRODUCT,
                                        ReduceOp.AVG) else n
            self.ours()()
            got = self.other if c is Collective.REDUCE_SCATTER else (self.big if r == 0 else None)
            return 0 if got is None else int((got != want_sum).sum())
        if c is Collective.ALL_TO_ALL:
            self.other.copy_((idx + 1) * 10 + r)  # chunk j for rank j: 10 (j + 1) + r
            self.ours()()
            return int((self.big != (r + 1) * 10 + idx).sum())
        if c is Collective.SENDRECV:
            self.big.fill_(r)
            self.ours()()
            return 0 if n == 1 else int((self.other != (r - 1) % n).sum())
        if c is Collective.BROADCAST:
            self.big.fill_(1 if r == 0 else 0)
            self.ours()()
            return int((self.big != 1).sum())
        if c is Collective.SCATTER:
            self.big.copy_(idx.to(dtype))
            self.ours()()
            return int((self.other != r).sum())
        self.other.fill_(r)  # all_gather, gather: chunk k holds rank k's value
        self.ours()()
        if c is Collective.GATHER and r != 0:
            return 0
        return int((self.big != idx.to(dtype)).sum())


def run_collective_sweep(
    comm: Communicator, collective: Collective, sizes: Sequence[int], dtype: torch.dtype,
    op: ReduceOp = ReduceOp.SUM, *, iters: int = 20, warmup: int = 5, repeats: int = 3,
    raw: RawTransport | None = None, progress: Callable[[SweepRow], Any] | None = None,
    stat: str = "median",
) -> list[SweepRow]:
    """Time ``collective`` on ``comm`` (and on ``raw``) for every size; call on every rank.

    Arguments as :func:`~gradcomm.bench.sweep.run_sweep`; ``op`` only for reduce_scatter and
    reduce (the raw column is skipped where ``raw.supports(dtype, op)`` is False for those).
    Returns one :class:`SweepRow` per size (``collective`` set), identical on every rank.
    """
    n, rows = comm.world_size, []
    sync = _device_sync(comm.device)
    reduces = collective.reduces
    use_raw = raw is not None and (not reduces or raw.supports(dtype, op))
    for size in sizes:
        case = _Case(comm, collective, size, dtype, op)
        raw_fn = case.raw(raw) if raw is not None and use_raw else None
        t_ours, t_raw = measure(comm, case.ours(), raw_fn, iters=iters, warmup=warmup,
                                repeats=repeats, stat=stat, sync=sync)
        nbytes = case.count * case.big.element_size()
        factor = bus_factor(collective, n)
        row = SweepRow(
            backend=comm.backend, transport=raw.name if raw is not None else "none",
            size=nbytes, count=case.count, type=dtype_name(dtype),
            redop=op_name(op) if reduces else "none", world_size=n, time_us=t_ours * 1e6,
            algbw=algbw(nbytes, t_ours), busbw=algbw(nbytes, t_ours) * factor,
            raw_time_us=None if t_raw is None else t_raw * 1e6,
            raw_algbw=None if t_raw is None else algbw(nbytes, t_raw),
            raw_busbw=None if t_raw is None else algbw(nbytes, t_raw) * factor,
            wrong=case.wrong(), collective=collective.value,
        )
        rows.append(row)
        if progress is not None:
            progress(row)
    return rows

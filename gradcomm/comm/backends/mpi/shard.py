"""The mpi backend's hooks of the collectives beyond all_reduce, broadcast and all_gather.

A mixin of :class:`~gradcomm.comm.backends.mpi.MPICommunicator`: each hook posts one non-blocking
MPI collective (``Ireduce_scatter_block``, ``Ialltoallv``, ...) on buffers from the
communicator's ``_prepare`` (zero-copy on the host; CuPy views or pinned staging on a GPU) and
returns its :class:`~gradcomm.comm.backends.mpi.MPIWork`. Reductions of float16/bfloat16 go
through float32 copies (MPI has no fast 16-bit reduction), rounded back once.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
from mpi4py import MPI

from ..._tensors import flat_bytes
from ...types import Collective, ReduceOp, Support, SupportLevel
from ...work import DescriptionLike, Work
from .dtypes import HALF, MPI_BUFFER, mpi_op
from .work import MPIWork

if TYPE_CHECKING:  # pragma: no cover
    from mpi4py import MPI as MPIModule

__all__ = ["MPIShardOps"]


class MPIShardOps:
    """reduce_scatter, all_to_all and the rooted collectives over MPI (see the module docstring)."""

    if TYPE_CHECKING:  # provided by MPICommunicator
        world_size: int
        _rank: int
        _timeout: float | None
        _adapter: object
        _comm: MPIModule.Intracomm | None
        _inflight: list[MPIWork]

        def _live_comm(self) -> MPIModule.Intracomm: ...
        def _datatype(self, dtype: torch.dtype) -> MPI.Datatype: ...
        def _prepare(self, wire: torch.Tensor, *, read: bool = True,
                     write: bool = True) -> tuple[object, Callable[[], None] | None]: ...
        def _work(self, request: MPI.Request, description: DescriptionLike,
                  keepalive: tuple[object, ...]) -> Work: ...

    def _supports_collective(self, collective: Collective, dtype: torch.dtype,
                             device: torch.device | None, base: Support) -> Support:
        if (collective in (Collective.REDUCE_SCATTER, Collective.REDUCE) and dtype in HALF
                and base.is_supported and base.transfer_dtype != torch.float32):
            # all_reduce's user-defined 16-bit op is not used here: always the upcast
            return Support(SupportLevel.EMULATED_SLOW, f"MPI has no fast {dtype} reduction: "
                           "upcast to float32, reduce, round back", torch.float32)
        return base

    def _post(self, start: Callable[[MPIModule.Intracomm, list[object]], MPI.Request],
              description: DescriptionLike, *wires: tuple[torch.Tensor, bool, bool],
              as_bytes: bool = True) -> Work:
        """Post ``start(comm, buffers)`` on the buffers of ``wires`` ((tensor, read, write)
        each; moved as bytes unless ``as_bytes`` is False, i.e. ``start`` gives a datatype);
        the work keeps the tensors alive and runs their staging steps on completion."""
        comm = self._comm
        if self._adapter is None:  # host memory: zero-copy views, nothing staged or copied back
            if comm is None or self._inflight:  # closed, or an earlier collective to drive
                comm = self._live_comm()
            kept: list[object] = []
            bufs: list[object] = []
            for tensor, _, _ in wires:
                buf = MPI_BUFFER.fromaddress(tensor.data_ptr(), tensor.nbytes)
                bufs.append(buf)
                kept += (tensor, tensor.untyped_storage(), buf)
            request = start(comm, bufs)
            request.Test()  # a peer already waiting gets this rank's data now
            return MPIWork(request, description, self._timeout, tuple(kept), self._inflight)
        comm = self._live_comm()
        bufs = []
        kept = []
        finishes = []
        for tensor, read, write in wires:
            wire = flat_bytes(tensor) if as_bytes else tensor
            buf, finish = self._prepare(wire, read=read, write=write)
            bufs.append(buf)
            kept += (wire, wire.untyped_storage(), buf)
            if finish is not None:
                finishes.append(finish)
        request = start(comm, bufs)
        request.Test()
        work = self._work(request, description, tuple(kept))
        for finish in finishes:
            work.add_callback(finish)
        return work

    def _reduce_scatter(self, output: torch.Tensor, input: torch.Tensor, op: ReduceOp,
                        description: DescriptionLike) -> Work:
        if output.dtype in HALF:
            wide_out = torch.empty_like(output, dtype=torch.float32)
            work = self._reduce_scatter(wide_out, input.to(torch.float32), op, description)
            work.add_callback(lambda: output.copy_(wide_out))
            return work
        datatype, mop = self._datatype(output.dtype), mpi_op(op, output.dtype)
        n = output.numel()
        return self._post(
            lambda comm, b: comm.Ireduce_scatter_block([b[0], n, datatype], [b[1], n, datatype],
                                                       mop),
            description, (input, True, False), (output, False, True), as_bytes=False)

    def _all_to_all(self, output: torch.Tensor, input: torch.Tensor, output_counts: list[int],
                    input_counts: list[int], description: DescriptionLike) -> Work:
        size = input.element_size()
        send = [c * size for c in input_counts]
        recv = [c * size for c in output_counts]
        if len(set(send)) == 1 and send == recv:  # even splits: MPICH's Ialltoall is faster
            return self._post(
                lambda comm, b: comm.Ialltoall([b[0], MPI.BYTE], [b[1], MPI.BYTE]),
                description, (input, True, False), (output, False, True))
        sdisp, rdisp = _displacements(send), _displacements(recv)
        return self._post(
            lambda comm, b: comm.Ialltoallv([b[0], (send, sdisp), MPI.BYTE],
                                            [b[1], (recv, rdisp), MPI.BYTE]),
            description, (input, True, False), (output, False, True))

    def _all_gather_v(self, output: torch.Tensor, input: torch.Tensor, counts: list[int],
                      description: DescriptionLike) -> Work:
        size = input.element_size()
        recv = [c * size for c in counts]
        disp = _displacements(recv)
        return self._post(
            lambda comm, b: comm.Iallgatherv([b[0], MPI.BYTE], [b[1], (recv, disp), MPI.BYTE]),
            description, (input, True, False), (output, False, True))

    def _reduce(self, tensor: torch.Tensor, dst: int, op: ReduceOp,
                description: DescriptionLike) -> Work:
        if tensor.dtype in HALF:
            wide = tensor.to(torch.float32)
            work = self._reduce(wide, dst, op, description)
            work.add_callback(lambda: tensor.copy_(wide))
            return work
        datatype, mop = self._datatype(tensor.dtype), mpi_op(op, tensor.dtype)
        if self._rank == dst:
            return self._post(lambda comm, b: comm.Ireduce(MPI.IN_PLACE, [b[0], datatype], mop,
                                                           root=dst),
                              description, (tensor, True, True), as_bytes=False)
        return self._post(lambda comm, b: comm.Ireduce([b[0], datatype], None, mop, root=dst),
                          description, (tensor, True, False), as_bytes=False)

    def _gather(self, output: torch.Tensor | None, input: torch.Tensor, dst: int,
                description: DescriptionLike) -> Work:
        if output is None:
            return self._post(lambda comm, b: comm.Igather([b[0], MPI.BYTE], None, root=dst),
                              description, (input, True, False))
        return self._post(
            lambda comm, b: comm.Igather([b[0], MPI.BYTE], [b[1], MPI.BYTE], root=dst),
            description, (input, True, False), (output, False, True))

    def _scatter(self, output: torch.Tensor, input: torch.Tensor | None, src: int,
                 description: DescriptionLike) -> Work:
        if input is None:
            return self._post(lambda comm, b: comm.Iscatter(None, [b[0], MPI.BYTE], root=src),
                              description, (output, False, True))
        return self._post(
            lambda comm, b: comm.Iscatter([b[1], MPI.BYTE], [b[0], MPI.BYTE], root=src),
            description, (output, False, True), (input, True, False))


def _displacements(counts: list[int]) -> list[int]:
    out, at = [], 0
    for c in counts:
        out.append(at)
        at += c
    return out

"""The cupy-nccl backend's collectives beyond all-reduce, broadcast and all-gather, and its
point-to-point transfers: each is one NCCL call, or one NCCL group of sends and receives where
NCCL has no call of its own (all-to-all, gather, scatter), as NCCL's documentation and torch's
ProcessGroupNCCL build them. A mixin of
:class:`~gradcomm.comm.backends.cupy_nccl.CupyNCCLCommunicator`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from .._p2p import Transfer
from ..types import ReduceOp
from ..work import DescriptionLike, Work

__all__ = ["NCCLGroupOps"]


class NCCLGroupOps:
    """Backend hooks of :class:`~gradcomm.comm.backends.cupy_nccl.CupyNCCLCommunicator` (see the
    module); the attributes are the communicator's."""

    world_size: int
    _nccl_mod: Any
    _dtypes: dict[torch.dtype, int]
    _ops: dict[ReduceOp, int]
    _stream: Any
    _batch: list[Any] | None

    if TYPE_CHECKING:  # the communicator's and PointToPoint's; not defined here (MRO)
        def _launch(self, tensors: tuple[torch.Tensor, ...], call: Callable[[Any, int], None],
                    description: DescriptionLike) -> Work: ...

        def _post_one(self, p: Transfer, async_op: bool) -> Work: ...

    def _reduce_scatter(self, output: torch.Tensor, input: torch.Tensor, op: ReduceOp,
                        description: DescriptionLike) -> Work:
        send, recv, count = input.data_ptr(), output.data_ptr(), output.numel()
        dtype, nccl_op = self._dtypes[output.dtype], self._ops[op]
        return self._launch(
            (input, output),
            lambda comm, s: comm.reduceScatter(send, recv, count, dtype, nccl_op, s),
            description,
        )

    def _all_to_all(self, output: torch.Tensor, input: torch.Tensor, output_counts: list[int],
                    input_counts: list[int], description: DescriptionLike) -> Work:
        # NCCL has no all-to-all call: one send and one receive per peer inside a group call is
        # how NCCL's own documentation (and ProcessGroupNCCL) builds it.
        size = input.element_size()
        return self._exchange_bytes(output, input, [c * size for c in output_counts],
                                    [c * size for c in input_counts], description)

    def _reduce(self, tensor: torch.Tensor, dst: int, op: ReduceOp,
                description: DescriptionLike) -> Work:
        ptr, count = tensor.data_ptr(), tensor.numel()
        dtype, nccl_op = self._dtypes[tensor.dtype], self._ops[op]
        return self._launch(
            (tensor,), lambda comm, s: comm.reduce(ptr, ptr, count, dtype, nccl_op, dst, s),
            description,
        )

    def _gather(self, output: torch.Tensor | None, input: torch.Tensor, dst: int,
                description: DescriptionLike) -> Work:
        # NCCL has no gather: sends to the root and, on it, one receive per rank, in a group.
        n = input.numel() * input.element_size()
        counts = [n if output is not None else 0] * self.world_size
        sends = [n if peer == dst else 0 for peer in range(self.world_size)]
        return self._exchange_bytes(output, input, counts, sends, description)

    def _scatter(self, output: torch.Tensor, input: torch.Tensor | None, src: int,
                 description: DescriptionLike) -> Work:
        n = output.numel() * output.element_size()
        sends = [n if input is not None else 0] * self.world_size
        counts = [n if peer == src else 0 for peer in range(self.world_size)]
        return self._exchange_bytes(output, input, counts, sends, description)

    def _exchange_bytes(self, output: torch.Tensor | None, input: torch.Tensor | None,
                        recv_bytes: list[int], send_bytes: list[int],
                        description: DescriptionLike) -> Work:
        """One group of sends and receives: ``send_bytes[p]`` bytes of ``input`` (consecutive,
        rank order) to each peer ``p``, ``recv_bytes[p]`` into ``output`` from each."""
        nccl, uint8 = self._nccl_mod, self._nccl_mod.NCCL_UINT8
        send = 0 if input is None else input.data_ptr()
        recv = 0 if output is None else output.data_ptr()

        def call(comm: Any, stream: int) -> None:
            nccl.groupStart()
            try:
                at_send = at_recv = 0
                for peer, (n_send, n_recv) in enumerate(zip(send_bytes, recv_bytes,
                                                            strict=True)):
                    if n_send:
                        comm.send(send + at_send, n_send, uint8, peer, stream)
                    if n_recv:
                        comm.recv(recv + at_recv, n_recv, uint8, peer, stream)
                    at_send += n_send
                    at_recv += n_recv
            finally:
                nccl.groupEnd()

        tensors = tuple(t for t in (input, output) if t is not None)
        return self._launch(tensors, call, description)

    def _send(self, tensor: torch.Tensor, dst: int, tag: int, description: DescriptionLike) -> Work:
        ptr, nbytes = tensor.data_ptr(), tensor.numel() * tensor.element_size()
        uint8 = self._nccl_mod.NCCL_UINT8  # NCCL has no tags: transfers match in order
        return self._launch((tensor,), lambda comm, s: comm.send(ptr, nbytes, uint8, dst, s),
                            description)

    def _recv(self, tensor: torch.Tensor, src: int, tag: int, description: DescriptionLike) -> Work:
        ptr, nbytes = tensor.data_ptr(), tensor.numel() * tensor.element_size()
        uint8 = self._nccl_mod.NCCL_UINT8
        return self._launch((tensor,), lambda comm, s: comm.recv(ptr, nbytes, uint8, src, s),
                            description)

    def _post_batch(self, prepared: list[Transfer]) -> list[Work]:
        # One NCCL group: its sends and receives progress together (no order can deadlock).
        nccl = self._nccl_mod
        self._batch = []
        nccl.groupStart()
        try:
            works = [self._post_one(p, True) for p in prepared]
        finally:
            nccl.groupEnd()
            events, self._batch = self._batch, None
            for event in events:
                event.record(self._stream)
        return works

"""Hierarchical all-reduce: reduce within each host, across hosts, then share within each host.

The two-level scheme of Horovod's hierarchical allreduce and NCCL's tree-of-rings ideas, over
:meth:`~gradcomm.comm.Communicator.split_by_host`: with ``L`` ranks on each host,

1. ``intra.reduce_scatter``: local rank ``i`` gets the host's sum of shard ``i`` (1/L of the data);
2. ``inter.all_reduce`` of that shard among the ranks with local rank ``i``, one per host;
3. ``intra.all_gather``: every rank gets every shard.

Only 1/L of the data crosses hosts per rank (the flat ring sends all of it), which pays where
the links between hosts are slower than within one. The result equals the flat all-reduce up
to floating-point rounding (the sum is associated host by host; integers are exact) and is
bit-identical across ranks: step 3 hands every rank the same shards. ``ReduceOp.AVG`` is a SUM
divided once by ``world_size`` at the end. A tensor whose numel is not a multiple of ``L`` is
reduced through a zero-padded copy (the padding is dropped).

Every host must hold the same number of ranks (checked across ranks by
:class:`HierarchicalAllReduce`). The three steps run one after the other: the call returns a
completed :class:`~gradcomm.comm.Work` (no ``async_op``; stages issued lazily could pair up out of
order across ranks on the two communicators).
"""

from __future__ import annotations

import torch

from .checks import check_avg, check_call_args
from .communicator import Communicator
from .types import ReduceOp
from .work import CompletedWork, Work, writing_into

__all__ = ["HierarchicalAllReduce", "hierarchical_all_reduce"]


def hierarchical_all_reduce(tensor: torch.Tensor, intra: Communicator, inter: Communicator,
                            op: ReduceOp | str = ReduceOp.SUM, *,
                            label: str | None = None) -> Work:
    """All-reduce ``tensor`` in place over ``intra`` x ``inter`` (see the module docstring).

    Args:
        tensor: any shape; a dtype ``intra`` and ``inter`` can reduce; on their device.
        intra: the ranks of this host, from ``comm.split_by_host()`` of one communicator whose
            hosts all hold the same number of ranks (:class:`HierarchicalAllReduce` checks that).
        inter: the ranks with this rank's ``intra.rank``, one per host (the same call's).
        op: a :class:`ReduceOp` or its name.
        label: names the data in error messages and profiles.

    Returns:
        A completed :class:`~gradcomm.comm.Work`; ``tensor`` holds the result.

    Raises:
        TypeError: not a tensor, a dtype the backend cannot reduce, AVG on integers.
        ValueError: unknown op name, a tensor on the wrong device type.
        RuntimeError: a communicator is closed.
    """
    op = ReduceOp.coerce(op)
    check_call_args(False, label)
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"hierarchical_all_reduce expects a torch.Tensor, "
                        f"got {type(tensor).__name__}")
    for comm in (intra, inter):
        if comm.closed:
            raise RuntimeError(f"{comm.backend} communicator is closed")
        support = comm.supports(tensor.dtype, tensor.device)
        if not support.is_supported:
            raise TypeError(f"hierarchical_all_reduce: {support.reason}")
    check_avg(tensor, op)
    n, local = tensor.numel(), intra.world_size
    if n == 0 or intra.world_size * inter.world_size == 1:
        return CompletedWork(target=tensor)
    padded = -(-n // local) * local
    flat = tensor.view(-1) if tensor.is_contiguous() and padded == n else None
    buf = flat if flat is not None else torch.zeros(padded, dtype=tensor.dtype,
                                                    device=tensor.device)
    if flat is None:
        buf[:n].copy_(tensor.reshape(-1))
    wire = ReduceOp.SUM if op is ReduceOp.AVG else op
    shard = torch.empty(padded // local, dtype=tensor.dtype, device=tensor.device)
    tag = f"{label} " if label else ""
    intra.reduce_scatter(shard, buf, wire, label=f"{tag}intra-host reduce_scatter")
    inter.all_reduce(shard, wire, label=f"{tag}inter-host all_reduce")
    intra.all_gather(buf, shard)
    with writing_into(tensor):
        if op is ReduceOp.AVG:
            buf.div_(intra.world_size * inter.world_size)
        if flat is None:
            tensor.copy_(buf[:n].view(tensor.shape))
    return CompletedWork(target=tensor)


class HierarchicalAllReduce:
    """The intra- and inter-host communicators of ``comm``, and the hierarchical all-reduce on them.

    Collective: every rank of ``comm`` builds one, in the same order as its other collectives.

    Args:
        comm: the communicator of all ranks.
        host: this rank's host name for :meth:`~gradcomm.comm.Communicator.split_by_host`
            (default: ``GRADCOMM_HOST_ID``, else the hostname).

    Raises:
        ValueError: on every rank, when the hosts hold different numbers of ranks.
        RuntimeError: ``comm`` is closed.
    """

    def __init__(self, comm: Communicator, *, host: str | None = None) -> None:
        self.comm = comm
        self.intra, self.inter = comm.split_by_host(host)
        sizes = torch.empty(comm.world_size, dtype=torch.int64, device=comm.device)
        comm.all_gather(sizes, torch.tensor([self.intra.world_size], device=comm.device))
        if len(set(sizes.tolist())) != 1:
            self.close()
            raise ValueError(f"hierarchical all-reduce needs the same number of ranks on every "
                             f"host, got {sorted(set(sizes.tolist()))}")

    def all_reduce(self, tensor: torch.Tensor, op: ReduceOp | str = ReduceOp.SUM, *,
                   label: str | None = None) -> Work:
        """:func:`hierarchical_all_reduce` of ``tensor`` over this object's communicators."""
        return hierarchical_all_reduce(tensor, self.intra, self.inter, op, label=label)

    def close(self) -> None:
        """Close the two sub-communicators (``comm`` stays open). Idempotent."""
        self.intra.close()
        self.inter.close()

    def __repr__(self) -> str:
        return (f"<HierarchicalAllReduce {self.inter.world_size} hosts x "
                f"{self.intra.world_size} ranks on {self.comm.backend}>")

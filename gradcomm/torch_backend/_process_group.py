"""``ProcessGroupGradcomm``: torch.distributed's process-group calls, each one gradcomm call.

torch 2.13 lets Python subclass only :class:`torch.distributed.ProcessGroup` (not ``Backend``), so
the group is its own backend: every method torch's functions, DDP, FSDP2 and DTensor reach is
here, by the names torch calls (``all_gather_single``, ``reduce_scatter_single``,
``all_to_all_single`` and their ``*_coalesced`` forms, plus the older names as aliases). A method
checks what it can at once (unsupported reduce ops, device types without a transport), then
queues one body on the group's :class:`~gradcomm.torch_backend._engine.Engine`, which calls the
communicator of the tensors' device type and completes the returned work. gradcomm's checks,
timeouts, debug mode (``GRADCOMM_DEBUG``) and profiler apply to every call.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import AllgatherOptions

from gradcomm.comm import Communicator, ReduceOp, Work

from ._engine import Engine, Posted, WaitElsewhere
from ._work import GradcommWork

__all__ = ["ProcessGroupGradcomm"]

#: Transports whose works are waited for on a delivery thread (see ProcessGroupGradcomm._settle):
#: they may be waited on from another thread, and gloo's transfers complete only inside wait()
#: (their is_completed() stays False until then), so they cannot be polled.
_WAITED_ELSEWHERE = frozenset({"gloo"})
_OPS = {
    dist.ReduceOp.SUM: ReduceOp.SUM, dist.ReduceOp.AVG: ReduceOp.AVG,
    dist.ReduceOp.PRODUCT: ReduceOp.PRODUCT, dist.ReduceOp.MIN: ReduceOp.MIN,
    dist.ReduceOp.MAX: ReduceOp.MAX,
}


def _reduce_op(op: dist.ReduceOp | dist.ReduceOp.RedOpType) -> tuple[ReduceOp, float | None]:
    """gradcomm's op and the pre-multiplier of ``PREMUL_SUM`` (None for other ops).

    Raises:
        ValueError: BAND, BOR or BXOR, which gradcomm does not reduce.
    """
    kind = getattr(op, "op", op)  # a ReduceOp object carries its RedOpType (not in the stubs)
    if kind == dist.ReduceOp.PREMUL_SUM:
        return ReduceOp.SUM, float(getattr(op, "factor"))  # noqa: B009 - its pre-multiplier
    found = _OPS.get(kind)  # type: ignore[arg-type]
    if found is None:
        raise ValueError(f"the gradcomm backend does not reduce with {kind}; use SUM, AVG, "
                         "PRODUCT, MIN, MAX or PREMUL_SUM")
    return found, None


def _copy_out(chunks: Sequence[torch.Tensor], into: Sequence[torch.Tensor]
              ) -> Callable[[], None]:
    """A completion step copying ``chunks`` (of a flat buffer) into the caller's tensors."""
    def copy() -> None:
        for t, chunk in zip(into, chunks, strict=True):
            t.copy_(chunk.view(t.shape))

    return copy


def _describe(name: str, tensors: list[torch.Tensor]) -> str:
    if not tensors:
        return name
    t = tensors[0]
    return f"{name} of {sum(x.numel() for x in tensors)} {t.dtype} on {t.device}"


class ProcessGroupGradcomm(dist.ProcessGroup):
    """A torch process group whose operations run on gradcomm communicators.

    Args:
        rank: this process's rank in the group.
        size: the group's number of processes.
        comms: the group's communicator per device type (``"cpu"``, ``"cuda"``), same ranks.
        name: names the group's threads.
        timeout: seconds a posted send or receive may take (collectives: the communicators').

    Made by ``init_process_group("gradcomm")`` and ``new_group(..., backend="gradcomm")``
    (:mod:`gradcomm.torch_backend`), not directly.
    """

    def __init__(self, rank: int, size: int, comms: Mapping[str, Communicator], name: str,
                 timeout: float | None) -> None:
        super().__init__(rank, size)  # type: ignore[call-arg]  # (store, rank, size) fails
        self._comms = dict(comms)
        self._timeout = timeout
        self._group_name = self._group_desc = ""
        self._engine = Engine(name, timeout)

    @property
    def communicators(self) -> dict[str, Communicator]:
        """The gradcomm communicator of each device type (do not close them: shutdown does)."""
        return dict(self._comms)

    # torch's base class keeps a group's name and description in its backends, which a Python
    # group has none of ("ProcessGroup name not set"): they live here.
    def getBackendName(self) -> str:
        return "gradcomm"

    def getGroupName(self) -> str:
        return self._group_name

    def setGroupName(self, name: str) -> None:
        self._group_name = name

    def getGroupDesc(self) -> str:
        return self._group_desc

    def setGroupDesc(self, desc: str) -> None:
        self._group_desc = desc

    def _comm(self, tensors: list[torch.Tensor]) -> Communicator:
        kind = tensors[0].device.type if tensors else "cpu"
        comm = self._comms.get(kind)
        if comm is None:
            raise ValueError(f"this gradcomm process group has no transport for {kind} tensors "
                             f"(it has {', '.join(sorted(self._comms))})")
        return comm

    def _settle(self, comm: Communicator, works: list[Work]) -> Posted:
        """What a body returns for the operations it posted: on gloo, the works, to be waited
        for on a delivery thread -- gloo runs them on threads of its own, and the engine's thread
        is free to post the next one at once; elsewhere they are waited for here (the
        communicator's one user), for at most the group's timeout (torch's, from
        ``init_process_group`` or ``new_group``; gloo cuts a longer one to its own)."""
        if comm.backend in _WAITED_ELSEWHERE:
            return WaitElsewhere(works)
        for work in works:
            work.wait(self._timeout)
        return None

    def _submit(self, name: str, outputs: list[torch.Tensor], body: Callable[[], Posted],
                ) -> GradcommWork:
        return self._engine.submit(body, GradcommWork(outputs, _describe(name, outputs)))

    # ------------------------------------------------------------------ reductions
    def allreduce(self, tensors: list[torch.Tensor],  # type: ignore[override]
                  opts: dist.AllreduceOptions | None = None) -> GradcommWork:
        op, factor = _reduce_op((opts or dist.AllreduceOptions()).reduceOp)
        comm = self._comm(tensors)

        def body() -> Posted:
            works = []
            for t in tensors:
                if factor is not None:
                    t.mul_(factor)
                works.append(comm.all_reduce(t, op, async_op=True))
            return self._settle(comm, works)

        return self._submit("allreduce", tensors, body)

    def allreduce_coalesced(self, tensors: list[torch.Tensor],
                            opts: dist.AllreduceCoalescedOptions | None = None) -> GradcommWork:
        single = dist.AllreduceOptions()
        single.reduceOp = (opts or dist.AllreduceCoalescedOptions()).reduceOp
        return self.allreduce(tensors, single)

    def reduce(self, tensors: list[torch.Tensor],  # type: ignore[override]
               opts: dist.ReduceOptions | None = None) -> GradcommWork:
        opts = opts or dist.ReduceOptions()
        op, factor = _reduce_op(opts.reduceOp)
        comm, root = self._comm(tensors), opts.rootRank

        def body() -> Posted:
            works = []
            for t in tensors:
                if factor is not None:
                    t.mul_(factor)
                works.append(comm.reduce(t, root, op, async_op=True))
            return self._settle(comm, works)

        return self._submit("reduce", tensors, body)

    def reduce_scatter_single(self, output: torch.Tensor, input: torch.Tensor,
                              opts: dist.ReduceScatterOptions | None = None) -> GradcommWork:
        return self.reduce_scatter_single_coalesced([output], [input], opts)

    def reduce_scatter_single_coalesced(
            self, outputs: list[torch.Tensor], inputs: list[torch.Tensor],
            opts: dist.ReduceScatterOptions | None = None) -> GradcommWork:
        op, factor = _reduce_op((opts or dist.ReduceScatterOptions()).reduceOp)
        comm = self._comm(inputs)

        def body() -> Posted:
            works = []
            for out, inp in zip(outputs, inputs, strict=True):
                src = inp if factor is None else inp * factor  # the caller's input stays
                works.append(comm.reduce_scatter(out, src, op, async_op=True))
            return self._settle(comm, works)

        return self._submit("reduce_scatter", outputs, body)

    def reduce_scatter(self, outputs: list[torch.Tensor], inputs: list[list[torch.Tensor]],  # type: ignore[override]
                       opts: dist.ReduceScatterOptions | None = None) -> GradcommWork:
        for out, parts in zip(outputs, inputs, strict=True):
            if any(p.numel() != out.numel() for p in parts):
                raise ValueError("reduce_scatter: every input tensor must have the output's "
                                 "number of elements")
        flats = [torch.cat([p.reshape(-1) for p in parts]) for parts in inputs]
        return self.reduce_scatter_single_coalesced(outputs, flats, opts)

    # ------------------------------------------------------------------ data movement
    def broadcast(self, tensors: list[torch.Tensor],  # type: ignore[override]
                  opts: dist.BroadcastOptions | None = None) -> GradcommWork:
        root = (opts or dist.BroadcastOptions()).rootRank
        comm = self._comm(tensors)

        def body() -> Posted:
            works = []
            for t in tensors:
                works.append(comm.broadcast(t, root, async_op=True))
            return self._settle(comm, works)

        return self._submit("broadcast", tensors, body)

    def all_gather_single(self, output: torch.Tensor, input: torch.Tensor,
                          opts: AllgatherOptions | None = None) -> GradcommWork:
        return self.all_gather_single_coalesced([output], [input], opts)

    def all_gather_single_coalesced(self, outputs: list[torch.Tensor],
                                    inputs: list[torch.Tensor],
                                    opts: AllgatherOptions | None = None) -> GradcommWork:
        comm = self._comm(inputs)

        def body() -> Posted:
            works = []
            for out, inp in zip(outputs, inputs, strict=True):
                works.append(comm.all_gather(out, inp, async_op=True))
            return self._settle(comm, works)

        return self._submit("all_gather", outputs, body)

    def allgather(self, outputs: list[list[torch.Tensor]], inputs: list[torch.Tensor],  # type: ignore[override]
                  opts: AllgatherOptions | None = None) -> GradcommWork:
        comm = self._comm(inputs)
        flat_outputs = [t for parts in outputs for t in parts]

        def body() -> Posted:
            works = []
            for parts, inp in zip(outputs, inputs, strict=True):
                sizes = [p.numel() for p in parts]
                buf = torch.empty(sum(sizes), dtype=inp.dtype, device=inp.device)
                if all(s == inp.numel() for s in sizes):
                    work = comm.all_gather(buf, inp, async_op=True)
                else:  # uneven: rows of the flattened tensors
                    work = comm.all_gather(buf, inp.reshape(-1), sizes, async_op=True)
                work.add_callback(_copy_out(buf.split(sizes), parts))
                works.append(work)
            return self._settle(comm, works)

        return self._submit("allgather", flat_outputs, body)

    def allgather_coalesced(self, outputs: list[list[torch.Tensor]],
                            inputs: list[torch.Tensor],
                            opts: AllgatherOptions | None = None) -> GradcommWork:
        # outputs[r][i] receives rank r's inputs[i] (allgather's lists are the other way round)
        per_input = [[per_rank[i] for per_rank in outputs] for i in range(len(inputs))]
        return self.allgather(per_input, inputs, opts)

    def all_to_all_single(self, output: torch.Tensor, input: torch.Tensor,  # type: ignore[override]
                          output_split_sizes: list[int], input_split_sizes: list[int],
                          opts: dist.AllToAllOptions | None = None) -> GradcommWork:
        comm = self._comm([input])
        outs, ins = list(output_split_sizes) or None, list(input_split_sizes) or None

        def body() -> Posted:
            return self._settle(comm, [comm.all_to_all(output, input, outs, ins, async_op=True)])

        return self._submit("all_to_all", [output], body)

    def alltoall(self, outputs: list[torch.Tensor], inputs: list[torch.Tensor],  # type: ignore[override]
                 opts: dist.AllToAllOptions | None = None) -> GradcommWork:
        comm = self._comm(inputs)

        def body() -> Posted:
            sizes_out = [t.numel() for t in outputs]
            buf = torch.empty(sum(sizes_out), dtype=outputs[0].dtype, device=outputs[0].device)
            flat_in = torch.cat([t.reshape(-1) for t in inputs])
            sizes_in = [t.numel() for t in inputs]
            work = comm.all_to_all(buf, flat_in, sizes_out, sizes_in, async_op=True)
            work.add_callback(_copy_out(buf.split(sizes_out), outputs))
            return self._settle(comm, [work])

        return self._submit("alltoall", outputs, body)

    def gather(self, outputs: list[list[torch.Tensor]], inputs: list[torch.Tensor],  # type: ignore[override]
               opts: dist.GatherOptions | None = None) -> GradcommWork:
        root = (opts or dist.GatherOptions()).rootRank
        comm, inp = self._comm(inputs), inputs[0]
        parts = outputs[0] if outputs else []

        def body() -> Posted:
            buf = (torch.empty(comm.world_size * inp.numel(), dtype=inp.dtype, device=inp.device)
                   if comm.rank == root else None)
            work = comm.gather(buf, inp, root, async_op=True)
            if buf is not None:
                work.add_callback(_copy_out(buf.chunk(comm.world_size), parts))
            return self._settle(comm, [work])

        return self._submit("gather", list(parts) or inputs, body)

    def scatter(self, outputs: list[torch.Tensor], inputs: list[list[torch.Tensor]],  # type: ignore[override]
                opts: dist.ScatterOptions | None = None) -> GradcommWork:
        root = (opts or dist.ScatterOptions()).rootRank
        comm, out = self._comm(outputs), outputs[0]

        def body() -> Posted:
            buf = (torch.cat([p.reshape(-1) for p in inputs[0]])
                   if comm.rank == root else None)
            return self._settle(comm, [comm.scatter(out, buf, root, async_op=True)])

        return self._submit("scatter", outputs, body)

    def barrier(self, opts: dist.BarrierOptions | None = None) -> GradcommWork:  # type: ignore[override]
        comm = self._comm([])

        def body() -> Posted:  # an all-reduce of one element, so that the group's timeout applies
            token = torch.zeros(1, device=comm.device)
            return self._settle(comm, [comm.all_reduce(token, async_op=True)])

        return self._submit("barrier", [], body)

    # ------------------------------------------------------------------ point-to-point
    @staticmethod
    def _transfer(comm: Communicator, work: Work) -> Posted:
        return WaitElsewhere([work]) if comm.backend in _WAITED_ELSEWHERE else work

    def send(self, tensors: list[torch.Tensor], dst: int, tag: int) -> GradcommWork:
        comm = self._comm(tensors)
        return self._submit("send", tensors, lambda: self._transfer(
            comm, comm.send(tensors[0], dst, tag, async_op=True)))

    def recv(self, tensors: list[torch.Tensor], src: int, tag: int) -> GradcommWork:
        comm = self._comm(tensors)
        work = self._submit("recv", tensors, lambda: self._transfer(
            comm, comm.recv(tensors[0], src, tag, async_op=True)))
        work._set_sender(src)
        return work

    def recv_anysource(self, tensors: list[torch.Tensor], tag: int) -> GradcommWork:
        """``recv`` without ``src``: the first message with ``tag`` from any rank; the work's
        :meth:`~GradcommWork.source_rank` names the sender once it is done.

        Raises:
            NotImplementedError: the transport receives from named ranks only (nccl,
                cupy-nccl; gloo and mpi take any).
        """
        comm = self._comm(tensors)
        if not comm.receives_from_any_source:
            raise NotImplementedError(f"recv without src: the {comm.backend} transport "
                                      "receives from a named rank only")
        work = GradcommWork(tensors, _describe("recv", tensors))

        def body() -> Posted:
            posted = comm.recv(tensors[0], None, tag, async_op=True)
            posted.add_callback(lambda: work._set_sender(posted.source))
            return self._transfer(comm, posted)

        return self._engine.submit(body, work)

    # ------------------------------------------------------------------ lifetime
    def shutdown(self) -> None:
        """Finish the queued operations, close the communicators and join the threads."""
        def close() -> None:
            for comm in self._comms.values():
                comm.close()

        self._engine.shutdown(close)

    def abort(self) -> None:
        """End the group at once: abort each communicator (a collective blocked on a dead or
        stalled peer fails within about 0.1 s, and so does its work), then :meth:`shutdown`.
        The mpi transport cannot abort (MPI cannot leave a communicator whose peer died): its
        running collective ends at the group's timeout."""
        for comm in self._comms.values():
            try:
                comm.abort()
            except NotImplementedError:
                pass
        self.shutdown()

    # torch's older names, still called by some code and by C++ through the trampoline.
    _allgather_base = all_gather_single
    allgather_into_tensor_coalesced = all_gather_single_coalesced  # type: ignore[assignment]
    _reduce_scatter_base = reduce_scatter_single  # type: ignore[assignment]
    reduce_scatter_tensor_coalesced = reduce_scatter_single_coalesced  # type: ignore[assignment]
    alltoall_base = all_to_all_single  # type: ignore[assignment]

"""Collectives with a root rank: ``reduce``, ``gather`` and ``scatter``.

A mixin of :class:`~gradcomm.comm.Communicator` with torch.distributed's semantics and all_gather's
tensor layout: the root's buffer holds ``world_size`` chunks of the other tensor's shape, in rank
order (``chunk r`` is ``buffer.view(-1)[r * n:(r + 1) * n]``). On the other ranks the root-only
buffer is ``None`` (a tensor given there is ignored). Arguments are checked on every rank before
any transfer; what only the root can check (its buffer's size) raises on the root alone, and the
other ranks' collective then fails with the timeout (see docs/collectives.md).
"""

from __future__ import annotations

import torch

from ._emulation import average_into
from ._issue import IssuePath
from ._tensors import flat, overlap, plain
from ._validation import (
    check_avg,
    check_call_args,
    check_rank_arg,
    check_same_dtype,
    check_writable,
)
from .types import ReduceOp
from .work import CompletedWork, Description, DescriptionLike, Work, writing_into

__all__ = ["RootedOps"]


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


class RootedOps(IssuePath):
    """``reduce``, ``gather`` and ``scatter`` (see the module docstring)."""

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
        tail = self._fast_tail(tensor, async_op)  # the short path: see _issue
        if (tail is not None and self._plain_op(op) and (label is None or label.__class__ is str)
                and dst.__class__ is int and 0 <= dst < self._world_size):
            desc = Description("reduce", next(self._seq), tensor.numel(), tail, op, f"dst={dst}",
                               root=dst)
            work = self._reduce(flat(tensor), dst, op, desc)
            return self._complete(work, async_op, tensor)
        op = ReduceOp.coerce(op)
        check_call_args(async_op, label)
        self._check_open()
        tail = self._check_tensor(tensor, "reduce")
        check_rank_arg("dst", dst, self._world_size)
        check_avg(tensor, op)
        check_writable(tensor, "reduce")
        if self._world_size == 1 or tensor.numel() == 0:
            return CompletedWork(target=tensor)
        buf = plain(tensor, "reduce")
        desc = Description("reduce", next(self._seq), buf.numel(), tail, op, f"dst={dst}",
                           root=dst)
        return self._issue("reduce", self._start_reduce, (flat(buf), dst, op), desc, tensor,
                           buf, label, async_op)

    def _start_reduce(self, buf: torch.Tensor, dst: int, op: ReduceOp,
                      description: DescriptionLike) -> Work:
        if op in self.native_reduce_ops:
            return self._reduce(buf, dst, op, description)

        def start(output: torch.Tensor, input: torch.Tensor, op: ReduceOp) -> Work:
            return self._reduce(output, dst, op, description)

        return average_into(start, self._world_size, buf, buf)

    def gather(self, output: torch.Tensor | None, input: torch.Tensor, dst: int = 0, *,
               async_op: bool = False) -> Work:
        """Gather every rank's ``input`` into rank ``dst``'s ``output``, in rank order.

        Args:
            output: on ``dst``, ``world_size * input.numel()`` elements of ``input``'s dtype
                (rank ``r``'s input lands in chunk ``r``); None on the other ranks.
            input: same shape and dtype on every rank.
            dst: the root rank.

        Raises:
            TypeError: not tensors, dtypes differ, ``dst`` not an int, ``async_op`` not a bool,
                or (on ``dst`` only) ``output`` not a tensor.
            ValueError: ``dst`` out of range, wrong device type, or (on ``dst`` only) ``output``
                of the wrong size or with elements sharing memory.
            RuntimeError: the communicator is closed.
        """
        tail = self._fast_tail(input, async_op)  # the short path: see _issue
        if tail is not None and dst.__class__ is int and 0 <= dst < self._world_size:
            root = self._rank == dst  # output is ignored elsewhere
            if not root or (self._plain_tail(output) is not None
                            and self._chunks_fit(output, input)):
                desc = Description("gather", next(self._seq), input.numel(), tail, f"dst={dst}",
                                   root=dst)
                chunks = flat(output) if root and output is not None else None
                work = self._gather(chunks, flat(input), dst, desc)
                return self._complete(work, async_op, output if root else None)
        check_call_args(async_op)
        self._check_open()
        tail = self._check_tensor(input, "gather", reduction=False)
        check_rank_arg("dst", dst, self._world_size)
        root = self._rank == dst
        if root:
            output = _root_buffer("gather", output, input, self._world_size)
            self._check_tensor(output, "gather", reduction=False)
            check_writable(output, "gather")
        if self._world_size == 1 or input.numel() == 0:
            if output is not None and root:
                with writing_into(output):
                    output.copy_(input.reshape(output.shape))
            return CompletedWork(target=output if root else None)
        src = plain(input)
        out = plain(output, "gather") if root and output is not None else None
        if out is not None and overlap(src, out):
            src = src.clone()
        desc = Description("gather", next(self._seq), src.numel(), tail, f"dst={dst}", root=dst)
        return self._issue("gather", self._gather,
                           (None if out is None else flat(out), flat(src), dst), desc,
                           output if root else None, out, None, async_op)

    def scatter(self, output: torch.Tensor, input: torch.Tensor | None, src: int = 0, *,
                async_op: bool = False) -> Work:
        """Send chunk ``r`` of rank ``src``'s ``input`` to rank ``r``'s ``output``.

        Args:
            output: same shape and dtype on every rank.
            input: on ``src``, ``world_size * output.numel()`` elements of ``output``'s dtype;
                None on the other ranks.
            src: the root rank.

        Raises:
            TypeError: not tensors, dtypes differ, ``src`` not an int, ``async_op`` not a bool,
                or (on ``src`` only) ``input`` not a tensor.
            ValueError: ``src`` out of range, wrong device type, ``output``'s elements sharing
                memory, or (on ``src`` only) ``input`` of the wrong size.
            RuntimeError: the communicator is closed.
        """
        tail = self._fast_tail(output, async_op)  # the short path: see _issue
        if tail is not None and src.__class__ is int and 0 <= src < self._world_size:
            root = self._rank == src
            if not root or (self._plain_tail(input) is not None
                            and self._chunks_fit(input, output)):
                desc = Description("scatter", next(self._seq), output.numel(), tail, f"src={src}",
                                   root=src)
                chunks = flat(input) if root and input is not None else None
                work = self._scatter(flat(output), chunks, src, desc)
                return self._complete(work, async_op, output)
        check_call_args(async_op)
        self._check_open()
        tail = self._check_tensor(output, "scatter", reduction=False)
        check_rank_arg("src", src, self._world_size)
        check_writable(output, "scatter")
        root = self._rank == src
        if root:
            input = _root_buffer("scatter", input, output, self._world_size)
            self._check_tensor(input, "scatter", reduction=False)
        if self._world_size == 1 or output.numel() == 0:
            if input is not None and root:
                with writing_into(output):
                    output.copy_(input.reshape(output.shape))
            return CompletedWork(target=output)
        out = plain(output, "scatter")
        inp = plain(input) if root and input is not None else None
        if inp is not None and overlap(inp, out):
            inp = inp.clone()
        desc = Description("scatter", next(self._seq), out.numel(), tail, f"src={src}", root=src)
        return self._issue("scatter", self._scatter,
                           (flat(out), None if inp is None else flat(inp), src), desc,
                           output, out, None, async_op)

    # ------------------------------------------------------------------ backend hooks
    def _reduce(self, tensor: torch.Tensor, dst: int, op: ReduceOp,
                description: DescriptionLike) -> Work:
        """Start a reduce of a contiguous 1-D tensor into rank ``dst`` (op in
        native_reduce_ops). This default is an emulation: an all-reduce (every rank gets it)."""
        return self._all_reduce(tensor, op, description)

    def _gather(self, output: torch.Tensor | None, input: torch.Tensor, dst: int,
                description: DescriptionLike) -> Work:
        """Start a gather of contiguous 1-D tensors (``output`` None except on ``dst``)."""
        raise NotImplementedError(f"the {self.backend} backend has no gather")

    def _scatter(self, output: torch.Tensor, input: torch.Tensor | None, src: int,
                 description: DescriptionLike) -> Work:
        """Start a scatter of contiguous 1-D tensors (``input`` None except on ``src``)."""
        raise NotImplementedError(f"the {self.backend} backend has no scatter")

    def _all_reduce(self, tensor: torch.Tensor, op: ReduceOp,
                    description: DescriptionLike) -> Work:
        raise NotImplementedError  # pragma: no cover - Communicator declares it abstract



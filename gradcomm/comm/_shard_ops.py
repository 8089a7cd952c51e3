"""Collectives that give each rank its own shard: ``reduce_scatter`` and ``all_to_all``.

A mixin of :class:`~gradcomm.comm.Communicator`: each method checks its arguments on every rank
before any transport call (:mod:`~gradcomm.comm._validation`), then takes the common issue path
(:class:`~gradcomm.comm._issue.IssuePath`) to one backend hook (``_reduce_scatter``,
``_all_to_all``). Semantics and names are torch.distributed's ``reduce_scatter_tensor`` and
``all_to_all_single``.
"""

from __future__ import annotations

import functools
import math

import torch

from ._emulation import average_into
from ._issue import IssuePath
from ._tensors import flat, overlap, plain
from ._validation import (
    check_avg,
    check_call_args,
    check_reduce_scatter,
    check_same_dtype,
    check_splits,
    check_writable,
)
from .types import ReduceOp
from .work import CompletedWork, Description, DescriptionLike, Work, writing_into

__all__ = ["ShardOps"]


class ShardOps(IssuePath):
    """``reduce_scatter`` and ``all_to_all`` (see the module docstring)."""

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
        tail = self._fast_tail(input, async_op)  # the short path: see _issue
        if (tail is not None and self._plain_op(op) and (label is None or label.__class__ is str)
                and self._plain_tail(output) is not None and self._chunks_fit(input, output)):
            desc = Description("reduce_scatter", next(self._seq), output.numel(), tail, op, label)
            work = self._reduce_scatter(flat(output), flat(input), op, desc)
            return self._complete(work, async_op, output)
        op = ReduceOp.coerce(op)
        check_call_args(async_op, label)
        self._check_open()
        tail = self._check_tensor(input, "reduce_scatter")
        self._check_tensor(output, "reduce_scatter")
        check_reduce_scatter(output, input, self._world_size)
        check_avg(input, op)
        check_writable(output, "reduce_scatter")
        n = output.numel()
        if self._world_size == 1 or n == 0:
            with writing_into(output):
                output.copy_(input.reshape(output.shape))
            return CompletedWork(target=output)
        src, out = plain(input), plain(output, "reduce_scatter")
        if overlap(src, out):  # transports read input while writing output
            src = src.clone()
        desc = Description("reduce_scatter", next(self._seq), n, tail, op, label)
        return self._issue("reduce_scatter", self._start_reduce_scatter,
                           (flat(out), flat(src), op), desc, output, out, label, async_op)

    def _start_reduce_scatter(self, output: torch.Tensor, input: torch.Tensor, op: ReduceOp,
                              description: DescriptionLike) -> Work:
        if op in self.native_reduce_ops:
            return self._reduce_scatter(output, input, op, description)
        start = functools.partial(self._reduce_scatter, description=description)
        return average_into(start, self._world_size, output, input)

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
        tail = self._fast_tail(input, async_op)  # the short path (equal splits): see _issue
        if (tail is not None and output_split_sizes is None and input_split_sizes is None
                and self._plain_tail(output) is not None and output.dtype is input.dtype
                and input.dim() and not input.shape[0] % w
                and output.shape == input.shape and not overlap(input, output)):
            desc = Description("all_to_all", next(self._seq), input.numel(), tail)
            each = [input.numel() // w] * w
            work = self._all_to_all(flat(output), flat(input), each, each[:], desc)
            return self._complete(work, async_op, output)
        check_call_args(async_op)
        self._check_open()
        tail = self._check_tensor(input, "all_to_all", reduction=False)
        self._check_tensor(output, "all_to_all", reduction=False)
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
        src, out = plain(input), plain(output, "all_to_all")
        if overlap(src, out):
            src = src.clone()
        desc = Description("all_to_all", next(self._seq), src.numel(), tail)
        counts = ([n * row for n in recv], [n * row for n in send])
        return self._issue("all_to_all", self._all_to_all,
                           (flat(out), flat(src), *counts), desc, output, out, None,
                           async_op)

    def _all_gather_uneven(self, output: torch.Tensor, input: torch.Tensor,
                           output_split_sizes: list[int], async_op: bool) -> Work:
        """:meth:`all_gather` with ``output_split_sizes``: rank ``r``'s ``input`` has
        ``output_split_sizes[r]`` rows (dim 0) and the same shape after dim 0 on every rank;
        ``output`` has ``sum(output_split_sizes)`` rows. Every rank must pass the same sizes:
        a rank cannot see the others', so a mismatch is caught only by the transport.

        Raises:
            TypeError: not tensors, dtypes differ, sizes not ints.
            ValueError: 0-d tensors, sizes of the wrong length, negative or not summing to
                ``output.shape[0]``, ``input.shape[0]`` not this rank's size, shapes after
                dim 0 differing, a wrong device type or ``output``'s elements sharing memory.
        """
        tail = self._check_tensor(input, "all_gather", reduction=False)
        self._check_tensor(output, "all_gather", reduction=False)
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
        src, out = plain(input), plain(output, "all_gather")
        if overlap(src, out):
            src = src.clone()
        splits = tuple(n * row for n in rows)  # equal on every rank, unlike the input's size
        desc = Description("all_gather", next(self._seq), out.numel(), tail, "uneven",
                           splits=splits)
        return self._issue("all_gather", self._all_gather_v,
                           (flat(out), flat(src), list(splits)), desc,
                           output, out, None, async_op)

    # ------------------------------------------------------------------ backend hooks
    def _all_gather_v(self, output: torch.Tensor, input: torch.Tensor, counts: list[int],
                      description: DescriptionLike) -> Work:
        """Start an all-gather of contiguous 1-D tensors of ``counts[r]`` elements per rank.

        This default is an emulation over ``_all_gather``: every input padded to the largest
        count, gathered, and the pieces copied out (``world_size * max(counts)`` moved).
        """
        width = max(counts)
        padded = input.new_zeros(width)
        padded[: input.numel()] = input
        gathered = output.new_empty(self._world_size * width)
        work = self._all_gather(gathered, padded, description)

        def unpad() -> None:
            at = 0
            for r, n in enumerate(counts):
                output[at:at + n] = gathered[r * width:r * width + n]
                at += n

        work.add_callback(unpad)
        return work

    def _all_gather(self, output: torch.Tensor, input: torch.Tensor,
                    description: DescriptionLike) -> Work:
        raise NotImplementedError  # pragma: no cover - Communicator declares it abstract

    def _reduce_scatter(self, output: torch.Tensor, input: torch.Tensor, op: ReduceOp,
                        description: DescriptionLike) -> Work:
        """Start a reduce-scatter of contiguous 1-D tensors (``input`` world_size times longer)
        with an op in native_reduce_ops.

        This default is an emulation: an all-reduce of a copy of ``input``, then this rank's
        chunk copied out (``world_size`` times the traffic of a native reduce-scatter).
        """
        n = output.numel()
        acc = input.clone()
        work = self._all_reduce(acc, op, description)
        chunk = acc[self._rank * n:(self._rank + 1) * n]
        work.add_callback(lambda: output.copy_(chunk))
        return work

    def _all_reduce(self, tensor: torch.Tensor, op: ReduceOp,
                    description: DescriptionLike) -> Work:
        raise NotImplementedError  # pragma: no cover - Communicator declares it abstract

    def _all_to_all(self, output: torch.Tensor, input: torch.Tensor, output_counts: list[int],
                    input_counts: list[int], description: DescriptionLike) -> Work:
        """Start an all-to-all of contiguous 1-D tensors; ``*_counts`` are element counts per
        rank (rank order, summing to each tensor's numel)."""
        raise NotImplementedError(f"the {self.backend} backend has no all_to_all")

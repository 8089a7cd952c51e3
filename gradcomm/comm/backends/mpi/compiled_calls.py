"""The MPI communicator's calls through the compiled calls (:mod:`.compiled`).

Each blocking collective of :class:`CompiledCalls` first offers the call to the compiled calls of
its communicator (``batch_isend_irecv`` is theirs, bound to the instance: see
:func:`.compiled.bind_batch`). They decline (None) any call the Python short
path of :mod:`gradcomm.comm._issue` would not take, and then the inherited Python method runs,
checks and raises as always. The arguments and results are those of
:class:`~gradcomm.comm.Communicator`'s methods, whose docstrings apply.
"""

from __future__ import annotations

from typing import Any

import torch

from ...communicator import Communicator
from ...types import ReduceOp
from ...work import CompletedWork, Work

__all__ = ["CompiledCalls"]

_SUM = ReduceOp.SUM
_DONE = CompletedWork


class CompiledCalls(Communicator):
    """Blocking collectives of plain CPU tensors in one compiled call
    (see the module docstring).

    ``_compiled`` is the communicator's ``Calls`` object (None: off, closed, or device memory),
    set by the MPI communicator. A call returns None (declined: nothing posted), the completed
    ``CompletedWork``, or the pending ``MPIWork`` of a collective
    still running after the compiled poll's budget, already in the communicator's pending list,
    which is then waited for as on the Python path.
    """

    _compiled: Any

    def all_reduce(self, tensor: torch.Tensor, op: ReduceOp | str = _SUM, *,
                   async_op: bool = False, label: str | None = None) -> Work:
        calls = self._compiled
        if (calls is not None and async_op is False and op is _SUM
                and (label is None or label.__class__ is str)):
            work = calls.all_reduce(tensor, label)
            if work is not None:
                return work if work.__class__ is _DONE else self._complete(work, False, tensor)
        return super().all_reduce(tensor, op, async_op=async_op, label=label)

    def reduce_scatter(self, output: torch.Tensor, input: torch.Tensor,
                       op: ReduceOp | str = _SUM, *, async_op: bool = False,
                       label: str | None = None) -> Work:
        calls = self._compiled
        if (calls is not None and async_op is False and op is _SUM
                and (label is None or label.__class__ is str)):
            work = calls.reduce_scatter(output, input, label)
            if work is not None:
                return work if work.__class__ is _DONE else self._complete(work, False, output)
        return super().reduce_scatter(output, input, op, async_op=async_op, label=label)

    def all_gather(self, output: torch.Tensor, input: torch.Tensor,
                   output_split_sizes: list[int] | None = None, *,
                   async_op: bool = False) -> Work:
        calls = self._compiled
        if calls is not None and async_op is False and output_split_sizes is None:
            work = calls.all_gather(output, input)
            if work is not None:
                return work if work.__class__ is _DONE else self._complete(work, False, output)
        return super().all_gather(output, input, output_split_sizes, async_op=async_op)

    def all_to_all(self, output: torch.Tensor, input: torch.Tensor,
                   output_split_sizes: list[int] | None = None,
                   input_split_sizes: list[int] | None = None, *,
                   async_op: bool = False) -> Work:
        calls = self._compiled
        if (calls is not None and async_op is False and output_split_sizes is None
                and input_split_sizes is None):
            work = calls.all_to_all(output, input)
            if work is not None:
                return work if work.__class__ is _DONE else self._complete(work, False, output)
        return super().all_to_all(output, input, output_split_sizes, input_split_sizes,
                                  async_op=async_op)

    def broadcast(self, tensor: torch.Tensor, src: int = 0, *, async_op: bool = False) -> Work:
        calls = self._compiled
        if calls is not None and async_op is False:
            work = calls.broadcast(tensor, src)
            if work is not None:
                return work if work.__class__ is _DONE else self._complete(work, False, tensor)
        return super().broadcast(tensor, src, async_op=async_op)

    def reduce(self, tensor: torch.Tensor, dst: int = 0, op: ReduceOp | str = _SUM, *,
               async_op: bool = False, label: str | None = None) -> Work:
        calls = self._compiled
        if (calls is not None and async_op is False and op is _SUM
                and (label is None or label.__class__ is str)):
            work = calls.reduce(tensor, dst)
            if work is not None:
                return work if work.__class__ is _DONE else self._complete(work, False, tensor)
        return super().reduce(tensor, dst, op, async_op=async_op, label=label)

    def gather(self, output: torch.Tensor | None, input: torch.Tensor, dst: int = 0, *,
               async_op: bool = False) -> Work:
        calls = self._compiled
        if calls is not None and async_op is False:
            work = calls.gather(output, input, dst)
            if work is not None:  # output is a tensor on the root, ignored elsewhere
                return work if work.__class__ is _DONE else self._complete(
                    work, False, output if self._rank == dst else None)
        return super().gather(output, input, dst, async_op=async_op)

    def scatter(self, output: torch.Tensor, input: torch.Tensor | None, src: int = 0, *,
                async_op: bool = False) -> Work:
        calls = self._compiled
        if calls is not None and async_op is False:
            work = calls.scatter(output, input, src)
            if work is not None:
                return work if work.__class__ is _DONE else self._complete(work, False, output)
        return super().scatter(output, input, src, async_op=async_op)

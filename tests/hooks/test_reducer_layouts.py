"""Gradient layouts and dtypes: non-contiguous, channels_last, odd strides, size-1 dims, sparse
gradients, integer ``ReduceOp.AVG``, and half precision (fp16 sums that would overflow, averages
that would underflow, bf16 against references).

The cases ``layouts``, ``sparse_and_int`` and ``half`` of ``reducer_cases`` on every backend are the
module tier's (``tests/hooks/suite_reducer.py``); here, a 4-rank gloo run and an 8-rank thread
run check that averages of 1e-7 do not underflow to zero and a float16 sum does not overflow.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import gradcomm
from gradcomm.comm.backends.threads import ThreadCommunicator, ThreadGroup
from gradcomm.hooks import GradientReducer

from tests._support.dist_utils import run_processes


def _tiny_average(comm: gradcomm.Communicator) -> list[torch.Tensor]:
    out = []
    for dtype in (torch.float16, torch.bfloat16):
        p = nn.Parameter(torch.zeros(5, dtype=dtype))
        GradientReducer([p], comm)
        (p * torch.tensor(1e-7, dtype=dtype)).sum().backward()
        assert p.grad is not None
        out.append(p.grad)
    return out


def _gloo_tiny_average(rank: int, world_size: int) -> list[list[float]]:
    with gradcomm.init("gloo", timeout=30) as comm:
        out = [g.float().tolist() for g in _tiny_average(comm)]
        # Large float16 values on 4+ ranks: the default pre-divide (2) lets the float16 sum
        # overflow (4 x 20000); gradient_predivide_factor=world_size keeps it in range.
        p = nn.Parameter(torch.zeros(5, dtype=torch.float16))
        GradientReducer([p], comm, gradient_predivide_factor=float(world_size))
        (p * torch.tensor(40000.0, dtype=torch.float16)).sum().backward()
        assert p.grad is not None
        return [*out, p.grad.float().tolist()]


def _want_tiny() -> list[list[float]]:
    # the average of equal values is that value, in each dtype (1e-7 is subnormal in float16)
    return [torch.full((5,), 1e-7, dtype=d).float().tolist() for d in (torch.float16,
                                                                       torch.bfloat16)]


@pytest.mark.slow
@pytest.mark.multiprocess
def test_gloo_four_ranks_half_average_neither_underflows_nor_overflows() -> None:
    for got in run_processes(_gloo_tiny_average, 4, timeout=100):
        assert got[:2] == _want_tiny()
        assert all(v > 0 for row in got[:2] for v in row)
        assert got[2] == [40000.0] * 5


def test_threads_eight_ranks_tiny_half_average_does_not_underflow() -> None:
    def fn(comm: ThreadCommunicator) -> list[list[float]]:
        return [g.float().tolist() for g in _tiny_average(comm)]

    for got in ThreadGroup(8, timeout=30).run(fn):
        assert got == _want_tiny()

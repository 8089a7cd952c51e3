"""Smoke test of the harness and the gloo backend on two real processes."""

import pytest
import torch

import gradcomm

from tests._support.dist_utils import run_processes


def _avg(rank: int, world_size: int) -> list[float]:
    with gradcomm.init("gloo", timeout=30) as comm:
        t = torch.full((3,), float(rank + 1))
        comm.all_reduce(t, "avg")
        return t.tolist()


@pytest.mark.slow
@pytest.mark.multiprocess
def test_gloo_avg_two_processes() -> None:
    out = run_processes(_avg, 2, timeout=60)
    assert out == [[1.5, 1.5, 1.5]] * 2

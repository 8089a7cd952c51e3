"""GradientReducer(hierarchical=True): gradients against the single-process reference on the same
global batch and against the flat reducer, bit-identical across ranks; option checks."""

from __future__ import annotations

import os

import pytest
import torch

import gradcomm
from gradcomm.comm.backends.threads import ThreadGroup
from gradcomm.hooks import GradientReducer

from tests._support import ranks
from tests._support.p2p_split_checks import expect_error
from tests._support.ranks import RankRunner
from tests._support.reducer_common import (
    batch,
    eval_bn,
    flat_grads,
    global_batch,
    grads_close,
    loss_fn,
    make_model,
    reference_grads,
)


def _grads(comm: gradcomm.Communicator, hierarchical: bool) -> torch.Tensor:
    model = eval_bn(make_model())
    # small buckets: several collectives, and bucket sizes that are not multiples of 2
    reducer = GradientReducer(model, comm, bucket_cap_mb=0.0005, hierarchical=hierarchical)
    x, y = batch(comm.rank)
    loss_fn(model, x, y).backward()
    got = {n: p.grad for n, p in model.named_parameters()}
    bad = grads_close(got, reference_grads(comm.world_size), rtol=1e-5)
    assert not bad, bad
    assert len(reducer.buckets) > 1
    return flat_grads(model)


def _hierarchical(comm: gradcomm.Communicator) -> str:
    rank, world_size = comm.rank, comm.world_size
    os.environ["GRADCOMM_HOST_ID"] = f"host{rank // 2}"  # 2 hosts x 2 ranks
    hier = _grads(comm, True)
    flat = _grads(comm, False)
    assert torch.allclose(hier, flat, rtol=1e-6, atol=1e-7)
    everyone = torch.empty(world_size * hier.numel(), dtype=hier.dtype)
    comm.all_gather(everyone, hier)
    rows = everyone.view(world_size, -1).view(torch.uint8)
    assert all(torch.equal(rows[0], rows[q]) for q in range(world_size))
    # hosts of unequal size: refused on every rank
    os.environ["GRADCOMM_HOST_ID"] = f"host{min(rank, 1)}"  # 1 + 3
    expect_error(ValueError, lambda: GradientReducer(eval_bn(make_model()), comm,
                                                     hierarchical=True), "same number")
    return "ok"


# Spawned gloo ranks only: each rank names its host in its own process environment, which
# thread ranks share.
@pytest.mark.timeout(240)
@pytest.mark.parametrize("comm_runner", [ranks.GLOO], indirect=True)
def test_hierarchical_matches_reference_and_flat_on_two_fake_hosts(comm_runner: RankRunner
                                                                   ) -> None:
    assert comm_runner(_hierarchical, 4, timeout=200) == ["ok"] * 4


def test_hierarchical_option_checks() -> None:
    def body(comm: gradcomm.Communicator) -> None:
        model = make_model()
        expect_error(TypeError, lambda: GradientReducer(model, comm, hierarchical="yes"),
                     "hierarchical")
        expect_error(ValueError, lambda: GradientReducer(model, comm, hierarchical=True,
                                                         comm_hook="fp16_compress"), "comm_hook")
        reducer = GradientReducer(eval_bn(model), comm, hierarchical=True)
        x, y = global_batch(1)
        loss_fn(model, x, y).backward()  # world_size 1: the local gradients
        assert reducer.buckets

    ThreadGroup(1).run(body)

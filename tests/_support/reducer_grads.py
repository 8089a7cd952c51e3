"""GradientReducer values against one-process references, on every rank of any backend
(``tests/hooks/suite_reducer.py`` runs it on every backend).

Checks, on every rank: gradients equal one process's gradients on the concatenated global batch
(float32, 1e-6 of each tensor's max), are bit-identical across ranks, overlapped equal
end-of-backward and in-place reduction (some or every gradient reduced in place in
``param.grad``) bit for bit, a head unused on rank 1 averages as (g + 0) / N, a layer unused
everywhere keeps ``grad=None``, and float16 buckets match the float32 average cast back within
one ulp. A wrong value raises AssertionError naming the check.
"""

from __future__ import annotations

import math

import torch
from torch import nn

import gradcomm
from gradcomm.hooks import GradientReducer

from tests._support.reducer_common import (
    batch,
    eval_bn,
    flat_grads,
    grads_close,
    loss_fn,
    make_model,
    reference_grads,
)


def identical_across_ranks(comm: gradcomm.Communicator, t: torch.Tensor) -> bool:
    every = torch.empty(comm.world_size * t.numel(), dtype=t.dtype)
    comm.all_gather(every, t)
    rows = every.view(comm.world_size, -1)
    return bool(((rows == rows[0]) | (rows.isnan() & rows[0].isnan())).all())  # NaN: grad None


def reducer_values(comm: gradcomm.Communicator) -> tuple[int, int, str]:
    """Run the checks on this rank; ``(rank, world size, backend)``."""
    rank, ws = comm.rank, comm.world_size
    ref = reference_grads(ws)

    flats = []
    # overlapped and at the end of backward; with fc1.weight and fc2.weight, or every gradient,
    # reduced in place
    for overlap, in_place in ((True, math.inf), (False, math.inf), (True, 0.0009), (False, 0.0)):
        model = eval_bn(make_model(seed=rank))
        reducer = GradientReducer(model, comm, bucket_cap_mb=0.002, first_bucket_cap_mb=0.0005,
                                  overlap=overlap, in_place_min_mb=in_place)
        loss_fn(model, *batch(rank)).backward()
        bad = grads_close({n: p.grad for n, p in model.named_parameters()}, ref)
        assert not bad, f"global-batch reference (overlap={overlap}, in_place={in_place}): {bad}"
        flats.append(flat_grads(model))
        reducer.remove()
    for other in flats[1:]:
        assert torch.equal(flats[0], other), "overlapped != end-of-backward or in place"
    assert identical_across_ranks(comm, flats[0]), "grads differ across ranks"

    # MPI on host memory has cheap collectives: gradients of 2 MiB and more go in place
    auto = GradientReducer(nn.Linear(800, 800), comm)  # a 2.4 MiB weight and a small bias
    cheap = comm.backend == "mpi"
    assert comm.cheap_collectives is cheap, "cheap_collectives"
    assert auto.in_place_min_mb == (2.0 if cheap else math.inf), "default in_place_min_mb"
    assert [b.in_place for b in auto.buckets] == ([False, True] if cheap else [False])
    auto.remove()

    # unused on rank 1 only, and unused everywhere (through shared buckets, and in place)
    want = torch.zeros_like(make_model().head_b.weight)
    for r in range(ws):
        if r != 1:
            local = eval_bn(make_model())
            loss_fn(local, *batch(r)).backward()
            want += local.head_b.weight.grad
    want /= ws
    for in_place in (math.inf, 0.0):
        model = eval_bn(make_model())
        model.extra = nn.Linear(2, 2)
        GradientReducer(model, comm, in_place_min_mb=in_place)
        loss_fn(model, *batch(rank), use_b=(rank != 1)).backward()
        assert model.extra.weight.grad is None and model.extra.bias.grad is None, (
            f"unused everywhere (in_place={in_place})")
        got = model.head_b.weight.grad
        assert got is not None and torch.allclose(got, want, rtol=1e-5, atol=1e-7), (
            f"unused on rank 1 (in_place={in_place})")
        assert identical_across_ranks(comm, flat_grads(model)), "unused: grads differ across ranks"

    # float16 bucket: the float32 average cast back, within one ulp
    def local_half(r: int) -> torch.Tensor:
        g = torch.Generator().manual_seed(100 + r)
        return (torch.randn(101, generator=g) * 300).to(torch.float16)

    p = nn.Parameter(torch.zeros(101, dtype=torch.float16))
    GradientReducer([p], comm)
    (p * local_half(rank)).sum().backward()
    want16 = (sum(local_half(r).float() for r in range(ws)) / ws).to(torch.float16)
    assert p.grad is not None
    ulps = (p.grad.view(torch.int16).int() - want16.view(torch.int16).int()).abs()
    same_sign = (p.grad.sign() == want16.sign()) | (want16 == 0) | (p.grad == 0)
    assert bool(same_sign.all()) and int(ulps.max()) <= 1, f"fp16: {int(ulps.max())} ulps"

    comm.barrier()
    return rank, ws, comm.backend

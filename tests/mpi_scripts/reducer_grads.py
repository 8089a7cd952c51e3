"""Run under ``mpiexec -n N`` (any N >= 1): GradientReducer values against one-process references.

Backend from ``GRADCOMM_BACKEND`` (the test sets ``mpi``). Checks, on every rank: gradients equal
one process's gradients on the concatenated global batch (float32, 1e-6 of each tensor's max), are
bit-identical across ranks, overlapped equal end-of-backward bit for bit, a head unused on rank 1
averages as (g + 0) / N, a layer unused everywhere keeps ``grad=None``, and float16 buckets match
the float32 average cast back within one ulp. Prints ``RESULT ok rank=<r> world=<n>``; a wrong value
raises AssertionError naming the check (non-zero exit).
"""

from __future__ import annotations

import torch
from reducer_common import (
    batch,
    eval_bn,
    flat_grads,
    grads_close,
    loss_fn,
    make_model,
    reference_grads,
)
from torch import nn

import gradcomm
from gradcomm.hooks import GradientReducer


def identical_across_ranks(comm: gradcomm.Communicator, t: torch.Tensor) -> bool:
    every = torch.empty(comm.world_size * t.numel(), dtype=t.dtype)
    comm.all_gather(every, t)
    rows = every.view(comm.world_size, -1)
    return bool(((rows == rows[0]) | (rows.isnan() & rows[0].isnan())).all())  # NaN: grad None


def main() -> None:
    torch.set_num_threads(1)
    comm = gradcomm.init(timeout=60)
    rank, ws = comm.rank, comm.world_size
    ref = reference_grads(ws)

    flats = []
    for overlap in (True, False):
        model = eval_bn(make_model(seed=rank))
        reducer = GradientReducer(model, comm, bucket_cap_mb=0.002, first_bucket_cap_mb=0.0005,
                                  overlap=overlap)
        loss_fn(model, *batch(rank)).backward()
        bad = grads_close({n: p.grad for n, p in model.named_parameters()}, ref)
        assert not bad, f"global-batch reference (overlap={overlap}): {bad}"
        flats.append(flat_grads(model))
        reducer.remove()
    assert torch.equal(flats[0], flats[1]), "overlapped != end-of-backward"
    assert identical_across_ranks(comm, flats[0]), "grads differ across ranks"

    # unused on rank 1 only, and unused everywhere
    model = eval_bn(make_model())
    model.extra = nn.Linear(2, 2)
    GradientReducer(model, comm)
    loss_fn(model, *batch(rank), use_b=(rank != 1)).backward()
    assert model.extra.weight.grad is None and model.extra.bias.grad is None, "unused everywhere"
    want = torch.zeros_like(model.head_b.weight)
    for r in range(ws):
        if r != 1:
            local = eval_bn(make_model())
            loss_fn(local, *batch(r)).backward()
            want += local.head_b.weight.grad
    want /= ws
    got = model.head_b.weight.grad
    assert got is not None and torch.allclose(got, want, rtol=1e-5, atol=1e-7), "unused on rank 1"
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
    print(f"RESULT ok rank={rank} world={ws} backend={comm.backend}", flush=True)
    comm.close()


if __name__ == "__main__":
    main()

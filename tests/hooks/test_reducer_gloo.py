"""GradientReducer over real gloo process groups (spawned processes); values against references.

One spawned run checks several things, to keep the suite fast.
"""

from __future__ import annotations

import io
import math
import warnings
from typing import Any

import pytest
import torch
from torch import nn

import gradcomm
from gradcomm.hooks import GradientReducer

from tests._support.dist_utils import run_processes
from tests._support.reducer_common import (
    ComplexNet,
    batch,
    complex_batch,
    complex_loss,
    complex_reference_grads,
    eval_bn,
    flat_grads,
    global_batch,
    grads_close,
    loss_fn,
    make_model,
    reference_grads,
    ulp_distance,
)


def half_grad(rank: int, dtype: torch.dtype) -> torch.Tensor:
    """Rank ``rank``'s local gradient in the half-precision test: wide range, up to 40000."""
    g = torch.Generator().manual_seed(100 + rank)
    mag = torch.exp(torch.empty(257).uniform_(-8.0, 10.6, generator=g))  # about 3e-4 .. 40000
    sign = torch.where(torch.rand(257, generator=g) < 0.5, -1.0, 1.0)
    out = (mag * sign).to(dtype)
    out[0] = 40000.0  # both ranks: an fp16 sum of 80000 would overflow
    return out


def _as_bytes(obj: Any) -> bytes:
    # Tensors sent through a multiprocessing queue share memory with the (exiting) child; bytes
    # of torch.save do not.
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def _gloo_checks(rank: int, world_size: int) -> bytes:
    torch.set_num_threads(1)
    out: dict[str, Any] = {}
    with gradcomm.init("gloo", timeout=60) as comm:
        # 1. values against the global-batch reference, overlapped and at the end of backward,
        # and with some (fc1.weight, fc2.weight) or every gradient reduced in place
        configs = ((True, math.inf), (False, math.inf), (True, 0.0009), (False, 0.0))
        for overlap, in_place in configs:
            model = eval_bn(make_model(seed=rank))
            reducer = GradientReducer(model, comm, bucket_cap_mb=0.002,
                                      first_bucket_cap_mb=0.0005, overlap=overlap,
                                      in_place_min_mb=in_place)
            loss_fn(model, *batch(rank)).backward()
            key = f"overlap={overlap} in_place={in_place}"
            out[f"grads {key}"] = {n: p.grad.clone() for n, p in model.named_parameters()}
            out[f"flat {key}"] = flat_grads(model)
            out[f"nbuckets {key}"] = len(reducer.buckets)
            reducer.remove()

        # 2. unused on one rank and on all ranks (through shared buckets, and in place)
        for in_place in (math.inf, 0.0):
            model = eval_bn(make_model())
            model.extra = nn.Linear(2, 2)
            GradientReducer(model, comm, in_place_min_mb=in_place)
            loss_fn(model, *batch(rank), use_b=(rank == 0)).backward()
            out[f"unused in_place={in_place}"] = {n: None if p.grad is None else p.grad.clone()
                                                  for n, p in model.named_parameters()}

        # 3. fp16 and bf16 buckets; one SlowPathWarning per (backend, dtype, device)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for _step in range(2):  # the second round must not warn again
                for dtype in (torch.float16, torch.bfloat16):
                    p = nn.Parameter(torch.zeros(257, dtype=dtype))
                    red = GradientReducer([p], comm)
                    (p * half_grad(rank, dtype)).sum().backward()
                    out[f"half_{dtype}"] = p.grad.clone()
                    red.remove()
        out["slow_warnings"] = sorted(str(w.message).split(" buckets")[0] for w in caught
                                      if issubclass(w.category, gradcomm.SlowPathWarning))

        # 4. bucket views alias the grads, and no_sync accumulation
        model = eval_bn(make_model())
        reducer = GradientReducer(model, comm, gradient_as_bucket_view=True)
        with reducer.no_sync():
            loss_fn(model, *batch(rank, seed=7)).backward()
        loss_fn(model, *batch(rank, seed=8)).backward()
        b = reducer._buckets[0]
        lo, hi = b.flat.data_ptr(), b.flat.data_ptr() + b.numel * b.flat.element_size()
        out["aliased"] = all(lo <= p.grad.data_ptr() < hi for p in b.params if p.numel())
        out["no_sync"] = flat_grads(model)

        # 5. complex parameters: no transport reduces them; their real view is reduced
        cmodel = ComplexNet()
        GradientReducer(cmodel, comm)
        complex_loss(cmodel, complex_batch(rank)).backward()
        out["complex"] = {n: p.grad.clone() for n, p in cmodel.named_parameters()}
        # ... also where autograd hands out a lazy conjugate gradient (w.conj()), reduced in place
        cmodel = ComplexNet(conj=True)
        GradientReducer(cmodel, comm, in_place_min_mb=0.0)
        complex_loss(cmodel, complex_batch(rank)).backward()
        out["complex_conj"] = {n: p.grad.clone() for n, p in cmodel.named_parameters()}

        # 6. a model that differs across ranks: ValueError on every rank (the group stays usable)
        try:
            GradientReducer(nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2 + rank)), comm)
            out["mismatch"] = "no error"
        except ValueError as exc:
            out["mismatch"] = str(exc)
        comm.barrier()
    return _as_bytes(out)


@pytest.mark.slow
@pytest.mark.multiprocess
def test_gloo_two_ranks_values() -> None:
    ws = 2
    res = [torch.load(io.BytesIO(b)) for b in run_processes(_gloo_checks, ws, timeout=120)]
    ref = reference_grads(ws)
    # every grad equals one process's grad on the concatenated batch; ranks bit-identical
    first = "overlap=True in_place=inf"
    for r in res:
        assert r[f"nbuckets {first}"] > 2
        assert r["nbuckets overlap=False in_place=0.0"] == len(ref)  # one per parameter
        assert grads_close(r[f"grads {first}"], ref) == []
        for key in ("overlap=False in_place=inf", "overlap=True in_place=0.0009",
                    "overlap=False in_place=0.0"):
            assert torch.equal(r[f"flat {first}"], r[f"flat {key}"]), key
        assert torch.equal(r[f"flat {first}"], res[0][f"flat {first}"])

    # unused on rank 1 only: (g + 0) / 2; unused everywhere: None
    local = eval_bn(make_model())
    loss_fn(local, *batch(0), use_b=True).backward()
    for r in res:
        for in_place in (math.inf, 0.0):
            unused = r[f"unused in_place={in_place}"]
            assert unused["extra.weight"] is None and unused["extra.bias"] is None
            assert torch.allclose(unused["head_b.weight"], local.head_b.weight.grad / 2,
                                  rtol=1e-6, atol=0)

    # half precision: fp32 reference cast back, within one ulp; finite (no overflow)
    for dtype in (torch.float16, torch.bfloat16):
        want = ((half_grad(0, dtype).float() + half_grad(1, dtype).float()) / 2).to(dtype)
        for r in res:
            got = r[f"half_{dtype}"]
            assert torch.isfinite(got).all()
            assert ulp_distance(got, want) <= 1
    for r in res:
        assert r["slow_warnings"] == ["gradcomm: gloo reduces torch.bfloat16",
                                      "gradcomm: gloo reduces torch.float16"]
        assert r["aliased"]

    for key, conj in (("complex", False), ("complex_conj", True)):
        for name, want in complex_reference_grads(ws, conj).items():
            for r in res:
                got = r[key][name]
                assert got.dtype == want.dtype and torch.allclose(got, want, rtol=1e-5, atol=1e-6)

    # no_sync: the sum of two micro-batches' global-batch gradients
    ref_model = eval_bn(make_model())
    for seed in (7, 8):
        loss_fn(ref_model, *global_batch(ws, seed=seed)).backward()
    want = flat_grads(ref_model)
    for r in res:
        assert torch.allclose(r["no_sync"], want, rtol=1e-5, atol=1e-7)
        assert torch.equal(r["no_sync"], res[0]["no_sync"])
        assert "1.weight" in r["mismatch"] and "(3, 4)" in r["mismatch"]
        assert "rank 1" in r["mismatch"]


def test_gloo_world_size_one_issues_no_collective() -> None:
    comm = gradcomm.init("gloo", rank=0, world_size=1, env={})
    calls = []
    for name in ("_all_reduce", "_broadcast", "_all_gather", "_barrier"):
        setattr(comm, name, lambda *a, _n=name, **k: calls.append(_n))
    model = eval_bn(make_model())
    GradientReducer(model, comm)
    loss_fn(model, *batch(0)).backward()
    half = nn.Parameter(torch.zeros(3, dtype=torch.float16))
    GradientReducer([half], comm)
    with warnings.catch_warnings():
        warnings.simplefilter("error", gradcomm.SlowPathWarning)  # no collective: no slow path
        (half * 3).sum().backward()
    assert calls == []
    assert torch.equal(half.grad, torch.full((3,), 3.0, dtype=torch.float16))
    assert grads_close({n: p.grad for n, p in model.named_parameters()}, reference_grads(1)) == []
    comm.close()

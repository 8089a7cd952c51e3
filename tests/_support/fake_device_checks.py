"""Per-rank checks of every layer on the fake device, against the same run on the CPU.

:func:`run_device_checks` runs on every rank of a real CPU transport (gloo and mpi runs of the
module tier: ``tests/comm/suite_fake_device.py``).
Each case trains the same model twice with the same transport -- once on the CPU, once with every
parameter, buffer and bucket on :data:`fake_device.FAKE` through a
:class:`fake_device.FakeDeviceCommunicator` -- and returns what differs (empty: bit for bit equal).
"""

from __future__ import annotations

import math
from typing import Any

import torch

import gradcomm.profiler
from gradcomm.bench.sweep import run_sweep
from gradcomm.comm import Communicator, ReduceOp
from gradcomm.hooks import GradientReducer

from tests._support.fake_device import (
    FakeDeviceCommunicator,
    fake_device,
    to_cpu,
    to_fake,
    to_fake_module,
)
from tests._support.reducer_common import batch, loss_fn, make_model

__all__ = ["CASES", "run_device_checks"]

#: name -> GradientReducer options. Small caps make many buckets out of the small test model.
CASES: dict[str, dict[str, Any]] = {
    "overlap, many buckets": dict(bucket_cap_mb=0.002, first_bucket_cap_mb=0.0005, overlap=True,
                                  in_place_min_mb=math.inf),
    "end of backward": dict(bucket_cap_mb=0.002, overlap=False, in_place_min_mb=math.inf),
    "bucket views": dict(bucket_cap_mb=0.002, gradient_as_bucket_view=True,
                         in_place_min_mb=math.inf),
    "in-place buckets": dict(bucket_cap_mb=0.002, in_place_min_mb=0.0009),
    "every bucket in place": dict(in_place_min_mb=0.0),
    "fp16 compression": dict(bucket_cap_mb=0.002, comm_hook="fp16_compress",
                             in_place_min_mb=math.inf),
    "bf16 compression": dict(bucket_cap_mb=0.002, comm_hook="bf16_compress",
                             in_place_min_mb=0.0009),
}


def _bits(t: torch.Tensor) -> torch.Tensor:
    """The raw bits of ``t`` (NaN and -0.0 compared exactly)."""
    flat = t.detach().contiguous().view(-1)
    return flat.view(torch.uint8) if flat.dtype != torch.bool else flat


def _same(a: torch.Tensor | None, b: torch.Tensor | None) -> bool:
    if a is None or b is None:
        return a is None and b is None
    a, b = to_cpu(a), to_cpu(b)
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(_bits(a), _bits(b))


def _train(comm: Communicator, rank: int, options: dict[str, Any], on_fake: bool,
           steps: int = 2) -> tuple[dict[str, Any], list[tuple[str, int, str]]]:
    """Two steps of SGD-free backward passes; the grads, params and buffers, and the profile."""
    model = make_model(seed=rank)  # ranks differ: the broadcast at construction must equalise
    if on_fake:
        to_fake_module(model)
    reducer = GradientReducer(model, comm, **options)
    out: dict[str, Any] = {}
    with gradcomm.profiler.profile(comm) as prof:
        for step in range(steps):
            x, y = batch(rank, seed=10 + step)
            if on_fake:
                x, y = to_fake(x), to_fake(y)
            for p in model.parameters():
                p.grad = None
            loss_fn(model, x, y, use_b=step == 0).backward()
            for name, p in model.named_parameters():
                out[f"step {step} grad {name}"] = None if p.grad is None else to_cpu(p.grad)
            with torch.no_grad():  # a plain update, so step 1 starts from different weights
                for p in model.parameters():
                    if p.grad is not None:
                        p.sub_(0.1 * p.grad)
    for name, t in [*model.named_parameters(), *model.named_buffers()]:
        out[f"final {name}"] = to_cpu(t)
    reducer.remove()
    # In launch order: records are appended at completion, and async ones may complete in any.
    ops = [(r.op, r.bytes, r.dtype) for r in sorted(prof.records, key=lambda r: r.start)]
    return out, ops


def _diff(cpu: dict[str, Any], fake: dict[str, Any]) -> list[str]:
    if cpu.keys() != fake.keys():
        return [f"keys differ: {sorted(set(cpu) ^ set(fake))}"]
    return [k for k in cpu if not _same(cpu[k], fake[k])]


def _collectives(comm: Communicator, fake: FakeDeviceCommunicator) -> list[str]:
    """The communicator's own collectives on the fake device (non-contiguous, AVG, all_gather)."""
    ws, rank = comm.world_size, comm.rank
    problems = []
    base = torch.arange(12, dtype=torch.float32).view(3, 4) + rank
    want = base.clone()
    comm.all_reduce(want, ReduceOp.AVG)
    got = to_fake(base)
    fake.all_reduce(got.t(), ReduceOp.AVG)  # non-contiguous: copy-in, copy-out
    if not _same(want, got):
        problems.append("all_reduce AVG of a transposed view")
    half = (torch.arange(8, dtype=torch.float16) * 1000 + rank)
    want_h = half.clone()
    comm.all_reduce(want_h, ReduceOp.AVG)
    got_h = to_fake(half)
    fake.all_reduce(got_h, ReduceOp.AVG)
    if not _same(want_h, got_h):
        problems.append("all_reduce AVG float16")
    mine = torch.full((5,), rank, dtype=torch.int64)
    out = to_fake(torch.empty(5 * ws, dtype=torch.int64))
    fake.all_gather(out, to_fake(mine))
    if not _same(out, torch.arange(ws).repeat_interleave(5)):
        problems.append("all_gather int64")
    slot = out[rank * 5:(rank + 1) * 5]  # input aliasing this rank's slot of the output
    fake.all_gather(out, slot)
    if not _same(out, torch.arange(ws).repeat_interleave(5)):
        problems.append("all_gather from its own slot")
    src = to_fake(torch.full((3,), float(rank)))
    fake.broadcast(src, src=ws - 1)
    if not _same(src, torch.full((3,), float(ws - 1))):
        problems.append("broadcast")
    fake.barrier()
    try:
        fake.all_reduce(torch.ones(2))
        problems.append("a CPU tensor was accepted by the fake-device communicator")
    except ValueError:
        pass
    return problems


def _bench(fake: FakeDeviceCommunicator) -> list[str]:
    problems = []
    for dtype, op in ((torch.float32, ReduceOp.SUM), (torch.float16, ReduceOp.AVG),
                      (torch.int32, ReduceOp.MAX)):
        rows = run_sweep(fake, [64, 4096], dtype, op, iters=2, warmup=1, repeats=1)
        wrong = [r.wrong for r in rows]
        if wrong != [0, 0]:
            problems.append(f"bench {dtype} {op.name}: wrong elements {wrong}")
    return problems


def run_device_checks(comm: Communicator) -> dict[str, list[str]]:
    """Run every check on ``comm`` (a CPU communicator, world size >= 2); call on every rank.

    Returns:
        check name -> what differed between the CPU and the fake-device run (empty: nothing).
        The fake-device communicator wraps ``comm`` and is not closed here (``comm`` is the
        caller's).
    """
    if comm.device.type != "cpu":
        raise ValueError(f"run_device_checks wraps a CPU communicator, got {comm.device}")
    fake = FakeDeviceCommunicator(comm)
    result: dict[str, list[str]] = {}
    with fake_device():
        for name, options in CASES.items():
            cpu_out, cpu_ops = _train(comm, comm.rank, options, on_fake=False)
            fake_out, fake_ops = _train(fake, comm.rank, options, on_fake=True)
            problems = _diff(cpu_out, fake_out)
            if cpu_ops != fake_ops:
                problems.append(f"profiles differ: cpu {cpu_ops} fake {fake_ops}")
            if not any(k.startswith("final") for k in fake_out):
                problems.append("nothing was compared")
            result[name] = problems
        result["collectives"] = _collectives(comm, fake)
        result["bench"] = _bench(fake)
    return result

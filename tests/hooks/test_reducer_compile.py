"""A ``torch.compile``d model trains with the reducer attached before or after
the first call, over real gloo processes; gradients and parameters equal a single process's.

``backend="aot_eager"`` compiles forward and backward graphs with AOTAutograd (what inductor
would lower) without needing a C++ compiler, which keeps the test fast and machine-independent.
"""

from __future__ import annotations

import io
from typing import Any

import pytest
import torch

import gradcomm
from gradcomm.hooks import GradientReducer

from tests._support.dist_utils import run_processes
from tests._support.reducer_common import (
    batch,
    eval_bn,
    global_batch,
    grads_close,
    loss_fn,
    make_model,
)

STEPS = 2
WHEN = ("before", "after")
# Compiling is CPU-bound work -- importing torch._dynamo, tracing each frame, AOTAutograd -- done
# by both ranks at once, so its time grows with the machine's load; the limits leave room for a
# busy machine (they only bound a hang).
RUN_TIMEOUT = 420


def _train(comm: gradcomm.Communicator, when: str, rank: int) -> dict[str, Any]:
    model = eval_bn(make_model(seed=rank))  # different init per rank: the broadcast fixes it
    # broadcast_buffers puts a collective in the module's forward pre-hook, inside the compiled call
    opts = {"broadcast_buffers": True, "bucket_cap_mb": 0.002, "first_bucket_cap_mb": 0.0005}
    compiled = torch.compile(model, backend="aot_eager")
    if when == "after":
        compiled(batch(rank)[0])  # first call (and compilation) before the reducer exists
        GradientReducer(model, comm, **opts)
    else:
        GradientReducer(model, comm, **opts)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    grads = []
    for step in range(STEPS):
        opt.zero_grad()
        x, y = batch(rank, seed=40 + step)
        ((compiled(x) - y) ** 2).mean().backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
        opt.step()
    return {"grads": grads, "params": {n: p.detach().clone() for n, p in model.named_parameters()}}


def _child(rank: int, world_size: int) -> bytes:
    torch.set_num_threads(1)
    # A rank may wait in a collective while its peer still compiles: the same room as the run.
    with gradcomm.init("gloo", timeout=RUN_TIMEOUT) as comm:
        out = {when: _train(comm, when, rank) for when in WHEN}
    buf = io.BytesIO()
    torch.save(out, buf)
    return buf.getvalue()


@pytest.fixture(scope="module")
def results() -> list[dict[str, Any]]:
    raw = run_processes(_child, 2, timeout=RUN_TIMEOUT)
    return [torch.load(io.BytesIO(b), weights_only=False) for b in raw]


def _reference(world_size: int) -> dict[str, Any]:
    model = eval_bn(make_model(seed=0))  # not compiled
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    grads = []
    for step in range(STEPS):
        opt.zero_grad()
        loss_fn(model, *global_batch(world_size, seed=40 + step)).backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
        opt.step()
    return {"grads": grads, "params": {n: p.detach().clone() for n, p in model.named_parameters()}}


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.timeout(RUN_TIMEOUT + 60)
@pytest.mark.parametrize("when", WHEN)
def test_compiled_model_trains_like_one_process(results: list[dict[str, Any]], when: str) -> None:
    ref = _reference(2)
    for r in results:
        for step in range(STEPS):
            assert grads_close(r[when]["grads"][step], ref["grads"][step], rtol=1e-5) == [], step
        assert grads_close(r[when]["params"], ref["params"], rtol=1e-5) == []
    for name, p in results[0][when]["params"].items():
        assert torch.equal(p, results[1][when]["params"][name]), name  # ranks identical

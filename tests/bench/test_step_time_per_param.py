"""The step-time benchmark's many-parameter models and its per-parameter cost (fast, no ranks)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F

from tests._support.dist_utils import benchmark_module


@pytest.fixture(scope="module")
def st() -> Any:
    return benchmark_module("step_time")


@pytest.mark.parametrize(("name", "tensors"), [("scalars", 5000), ("small_layers", 1000)])
def test_many_parameter_models_have_their_tensor_counts_and_train(
    st: Any, name: str, tensors: int
) -> None:
    model = st.build_model(name)
    params = list(model.parameters())
    assert len(params) == tensors
    if name == "scalars":
        assert all(p.numel() == 1 for p in params)
    x, y = st.make_batches(name, rank=0, count=1)[0]
    F.cross_entropy(model(x), y).backward()
    assert all(p.grad is not None and bool(torch.isfinite(p.grad).all()) for p in params)


def test_per_param_cost_is_the_paired_median_difference_per_tensor(st: Any) -> None:
    # rounds: local 1.0 s, ddp local + 2e-3, gradcomm local + 1e-3 (one round a slow outlier)
    local = [1.0, 1.1, 0.9, 1.0, 1.2]
    fwd_bwd = {"local": local,
               "ddp": [t + 2e-3 for t in local],
               "gradcomm+gloo": [t + 1e-3 for t in local[:-1]] + [local[-1] + 5.0]}
    out = st.per_param_costs(fwd_bwd, tensors=1000)
    assert set(out) == {"ddp", "gradcomm+gloo"}
    assert out["ddp"]["us_per_param"] == pytest.approx(2.0)
    assert out["gradcomm+gloo"]["us_per_param"] == pytest.approx(1.0)
    assert out["gradcomm+gloo"]["per_param_x_ddp"] == pytest.approx(0.5)
    assert st.per_param_costs({"ddp": [1.0]}, tensors=10) == {}  # no local variant


def test_targets_check_the_per_param_ratio_on_many_parameter_models(st: Any) -> None:
    res = {"model": "scalars", "variants": {
        "gradcomm+gloo": {"per_param_x_ddp": 0.8}, "gradcomm+mpi": {"per_param_x_ddp": 1.2}}}
    checks = st.targets([res])
    assert [(c["target"], c["holds"]) for c in checks] == [
        ("gradcomm+gloo per-param cost <= 1.0x ddp (scalars)", True),
        ("gradcomm+mpi per-param cost <= 1.0x ddp (scalars)", False)]

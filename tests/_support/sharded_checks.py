"""ShardedOptimizer checks, run on gloo and mpi by ``tests/hooks/suite_sharded.py`` (the module
tier) and by ``tests/hooks/test_sharded_optimizer.py``.

Every step trains on one global batch of GLOBAL samples (a known function of the step), each rank
taking its contiguous slice, so the averaged gradient -- and hence training -- is the same at any
world size up to rounding. The reference is the same reducer without sharding and a plain torch
optimizer over the same groups (the reducer itself equals DDP, see the reducer tests).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

import gradcomm
from gradcomm.hooks import GradientReducer, ShardedOptimizer
from gradcomm.hooks._shard_grads import ShardedGrad

GLOBAL = 12  # samples per step, divisible by 2, 3 and 4
# Stage 1 steps each element with the same arithmetic as the reference: bit for bit. Stage 2
# sums by reduce-scatter, which may add the ranks' values in another order: a few ulps per step.
RTOL = {1: 0.0, 2: 1e-5}


class Model(nn.Module):
    """float32 layers, a channels_last conv, a frozen layer and a float64 head."""

    def __init__(self) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(3)
        self.conv = nn.Conv2d(2, 3, 3, padding=1).to(memory_format=torch.channels_last)
        self.a = nn.Linear(48, 7)
        self.b = nn.Linear(7, 5)
        self.frozen = nn.Linear(5, 5)
        self.frozen.requires_grad_(False)
        self.c = nn.Linear(5, 3, dtype=torch.float64)
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=g) * 0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.conv(x.contiguous(memory_format=torch.channels_last))).flatten(1)
        h = self.frozen(torch.tanh(self.b(torch.tanh(self.a(h)))))
        return self.c(h.double())


def data(step: int, rank: int, world_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    x = torch.randn(GLOBAL, 2, 4, 4, generator=g)
    y = torch.randn(GLOBAL, 3, generator=g, dtype=torch.float64)
    n = GLOBAL // world_size
    return x[rank * n:(rank + 1) * n], y[rank * n:(rank + 1) * n]


def groups(model: Model, lr: float) -> list[dict[str, Any]]:
    """Two groups with different hyperparameters (the frozen layer listed, as users do)."""
    first = [*model.conv.parameters(), *model.a.parameters(), *model.frozen.parameters()]
    return [{"params": first}, {"params": [*model.b.parameters(), *model.c.parameters()],
                                "lr": lr / 2, "weight_decay": 0.0}]


OPTIMS: dict[str, tuple[type[torch.optim.Optimizer], dict[str, Any]]] = {
    "sgd": (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9, "weight_decay": 0.01}),
    "adam": (torch.optim.Adam, {"lr": 0.01}),
    "adamw": (torch.optim.AdamW, {"lr": 0.01, "weight_decay": 0.1}),
}


def train(comm: gradcomm.Communicator, name: str, stage: int | None, steps: int, *,
          reducer_opts: dict[str, Any] | None = None, clip: float | None = None,
          start: int = 0, state: Any = None, shard_state: Any = None, model_state: Any = None,
          after: Callable[[Any, nn.Module, int], None] | None = None,
          before_step: Callable[[nn.Module, int], None] | None = None,
          zero_model: bool = False, set_to_none: bool = True) -> tuple[nn.Module, Any]:
    """Train ``steps`` steps from ``start`` (loading a full ``state``, a ``shard_state`` of
    ``sharded_state_dict()``, a model state); ``stage`` None: the unsharded reference. Step 1
    accumulates two half batches under no_sync; an LR scheduler halves lr every 2 steps.
    ``before_step`` runs between backward and step; ``zero_model``: gradients are reset with
    ``model.zero_grad()`` instead of the optimizer's; ``set_to_none`` is passed to it."""
    cls, kw = OPTIMS[name]
    model = Model()
    if model_state is not None:
        model.load_state_dict(model_state)
    reducer = GradientReducer(model, comm, bucket_cap_mb=0.0003, **(reducer_opts or {}))
    if stage is None:
        opt: Any = cls(groups(model, kw["lr"]), **kw)
    else:
        opt = ShardedOptimizer(reducer, cls, stage=stage, params=groups(model, kw["lr"]), **kw)
    if state is not None:
        opt.load_state_dict(state)
    if shard_state is not None:
        opt.load_sharded_state_dict(shard_state)
    # resumed: the schedule goes on from ``start`` (the loaded groups hold lr and initial_lr)
    sched = torch.optim.lr_scheduler.StepLR(opt, 2, 0.5, last_epoch=start - 1)
    for step in range(start, start + steps):
        x, y = data(step, comm.rank, comm.world_size)
        if step == 1:
            h = len(x) // 2
            with reducer.no_sync():
                (((model(x[:h]) - y[:h]) ** 2).sum() / len(x)).backward()
            (((model(x[h:]) - y[h:]) ** 2).sum() / len(x)).backward()
        else:
            ((model(x) - y) ** 2).mean().backward()
        if stage == 2:
            check_no_full_grads(model)
        if before_step is not None:
            before_step(model, step)
        if clip is not None:
            if stage is None:
                torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
            else:
                opt.clip_grad_norm_(clip)
        opt.step()
        sched.step()
        if zero_model:
            model.zero_grad(set_to_none)
        else:
            opt.zero_grad(set_to_none)
        if after is not None:
            after(opt, model, step)
    reducer.remove()
    return model, opt


def check_no_full_grads(model: nn.Module) -> None:
    """Stage 2 after a backward: no parameter holds a full gradient, and code that would read one
    (torch's global-norm clipping, a norm taken of ``param.grad``) raises on this rank."""
    if any(p.grad is not None and type(p.grad) is not ShardedGrad for p in model.parameters()):
        raise AssertionError("stage 2 left a full gradient in param.grad")
    expect_error(lambda: torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0), RuntimeError,
                 "opt.clip_grad_norm_()")
    grad = next(p.grad for p in model.parameters() if p.grad is not None)
    expect_error(lambda: grad.norm(), RuntimeError, "norm() on param.grad")
    if tuple(grad.shape) != tuple(next(model.parameters()).shape):
        raise AssertionError(f"stand-in gradient of shape {tuple(grad.shape)}")


def params_of(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().double().reshape(-1) for p in model.parameters()])


def identical_across_ranks(comm: gradcomm.Communicator, t: torch.Tensor) -> bool:
    every = torch.empty(comm.world_size * t.numel(), dtype=t.dtype)
    comm.all_gather(every, t)
    rows = every.view(comm.world_size, -1)
    return bool((rows == rows[0]).all())


def check_close(what: str, got: torch.Tensor, want: torch.Tensor, rtol: float) -> float:
    err = float((got - want).abs().max()) / (float(want.abs().max()) or 1.0)
    if err > rtol:
        raise AssertionError(f"{what}: relative error {err:.3g} > {rtol}")
    return err


def value_cases(comm: gradcomm.Communicator) -> list[str]:
    """Sharded == unsharded for SGD/Adam/AdamW at stages 1 and 2, with groups, a frozen layer,
    two dtypes, no_sync, an LR scheduler, several bucket layouts and global-norm clipping."""
    done = []
    cases: list[tuple[str, dict[str, Any], float | None]] = [
        ("sgd", {}, None), ("adam", {}, None), ("adamw", {}, 0.5),
        ("adam", {"in_place_min_mb": 0.0002}, None),
        ("adamw", {"gradient_as_bucket_view": True}, None),
    ]
    for name, opts, clip in cases:
        ref, _ = train(comm, name, None, 4, reducer_opts=opts, clip=clip)
        want = params_of(ref)
        for stage in (1, 2):
            model, opt = train(comm, name, stage, 4, reducer_opts=opts, clip=clip)
            got = params_of(model)
            # each trainable element is stepped by exactly one rank
            mine = torch.tensor([sum(t.numel() for g in opt.optim.param_groups
                                     for t in g["params"])], dtype=torch.float64)
            comm.all_reduce(mine)
            total = sum(p.numel() for p in model.parameters() if p.requires_grad)
            if int(mine) != total or (comm.world_size > 1 and len(opt.optim.state) == 0):
                raise AssertionError(f"{name}: shards cover {int(mine)} of {total} elements")
            what = f"{name} stage {stage} {opts} clip={clip}"
            # clipping sums the norm from shards (float64): the coefficient may differ in an ulp
            err = check_close(what, got, want, RTOL[stage] if clip is None else 1e-5)
            if not identical_across_ranks(comm, got):
                raise AssertionError(f"{what}: parameters differ across ranks")
            done.append(f"{name}/{stage}/err={err:.1e}")
    return done


def _drop_bias_grad(model: nn.Module, step: int) -> None:
    """Every other step, one parameter's gradient is set to None after backward: torch's
    optimizers skip it (no update, no state change)."""
    if step % 2 == 0:
        model.b.bias.grad = None  # type: ignore[union-attr]


def _step_again(opt: Any, model: nn.Module, step: int) -> None:
    """After step 2's zero_grad(set_to_none=False): one more step, without a backward."""
    if step == 2:
        opt.step()


def grad_state_cases(comm: gradcomm.Communicator) -> list[str]:
    """``param.grad`` is the gradient state, as in torch: ``model.zero_grad()`` resets it (no
    accumulation into the next step), a gradient set to None after backward skips its
    parameter's update, a zeroed one is stepped on; both stages equal the unsharded optimizer
    doing the same."""
    done = []
    variants: list[tuple[str, dict[str, Any]]] = [
        ("model.zero_grad", {"zero_model": True}),
        ("grad=None", {"before_step": _drop_bias_grad}),
        ("views+model.zero_grad", {"zero_model": True,
                                   "reducer_opts": {"gradient_as_bucket_view": True}}),
        # zeroed, not None: torch steps on zeros (AdamW's moments and weight decay still move)
        ("zero_grad(set_to_none=False)", {"set_to_none": False}),
        ("step on zeroed grads", {"set_to_none": False, "after": _step_again}),
    ]
    for what, kw in variants:
        want = params_of(train(comm, "adamw", None, 4, **kw)[0])
        for stage in (1, 2):
            got = params_of(train(comm, "adamw", stage, 4, **kw)[0])
            err = check_close(f"{what} stage {stage}", got, want, RTOL[stage])
            if not identical_across_ranks(comm, got):
                raise AssertionError(f"{what} stage {stage}: parameters differ across ranks")
            done.append(f"{what}/{stage}/err={err:.1e}")
    return done


def skipped_backward_cases(comm: gradcomm.Communicator) -> list[str]:
    """Rank 1 skips the backward of step 1 but calls step() and zero_grad() as the others do:
    its step() finds every param.grad None after zero_grad() and sends nothing, so the next
    collectives pair backward with backward and every rank raises the step check's error."""
    done = []
    for stage in (1, 2):
        model = Model()
        reducer = GradientReducer(model, comm)
        opt = ShardedOptimizer(reducer, torch.optim.AdamW, stage=stage, lr=0.01)
        raised = None
        for step in range(3):
            x, y = data(step, comm.rank, comm.world_size)
            loss = ((model(x) - y) ** 2).mean()
            try:
                if not (step == 1 and comm.rank == 1):
                    loss.backward()
            except RuntimeError as e:
                raised = (step, str(e))
                break
            opt.step()
            opt.zero_grad()
        reducer.remove()
        # the others raise at the end of step 1's backward, rank 1 at step 2's: same pairing
        if raised is None or raised[0] != (2 if comm.rank == 1 else 1) \
                or "ranks out of step" not in raised[1]:
            raise AssertionError(f"stage {stage}: rank {comm.rank} got {raised}")
        done.append(f"skip/{stage}")
    return done


def expect_error(fn: Callable[[], Any], exc: type[Exception], words: str) -> str:
    try:
        fn()
    except exc as e:
        if words not in str(e) or len(str(e)) > 200:
            raise AssertionError(f"unclear {exc.__name__}: {e}") from e
        return f"{exc.__name__}:{words.split()[0]}"
    raise AssertionError(f"no {exc.__name__} ({words})")


def bad_input_cases(comm: gradcomm.Communicator) -> list[str]:
    """Each a clear error on this rank (every rank runs it)."""
    model = Model()
    reducer = GradientReducer(model, comm)
    other = nn.Parameter(torch.zeros(3))
    out = [
        expect_error(lambda: ShardedOptimizer(reducer, torch.optim.LBFGS), ValueError, "LBFGS"),
        expect_error(lambda: ShardedOptimizer(reducer, torch.optim.SGD, lr=0.1,
                                              params=[*model.parameters(), other]),
                     ValueError, "not one the reducer owns"),
    ]
    instance = torch.optim.SGD(model.parameters(), lr=0.1)
    out.append(expect_error(lambda: ShardedOptimizer(reducer, instance), TypeError,  # type: ignore[arg-type]
                            "pass the class"))
    ShardedOptimizer(reducer, torch.optim.SGD, stage=2, lr=0.1)
    out.append(expect_error(lambda: ShardedOptimizer(reducer, torch.optim.SGD, stage=2, lr=0.1),
                            RuntimeError, "already has a ShardedOptimizer"))
    out.append(expect_error(reducer.join, RuntimeError,
                            "reducer.join() is not supported with a ShardedOptimizer"))
    reducer.remove()
    reducer = GradientReducer(model, comm)
    reducer.register_comm_hook("fp16_compress")
    out.append(expect_error(lambda: ShardedOptimizer(reducer, torch.optim.SGD, stage=2, lr=0.1),
                            ValueError, "reduce-scatter"))
    reducer.remove()
    return out

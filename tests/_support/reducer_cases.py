"""The reducer's failure and edge cases: each runs on every rank of any backend, then is verified
on all ranks' results.

Each case is a pair ``run(comm) -> result`` (called on every rank, any backend) and
``verify(results, world_size) -> problems`` (called once, on the list of every rank's result, in
rank order; an empty list means the case passed). ``tests/hooks/suite_reducer.py`` runs them on
every backend (the module tier), so every backend is held to the same values and errors.

References are single-process computations on the global batch (all ranks' batches concatenated).
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

import gradcomm
from gradcomm.hooks import GradientReducer

from tests._support.reducer_common import (
    batch,
    eval_bn,
    flat_grads,
    global_batch,
    grads_close,
    loss_fn,
    make_model,
    seeded,
)
from tests._support.reducer_common import ulp_distance as ulps

Result = Any
Problems = list[str]

_COLLECTIVES = ("all_reduce", "broadcast", "all_gather", "barrier")


# ----------------------------------------------------------------------------- helpers
def error_of(fn: Callable[[], object]) -> tuple[str, str] | None:
    """Run ``fn``; return ``(exception type name, message)`` or None when it did not raise."""
    try:
        fn()
    except Exception as exc:  # noqa: BLE001 - the case records what the user sees
        return type(exc).__name__, str(exc)
    return None


@contextlib.contextmanager
def count_collectives(comm: gradcomm.Communicator) -> Iterator[list[str]]:
    """Record the names of the public collectives ``comm`` is asked for inside the block."""
    calls: list[str] = []
    for name in _COLLECTIVES:
        original = getattr(comm, name)

        def spy(*args: Any, _o: Any = original, _n: str = name, **kwargs: Any) -> Any:
            calls.append(_n)
            return _o(*args, **kwargs)

        setattr(comm, name, spy)
    try:
        yield calls
    finally:
        for name in _COLLECTIVES:
            delattr(comm, name)


def grads_of(model: nn.Module) -> dict[str, torch.Tensor | None]:
    return {n: None if p.grad is None else p.grad.detach().clone()
            for n, p in model.named_parameters()}


def identical(results: list[Any], key: Callable[[Any], torch.Tensor]) -> bool:
    """True when ``key(result)`` is bit-identical on every rank (NaN where a grad is None)."""
    first = key(results[0])
    return all(torch.equal(key(r).nan_to_num(7.0), first.nan_to_num(7.0)) for r in results[1:])


def expect_error(results: list[Any], type_name: str, *fragments: str,
                 key: Callable[[Any], Any] = lambda r: r) -> Problems:
    """Every rank's ``key(result)`` is ``(type_name, message)`` with every fragment in it."""
    problems = []
    for rank, r in enumerate(results):
        err = key(r)
        if err is None:
            problems.append(f"rank {rank}: no error (expected {type_name})")
        elif err[0] != type_name or not all(f in err[1] for f in fragments):
            problems.append(f"rank {rank}: got {err[0]}: {err[1]!r}; expected {type_name} "
                            f"containing {fragments}")
    return problems


# ----------------------------------------------------------------------------- 1. fingerprint
FINGERPRINT_KINDS = ("count", "name", "shape", "dtype", "requires_grad", "buffer", "comm_hook",
                     "broadcast_buffers", "broadcast_parameters")
# What the message must name for each kind (the last rank is the odd one out).
_FINGERPRINT_FRAGMENTS = {
    "count": ("2.weight", "(2, 2)"),
    "name": ("head.weight", "dec.weight", "(2, 4)"),
    "shape": ("1.weight", "(5, 4)"),
    "dtype": ("1.weight", "torch.float64"),
    "requires_grad": ("1.weight", "requires_grad=False"),
    "buffer": ("buffer", "1.running_mean"),
    "comm_hook": ("comm_hook=gradcomm.hooks.comm_hooks.fp16_compress_hook",),
    "broadcast_buffers": ("broadcast_buffers=True",),
    "broadcast_parameters": ("broadcast_parameters=False",),
}
# Options the odd rank passes (the others take the defaults).
_FINGERPRINT_OPTIONS: dict[str, dict[str, Any]] = {
    "comm_hook": {"comm_hook": "fp16_compress"},
    "broadcast_buffers": {"broadcast_buffers": True},
    "broadcast_parameters": {"broadcast_parameters": False},
}


def _fingerprint_model(kind: str, rank: int, world_size: int) -> nn.Module:
    with seeded(100 + rank):  # different values per rank: a broadcast would show
        return _build_fingerprint_model(kind, rank, world_size)


def _build_fingerprint_model(kind: str, rank: int, world_size: int) -> nn.Module:
    odd = rank == world_size - 1
    if kind == "name":
        return nn.ModuleDict({"enc": nn.Linear(3, 4), ("head" if odd else "dec"): nn.Linear(4, 2)})
    if kind == "buffer":
        return nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4, track_running_stats=not odd))
    second = nn.Linear(4, 5 if kind == "shape" and odd else 2)
    if kind == "dtype" and odd:
        second.double()
    if kind == "requires_grad" and odd:
        second.requires_grad_(False)
    layers = [nn.Linear(3, 4), second]
    if kind == "count" and odd:
        layers.append(nn.Linear(2, 2))
    return nn.Sequential(*layers)


def run_fingerprint(comm: gradcomm.Communicator) -> Result:
    out = {}
    for kind in FINGERPRINT_KINDS:
        model = _fingerprint_model(kind, comm.rank, comm.world_size)
        before = [t.detach().clone() for t in model.state_dict().values()]
        odd = comm.rank == comm.world_size - 1
        options = _FINGERPRINT_OPTIONS.get(kind, {}) if odd else {}
        with count_collectives(comm) as calls:
            err = error_of(lambda: GradientReducer(model, comm, **options))  # noqa: B023
        after = list(model.state_dict().values())
        unchanged = all(torch.equal(a, b) for a, b in zip(before, after, strict=True))
        out[kind] = {"error": err, "calls": list(calls), "unchanged": unchanged}
    comm.barrier()  # the communicator is still in step on every rank
    return out


def verify_fingerprint(results: list[Result], world_size: int) -> Problems:
    problems: Problems = []
    for kind in FINGERPRINT_KINDS:
        frags = tuple(f for f in _FINGERPRINT_FRAGMENTS[kind]
                      if not (kind == "name" and world_size == 1))
        problems += [f"{kind}: {p}" for p in expect_error(
            results, "ValueError", "differs across ranks", f"rank {world_size - 1}", *frags,
            key=lambda r, k=kind: r[k]["error"])]
        for rank, r in enumerate(results):
            if set(r[kind]["calls"]) != {"all_gather"}:
                problems.append(f"{kind}: rank {rank} issued {r[kind]['calls']} (only all_gather "
                                "may run before the mismatch is found)")
            if not r[kind]["unchanged"]:
                problems.append(f"{kind}: rank {rank}'s parameters changed (a broadcast ran)")
    return problems


# ----------------------------------------------------------------------------- 3. no_sync
def _micro(step: int) -> bool:
    return step == 0  # head_b is used in the first micro-batch only (inside no_sync)


def run_no_sync(comm: gradcomm.Communicator, micro: int = 3) -> Result:
    out = {}
    for view in (False, True):
        model = eval_bn(make_model(seed=comm.rank))
        reducer = GradientReducer(model, comm, gradient_as_bucket_view=view,
                                  bucket_cap_mb=0.002, first_bucket_cap_mb=0.0005)
        for step in range(micro - 1):
            with reducer.no_sync():
                loss_fn(model, *batch(comm.rank, seed=20 + step), use_b=_micro(step)).backward()
        local = flat_grads(model)
        loss_fn(model, *batch(comm.rank, seed=20 + micro - 1), use_b=_micro(micro - 1)).backward()
        out[view] = {"local": local, "grads": grads_of(model), "flat": flat_grads(model)}
        reducer.remove()
    return out


def verify_no_sync(results: list[Result], world_size: int, micro: int = 3) -> Problems:
    ref_model = eval_bn(make_model())
    for step in range(micro):
        loss_fn(ref_model, *global_batch(world_size, seed=20 + step),
                use_b=_micro(step)).backward()
    ref = grads_of(ref_model)
    problems = []
    for view in (False, True):
        for rank, r in enumerate(results):
            bad = grads_close(r[view]["grads"], ref, rtol=1e-5)  # type: ignore[arg-type]
            problems += [f"view={view} rank {rank}: {b}" for b in bad]
        if not identical(results, lambda r, v=view: r[v]["flat"]):
            problems.append(f"view={view}: grads not bit-identical across ranks")
        if world_size > 1 and identical(results, lambda r, v=view: r[v]["local"]):
            problems.append(f"view={view}: grads were already equal inside no_sync (reduced?)")
    return problems


# ----------------------------------------------------------------------------- 4. backwards
def run_several_backwards(comm: gradcomm.Communicator) -> Result:
    out: dict[str, Any] = {}
    # retain_graph: two backwards through one graph
    model = eval_bn(make_model(seed=comm.rank))
    GradientReducer(model, comm, bucket_cap_mb=0.002, first_bucket_cap_mb=0.0005)
    x, y = batch(comm.rank)
    pred = model(x)
    ((pred - y) ** 2).mean().backward(retain_graph=True)
    out["retain_first"] = grads_of(model)
    pred.abs().mean().backward()
    out["retain_second"] = grads_of(model)
    # two losses from two forwards, backwarded separately
    model = eval_bn(make_model(seed=comm.rank))
    GradientReducer(model, comm, bucket_cap_mb=0.002, first_bucket_cap_mb=0.0005)
    loss_a = loss_fn(model, *batch(comm.rank, seed=3))
    loss_b = loss_fn(model, *batch(comm.rank, seed=4), use_b=False)
    loss_a.backward()
    loss_b.backward()
    out["two_losses"] = grads_of(model)
    return out


def verify_several_backwards(results: list[Result], world_size: int) -> Problems:
    ref_model = eval_bn(make_model())
    x, y = global_batch(world_size)
    pred = ref_model(x)
    ((pred - y) ** 2).mean().backward(retain_graph=True)
    refs = {"retain_first": grads_of(ref_model)}
    pred.abs().mean().backward()
    refs["retain_second"] = grads_of(ref_model)
    ref_model = eval_bn(make_model())
    loss_fn(ref_model, *global_batch(world_size, seed=3)).backward()
    loss_fn(ref_model, *global_batch(world_size, seed=4), use_b=False).backward()
    refs["two_losses"] = grads_of(ref_model)
    problems = []
    for key, ref in refs.items():
        for rank, r in enumerate(results):
            problems += [f"{key} rank {rank}: {b}"
                         for b in grads_close(r[key], ref, rtol=1e-5)]  # type: ignore[arg-type]
        if not identical(results, lambda r, k=key: torch.cat(
                [g.reshape(-1) for g in r[k].values() if g is not None])):
            problems.append(f"{key}: not bit-identical across ranks")
    return problems


class Checkpointed(nn.Module):
    """Three layers; ``a`` and ``c`` run under activation checkpointing, ``b`` does not."""

    def __init__(self, reentrant: bool) -> None:
        super().__init__()
        with seeded(5):
            self.a = nn.Linear(6, 6)
            self.b = nn.Linear(6, 6)
            self.c = nn.Linear(6, 1)
        self.reentrant = reentrant

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(checkpoint(self.a, x, use_reentrant=self.reentrant))
        h = torch.tanh(self.b(h))
        return checkpoint(self.c, h, use_reentrant=self.reentrant)


def _ckpt_data(rank: int) -> torch.Tensor:
    return torch.randn(3, 6, generator=torch.Generator().manual_seed(50 + rank))


def run_checkpointing(comm: gradcomm.Communicator) -> Result:
    out = {}
    for reentrant in (True, False):
        model = Checkpointed(reentrant)
        GradientReducer(model, comm, bucket_cap_mb=1e-4, first_bucket_cap_mb=1e-4)
        # reentrant checkpointing needs an input that requires grad
        x = _ckpt_data(comm.rank).requires_grad_(reentrant)
        err = error_of(lambda: model(x).pow(2).mean().backward())  # noqa: B023
        out[reentrant] = {"error": err, "grads": grads_of(model)}
    return out


def verify_checkpointing(results: list[Result], world_size: int) -> Problems:
    problems = []
    for reentrant in (True, False):
        model = Checkpointed(reentrant)
        x = torch.cat([_ckpt_data(r) for r in range(world_size)]).requires_grad_(reentrant)
        model(x).pow(2).mean().backward()
        ref = grads_of(model)
        for rank, r in enumerate(results):
            if r[reentrant]["error"] is not None:
                problems.append(f"reentrant={reentrant} rank {rank}: {r[reentrant]['error']}")
                continue
            problems += [f"reentrant={reentrant} rank {rank}: {b}" for b in
                         grads_close(r[reentrant]["grads"], ref, rtol=1e-5)]  # type: ignore
    return problems


# ----------------------------------------------------------------------------- 5. sharing
class Tied(nn.Module):
    """An embedding whose weight is also the output layer's (used twice per forward)."""

    def __init__(self) -> None:
        super().__init__()
        with seeded(6):
            self.emb = nn.Embedding(6, 4)
            self.out = nn.Linear(4, 6, bias=False)
        self.out.weight = self.emb.weight

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.out(torch.tanh(self.emb(idx)))


def _tied_idx(rank: int) -> torch.Tensor:
    return torch.randint(0, 6, (2, 3), generator=torch.Generator().manual_seed(60 + rank))


def run_tied(comm: gradcomm.Communicator) -> Result:
    model = Tied()
    reducer = GradientReducer(model, comm)
    model(_tied_idx(comm.rank)).pow(2).mean().backward()
    return {"names": reducer.parameter_names, "grads": grads_of(model),
            "still_tied": model.out.weight is model.emb.weight}


def verify_tied(results: list[Result], world_size: int) -> Problems:
    ref_model = Tied()
    ref_model(torch.cat([_tied_idx(r) for r in range(world_size)])).pow(2).mean().backward()
    ref = grads_of(ref_model)
    problems = []
    for rank, r in enumerate(results):
        if r["names"] != ("emb.weight",) or not r["still_tied"]:
            problems.append(f"rank {rank}: reduced {r['names']}, still tied {r['still_tied']}")
        problems += [f"rank {rank}: {b}" for b in grads_close(r["grads"], ref, rtol=1e-5)]
    if not identical(results, lambda r: r["grads"]["emb.weight"]):
        problems.append("tied grads differ across ranks")
    return problems


REPLACEMENTS = ("parameter", "submodule", "added_module", "unfrozen", "retyped",
                "resized")
_REPLACED_NAMES = {"parameter": "parameter fc2.weight",
                   "submodule": "parameter fc2.weight", "added_module": "parameter extra.weight",
                   "unfrozen": "parameter head_b.weight", "retyped": "parameter scale",
                   "resized": "parameter scale"}
_REPLACED_WHY = {"retyped": "is now torch.float64", "resized": "is now torch.float32 (1, 1)"}


def _replace(model: nn.Module, what: str) -> None:
    if what == "unfrozen":  # frozen when wrapped, trained later
        model.head_b.requires_grad_(True)
    elif what == "retyped":  # converted in place: the same Parameter objects, float64 data
        model.double()
    elif what == "resized":  # the same Parameter object, data of another shape (broadcasts)
        model.scale.data = torch.ones(1, 1)
    elif what == "parameter":
        model.fc2.weight = nn.Parameter(torch.zeros(16, 16))
    elif what == "submodule":
        model.fc2 = nn.Linear(16, 16)
    else:
        model.extra = nn.Linear(16, 16)
        inner = model.forward

        def forward(x: torch.Tensor, use_b: bool = True) -> torch.Tensor:
            return inner(x, use_b) + model.extra.weight.sum() * 0.01

        model.forward = forward  # type: ignore[method-assign]


def run_replaced(comm: gradcomm.Communicator) -> Result:
    out = {}
    for what in REPLACEMENTS:
        model = eval_bn(make_model())
        if what == "unfrozen":
            model.head_b.requires_grad_(False)
        reducer = GradientReducer(model, comm)
        # One step first: the reducer has then checked the module once and relies on torch's
        # registration hooks (gradcomm.hooks._structure) to notice what changes after it.
        loss_fn(model, *batch(comm.rank)).backward()
        _replace(model, what)
        dtype = torch.float64 if what == "retyped" else torch.float32
        out[what] = error_of(lambda m=model, d=dtype: loss_fn(m, *batch(comm.rank, dtype=d))
                             .backward())
        reducer.remove()
    return out


def verify_replaced(results: list[Result], world_size: int) -> Problems:
    problems = []
    for what in REPLACEMENTS:
        problems += [f"{what}: {p}" for p in expect_error(
            results, "RuntimeError", _REPLACED_NAMES[what], _REPLACED_WHY.get(what, "after"),
            "when the GradientReducer was built" if what in _REPLACED_WHY
            else "after the GradientReducer was built", key=lambda r, w=what: r[w])]
    return problems


# ----------------------------------------------------------------------------- 6. layouts
def _layout_params() -> dict[str, nn.Parameter]:
    g = torch.Generator().manual_seed(70)
    return {
        "conv": nn.Parameter(torch.randn(4, 3, 2, 2, generator=g)
                             .to(memory_format=torch.channels_last)),
        "transposed": nn.Parameter(torch.randn(5, 3, generator=g).t()),  # non-contiguous
        "every_other": nn.Parameter(torch.randn(4, 6, generator=g)[:, ::2]),  # odd strides
        "size1": nn.Parameter(torch.randn(3, 1, 4, generator=g).permute(2, 1, 0)),  # (4, 1, 3)
        "scalar": nn.Parameter(torch.randn((), generator=g)),
        "float64": nn.Parameter(torch.randn(2, 3, generator=g).double()),  # a bucket of its own
    }


def _layout_loss(params: dict[str, nn.Parameter], rank: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(80 + rank)
    x = torch.randn(2, 3, 4, 4, generator=g).contiguous(memory_format=torch.channels_last)
    y = nn.functional.conv2d(x, params["conv"])
    s = float(rank) + 1.5
    return (y.pow(2).mean() + (params["transposed"] * s).pow(2).sum()
            + (params["every_other"] * s).sin().sum() + (params["size1"] * s).pow(3).sum()
            + params["scalar"] * s + (params["float64"] * s).exp().sum().float())


def run_layouts(comm: gradcomm.Communicator) -> Result:
    params = _layout_params()
    GradientReducer(list(params.items()), comm, first_bucket_cap_mb=1e-5, bucket_cap_mb=1e-4)
    _layout_loss(params, comm.rank).backward()
    return {n: (p.grad.clone(), p.grad.stride(),
                p.grad.is_contiguous(memory_format=torch.channels_last)) if p.grad is not None
            else None for n, p in params.items()}


def verify_layouts(results: list[Result], world_size: int) -> Problems:
    local = []
    for r in range(world_size):
        params = _layout_params()
        _layout_loss(params, r).backward()
        local.append({n: p.grad for n, p in params.items()})
    problems = []
    for name in local[0]:
        want = sum(loc[name] for loc in local) / world_size
        for rank, r in enumerate(results):
            if r[name] is None:
                problems.append(f"{name} rank {rank}: grad None")
                continue
            got, stride, channels_last = r[name]
            if not torch.allclose(got, want, rtol=1e-6, atol=1e-7):
                problems.append(f"{name} rank {rank}: {float((got - want).abs().max()):.3g} off")
            if got.dtype != local[0][name].dtype:
                problems.append(f"{name} rank {rank}: grad dtype {got.dtype}")
            if stride != local[0][name].stride():
                problems.append(f"{name} rank {rank}: grad strides {stride}, local "
                                f"{local[0][name].stride()}")
            if name == "conv" and not channels_last:
                problems.append(f"conv rank {rank}: grad is not channels_last")
        if not identical(results, lambda r, n=name: r[n][0]):
            problems.append(f"{name}: not bit-identical across ranks")
    return problems


def run_sparse_and_int(comm: gradcomm.Communicator) -> Result:
    out: dict[str, Any] = {}
    out["module"] = error_of(
        lambda: GradientReducer(nn.Sequential(nn.Embedding(4, 2, sparse=True)), comm))
    emb = nn.Embedding(4, 2, sparse=True)
    GradientReducer([("table", emb.weight)], comm)
    out["params"] = error_of(lambda: emb(torch.tensor([1, 2])).sum().backward())
    ints = torch.arange(4, dtype=torch.int64) * (comm.rank + 1)
    out["int_avg"] = error_of(lambda: comm.all_reduce(ints, "avg"))
    out["int_after"] = ints.clone()  # untouched by the refused collective
    comm.all_reduce(ints, "sum")  # the communicator is still in step: a correct sum
    out["int_sum"] = ints
    # and a reducer still works after the sparse error
    p = nn.Parameter(torch.zeros(3))
    GradientReducer([p], comm)
    (p * (comm.rank + 1.0)).sum().backward()
    out["dense_after"] = p.grad
    return out


def verify_sparse_and_int(results: list[Result], world_size: int) -> Problems:
    problems = expect_error(results, "TypeError", "0.weight", "sparse",
                            key=lambda r: r["module"])
    problems += expect_error(results, "TypeError", "table", "sparse", key=lambda r: r["params"])
    problems += expect_error(results, "TypeError", "ReduceOp.AVG", "torch.int64",
                             key=lambda r: r["int_avg"])
    total = sum(range(1, world_size + 1))
    for rank, r in enumerate(results):
        if not torch.equal(r["int_after"], torch.arange(4) * (rank + 1)):
            problems.append(f"rank {rank}: the refused AVG changed the tensor")
        if not torch.equal(r["int_sum"], torch.arange(4) * total) or r["int_sum"].dtype != \
                torch.int64:
            problems.append(f"rank {rank}: sum after the refused AVG is {r['int_sum']}")
        if not torch.equal(r["dense_after"], torch.full((3,), total / world_size)):
            problems.append(f"rank {rank}: dense grad after the sparse error {r['dense_after']}")
    return problems


# ----------------------------------------------------------------------------- 7. half
def _half_values(rank: int, dtype: torch.dtype) -> torch.Tensor:
    g = torch.Generator().manual_seed(90 + rank)
    mag = torch.exp(torch.empty(129).uniform_(-8.0, 9.0, generator=g))
    sign = torch.where(torch.rand(129, generator=g) < 0.5, -1.0, 1.0)
    return (mag * sign).to(dtype)


def run_half(comm: gradcomm.Communicator) -> Result:
    out = {}
    for label, dtype, value in (("fp16_overflow", torch.float16, 40000.0),
                                ("fp16_underflow", torch.float16, 1e-7),
                                ("bf16_underflow", torch.bfloat16, 1e-7)):
        p = nn.Parameter(torch.zeros(5, dtype=dtype))
        GradientReducer([p], comm)
        (p * torch.tensor(value, dtype=dtype)).sum().backward()
        out[label] = p.grad
    for dtype in (torch.float16, torch.bfloat16):
        p = nn.Parameter(torch.zeros(129, dtype=dtype))
        GradientReducer([p], comm)
        (p * _half_values(comm.rank, dtype)).sum().backward()
        out[str(dtype)] = p.grad
    # a bfloat16 model end to end
    model = eval_bn(make_model(dtype=torch.bfloat16))
    GradientReducer(model, comm)
    loss_fn(model, *batch(comm.rank, dtype=torch.bfloat16)).backward()
    out["bf16_model"] = grads_of(model)
    return out


def verify_half(results: list[Result], world_size: int) -> Problems:
    problems = []
    for label, dtype, value in (("fp16_overflow", torch.float16, 40000.0),
                                ("fp16_underflow", torch.float16, 1e-7),
                                ("bf16_underflow", torch.bfloat16, 1e-7)):
        want = torch.full((5,), value, dtype=dtype)  # the average of equal values
        for rank, r in enumerate(results):
            if r[label] is None or not torch.equal(r[label], want):
                problems.append(f"{label} rank {rank}: {r[label]} != {want}")
    for dtype in (torch.float16, torch.bfloat16):
        want = (sum(_half_values(r, dtype).float() for r in range(world_size))
                / world_size).to(dtype)
        for rank, r in enumerate(results):
            got = r[str(dtype)]
            if not bool(torch.isfinite(got).all()) or ulps(got, want) > 1:
                problems.append(f"{dtype} rank {rank}: {ulps(got, want)} ulps from the fp32 mean")
        if not identical(results, lambda r, d=dtype: r[str(d)].float()):
            problems.append(f"{dtype}: not bit-identical across ranks")
    # bf16 model: the fp32 global-batch reference of the same (bf16-rounded) weights
    ref_model = eval_bn(make_model(dtype=torch.bfloat16)).float()
    x, y = global_batch(world_size, dtype=torch.bfloat16)
    loss_fn(ref_model, x.float(), y.float()).backward()
    ref = grads_of(ref_model)
    for rank, r in enumerate(results):
        got = {n: g.float() for n, g in r["bf16_model"].items() if g is not None}
        problems += [f"bf16 model rank {rank}: {b}" for b in grads_close(got, ref, rtol=6e-2)]
    return problems


# ----------------------------------------------------------------------------- 8. buffers
def run_buffers(comm: gradcomm.Communicator, steps: int = 3) -> Result:
    out: dict[str, Any] = {}
    for sync in (True, False):
        model = make_model(seed=comm.rank)  # BatchNorm in training mode
        GradientReducer(model, comm, broadcast_buffers=sync)
        seen: list[dict[str, torch.Tensor]] = []
        model.register_forward_pre_hook(  # runs after the reducer's own pre-hook
            lambda m, a: seen.append({n: b.clone() for n, b in m.named_buffers()}))  # noqa: B023
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for step in range(steps):
            opt.zero_grad()
            loss_fn(model, *batch(comm.rank, seed=30 + step)).backward()
            opt.step()
        seen_now = {n: b.clone() for n, b in model.named_buffers()}
        out[sync] = {"at_forward": seen, "end": seen_now}
    # no buffers, an empty module, and non-tensor state, with broadcast_buffers on
    plain = nn.Linear(3, 2)
    GradientReducer(plain, comm, broadcast_buffers=True)
    (plain(torch.ones(1, 3)) * (comm.rank + 1.0)).sum().backward()
    out["no_buffers"] = grads_of(plain)
    empty = nn.Sequential()
    red = GradientReducer(empty, comm, broadcast_buffers=True)
    out["empty"] = (len(red.buckets), torch.equal(empty(torch.ones(2)), torch.ones(2)))

    class Odd(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            with seeded(8):
                self.lin = nn.Linear(3, 2)
            self.steps = 0  # a python int
            self.name = "odd"
            self.register_buffer("absent", None)
            self.register_buffer("scratch", torch.full((2,), float(comm.rank)), persistent=False)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            self.steps += 1
            return self.lin(x) + self.scratch

    odd = Odd()
    GradientReducer(odd, comm, broadcast_buffers=True)
    (odd(torch.ones(1, 3)) * (comm.rank + 1.0)).sum().backward()
    out["odd"] = {"grads": grads_of(odd), "scratch": odd.scratch.clone(), "steps": odd.steps,
                  "absent": odd.absent}

    class RunningMean(nn.Module):  # reassigns its buffer in every forward
        def __init__(self) -> None:
            super().__init__()
            with seeded(8):
                self.lin = nn.Linear(3, 2)
            self.register_buffer("avg", torch.zeros(2))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            y = self.lin(x)
            self.avg = 0.5 * self.avg + 0.5 * y.detach().mean(0)
            return y

    # An evaluation under no_grad on rank 0 only: no broadcast, so no collective the others lack.
    evaluated = make_model(seed=comm.rank)  # BatchNorm in training mode
    GradientReducer(evaluated, comm, broadcast_buffers=True)
    if comm.rank == 0:
        with torch.no_grad():
            evaluated(batch(0)[0])
    out["eval_rank0"] = error_of(lambda: loss_fn(evaluated, *batch(comm.rank)).backward())
    out["eval_rank0_grads"] = flat_grads(evaluated)

    for sync in (True, False):
        ema = RunningMean()
        GradientReducer(ema, comm, broadcast_buffers=sync)
        at_forward: list[torch.Tensor] = []
        ema.register_forward_pre_hook(lambda m, a: at_forward.append(m.avg.clone()))  # noqa: B023
        x = torch.full((1, 3), comm.rank + 1.0)

        def three_steps(m: nn.Module = ema, x: torch.Tensor = x) -> None:
            for _ in range(3):
                m(x).sum().backward()

        out[("ema", sync)] = error_of(three_steps)
        out[("ema", sync, "avg")] = at_forward[-1]  # as the last forward saw it
        out[("ema", sync, "grads")] = grads_of(ema)
    return out


def verify_buffers(results: list[Result], world_size: int, steps: int = 3) -> Problems:
    problems = []
    for step in range(steps):
        if not identical(results, lambda r, s=step: torch.cat(
                [b.double().reshape(-1) for b in r[True]["at_forward"][s].values()])):
            problems.append(f"broadcast_buffers=True: buffers differ across ranks at forward "
                            f"{step}")
    for rank, r in enumerate(results):
        seen = r[True]["at_forward"]
        count = seen[-1]["bn.num_batches_tracked"]
        if count.dtype != torch.int64 or int(count) != steps - 1:
            problems.append(f"rank {rank}: num_batches_tracked {count!r} at the last forward")
        if torch.equal(seen[-1]["bn.running_mean"], seen[0]["bn.running_mean"]):
            problems.append(f"rank {rank}: running_mean never changed (test is vacuous)")
        end_count = r[True]["end"]["bn.num_batches_tracked"]
        if end_count.dtype != torch.int64 or int(end_count) != steps:
            problems.append(f"rank {rank}: num_batches_tracked {end_count!r} at the end")
    if world_size > 1 and identical(results, lambda r: r[False]["at_forward"][-1]
                                    ["bn.running_mean"]):
        problems.append("broadcast_buffers=False: buffers equal across ranks (test is vacuous)")
    total = sum(range(1, world_size + 1)) / world_size
    for rank, r in enumerate(results):
        g = r["no_buffers"]
        if not torch.allclose(g["weight"], torch.full((2, 3), total)) or \
                not torch.allclose(g["bias"], torch.full((2,), total)):
            problems.append(f"no buffers rank {rank}: {g}")
        if r["empty"] != (0, True):
            problems.append(f"empty module rank {rank}: {r['empty']}")
        odd = r["odd"]
        if not torch.allclose(odd["grads"]["lin.weight"], torch.full((2, 3), total)):
            problems.append(f"non-tensor state rank {rank}: {odd['grads']}")
        if not torch.equal(odd["scratch"], torch.zeros(2)):
            problems.append(f"rank {rank}: non-persistent buffer not rank 0's: {odd['scratch']}")
        if odd["steps"] != 1 or odd["absent"] is not None:
            problems.append(f"rank {rank}: non-tensor state changed: {odd}")
        for sync in (True, False):
            if r[("ema", sync)] is not None:
                problems.append(f"rank {rank}: a buffer reassigned in forward "
                                f"(broadcast_buffers={sync}) raised {r[('ema', sync)]}")
            # grads accumulate over the three backward passes, x = rank + 1 on each rank
            g = r[("ema", sync, "grads")]["lin.weight"]
            if g is None or not torch.allclose(g, torch.full((2, 3), 3 * total)):
                problems.append(f"rank {rank}: running-mean model grads {g}")
        if r["eval_rank0"] is not None:
            problems.append(f"rank {rank}: training after an eval on rank 0 only: "
                            f"{r['eval_rank0']}")
    if not identical(results, lambda r: r["eval_rank0_grads"]):
        problems.append("grads after an eval on rank 0 only differ across ranks")
    # With broadcast_buffers each forward sees rank 0's average; without, the ranks' differ.
    if not all(torch.equal(r[("ema", True, "avg")], results[0][("ema", True, "avg")])
               for r in results):
        problems.append("broadcast_buffers=True: the reassigned buffer differs across ranks")
    if world_size > 1 and torch.equal(results[0][("ema", False, "avg")],
                                      results[1][("ema", False, "avg")]):
        problems.append("broadcast_buffers=False: reassigned buffers equal (test is vacuous)")
    return problems


# ----------------------------------------------------------------------------- 9. degenerate
def _degenerate(kind: str) -> nn.Module:
    with seeded(9):
        return _build_degenerate(kind)


def _build_degenerate(kind: str) -> nn.Module:
    if kind == "empty":
        return nn.Sequential()
    if kind == "frozen":
        return nn.Linear(3, 2).requires_grad_(False)
    return nn.Sequential(nn.Linear(0, 2), nn.Linear(2, 2))  # a zero-size weight (2, 0)


def run_degenerate(comm: gradcomm.Communicator) -> Result:
    out: dict[str, Any] = {}
    for kind in ("empty", "frozen", "zero_size"):
        model = _degenerate(kind)
        reducer = GradientReducer(model, comm, broadcast_buffers=True)
        # a generator of its own: the global RNG is shared with thread ranks building models
        x = torch.randn(4, 0 if kind == "zero_size" else 3,
                        generator=torch.Generator().manual_seed(comm.rank))
        y = model(x)
        if y.requires_grad:
            (y.sum() * (comm.rank + 1.0)).backward()
        out[kind] = {"buckets": len(reducer.buckets), "grads": grads_of(model)}
    return out


def verify_degenerate(results: list[Result], world_size: int) -> Problems:
    problems = []
    scale = sum(range(1, world_size + 1)) / world_size
    ref = _degenerate("zero_size")
    (ref(torch.randn(4, 0)).sum() * scale).backward()
    for rank, r in enumerate(results):
        if r["empty"]["buckets"] != 0 or r["empty"]["grads"] != {}:
            problems.append(f"empty rank {rank}: {r['empty']}")
        if r["frozen"]["buckets"] != 0 or any(g is not None for g in r["frozen"]["grads"].values()):
            problems.append(f"frozen rank {rank}: {r['frozen']}")
        got = r["zero_size"]["grads"]
        for name, p in ref.named_parameters():
            g = got[name]
            if g is None or g.shape != p.shape or not torch.allclose(g, p.grad, rtol=1e-6):
                problems.append(f"zero_size {name} rank {rank}: {g} != {p.grad}")
    return problems


# ----------------------------------------------------------------------------- 12. one rank raises
def _chain() -> nn.Sequential:
    g = torch.Generator().manual_seed(90)
    model = nn.Sequential(*[nn.Linear(4, 4, bias=False) for _ in range(3)])
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.5)
    return model


def _chain_x(rank: int) -> torch.Tensor:
    return torch.randn(3, 4, generator=torch.Generator().manual_seed(95 + rank))


_RAISED_MODES: dict[str, tuple[dict[str, Any], str]] = {
    # mode: (reducer options, where rank 1's backward raises)
    "shared": ({"in_place_min_mb": math.inf}, "first layer"),
    "in_place": ({"in_place_min_mb": 0.0}, "first layer"),
    # after the reducer's hook for the last gradient: a read-only user hook registered later
    "after_last_hook": ({"in_place_min_mb": math.inf}, "after last"),
    # the views are param.grad and zero_grad(set_to_none=False) zeroes them in place, before
    # the next forward sends the rest of the failed pass
    "view_keep_grads": ({"in_place_min_mb": math.inf, "gradient_as_bucket_view": True},
                        "first layer"),
    # the same with a reducer built from parameters: no forward hook notices the failed pass
    "view_keep_grads_params": ({"in_place_min_mb": math.inf, "gradient_as_bucket_view": True},
                               "first layer"),
}


def run_raised_on_one_rank(comm: gradcomm.Communicator) -> Result:
    """Rank 1's backward raises (a hook of the user's) after some one-weight buckets were sent
    -- or, in ``after_last_hook``, after the reducer's hook for the last gradient; every rank
    treats an error from backward alike and redoes the step. Before, rank 1's redo paired its
    buckets with the others' waiting ones: wrong values with no error (MPI), or a size-mismatch
    abort (gloo); a failure after the last hook reached no other rank at all."""
    out = {}
    for mode, (options, where) in _RAISED_MODES.items():
        model = _chain()
        wrapped = list(model.named_parameters()) if mode.endswith("_params") else model
        reducer = GradientReducer(wrapped, comm, bucket_cap_mb=1e-6, first_bucket_cap_mb=1e-6,
                                  **options)
        keep = "gradient_as_bucket_view" in options
        errors = []
        for attempt in range(2):
            model.zero_grad(set_to_none=not keep)
            handle = None
            if comm.rank == 1 and attempt == 0:
                def fail(*_: Any) -> None:
                    raise KeyError("user hook failed")

                w = model[0].weight
                handle = (w.register_hook(fail) if where == "first layer"
                          else w.register_post_accumulate_grad_hook(fail))
            elif comm.rank == 0 and attempt == 0:
                # Rank 0 sends the second layer's bucket late, so that rank 1's copy of it is
                # still in flight when rank 1 fails, catches, calls zero_grad and runs forward.
                handle = model[1].weight.register_hook(lambda g: time.sleep(0.3))
            err = error_of(lambda m=model: m(_chain_x(comm.rank)).pow(2).mean().backward())
            if err is not None:
                errors.append(err)
            if handle is not None:
                handle.remove()
        out[mode] = {"errors": errors, "grads": grads_of(model)}
        reducer.remove()
    return out


def verify_raised_on_one_rank(results: list[Result], world_size: int) -> Problems:
    ref_model = _chain()
    x = torch.cat([_chain_x(r) for r in range(world_size)])
    ref_model(x).pow(2).mean().backward()
    ref = {n: p.grad for n, p in ref_model.named_parameters()}
    problems = []
    for mode in _RAISED_MODES:
        for rank, r in enumerate(results):
            errors = r[mode]["errors"]
            want = "user hook failed" if rank == 1 else "raised on another rank"
            if len(errors) != 1 or want not in errors[0][1]:
                problems.append(f"{mode} rank {rank}: errors {errors}, expected one with {want!r}")
            problems += [f"{mode} rank {rank}: {b}"
                         for b in grads_close(r[mode]["grads"], ref, rtol=1e-5)]
        if not identical(results, lambda r, m=mode: torch.cat(
                [g.flatten() for g in r[m]["grads"].values()])):
            problems.append(f"{mode}: grads differ across ranks")
    return problems


# ----------------------------------------------------------------------------- registry
#: A case registry: name -> (run(comm) -> result, verify(results, world_size) -> problems).
Cases = dict[str, tuple[Callable[[gradcomm.Communicator], Result],
                        Callable[[list[Result], int], Problems]]]


CASES: Cases = {
    "fingerprint": (run_fingerprint, verify_fingerprint),
    "no_sync": (run_no_sync, verify_no_sync),
    "several_backwards": (run_several_backwards, verify_several_backwards),
    "checkpointing": (run_checkpointing, verify_checkpointing),
    "tied": (run_tied, verify_tied),
    "replaced": (run_replaced, verify_replaced),
    "layouts": (run_layouts, verify_layouts),
    "sparse_and_int": (run_sparse_and_int, verify_sparse_and_int),
    "half": (run_half, verify_half),
    "buffers": (run_buffers, verify_buffers),
    "degenerate": (run_degenerate, verify_degenerate),
    "raised_on_one_rank": (run_raised_on_one_rank, verify_raised_on_one_rank),
}


def run_cases(comm: gradcomm.Communicator, names: list[str],
              cases: Cases | None = None) -> dict[str, Result]:
    """Run the named cases of ``cases`` (default :data:`CASES`) in order on this rank; a case
    that raises records ``("raised", ...)``."""
    cases = CASES if cases is None else cases
    out: dict[str, Result] = {}
    for name in names:
        try:
            out[name] = cases[name][0](comm)
        except Exception as exc:  # noqa: BLE001 - reported by verify_cases
            out[name] = ("raised", f"{type(exc).__name__}: {exc}")
    return out


def verify_case(name: str, results: list[dict[str, Result]], world_size: int,
                cases: Cases | None = None) -> Problems:
    """Problems of case ``name`` of ``cases`` (default :data:`CASES`) given every rank's
    :func:`run_cases` output (rank order)."""
    raised = [f"rank {r}: {res[name][1]}" for r, res in enumerate(results)
              if isinstance(res[name], tuple) and res[name][:1] == ("raised",)]
    if raised:
        return raised
    return (CASES if cases is None else cases)[name][1]([res[name] for res in results],
                                                        world_size)


__all__ = ["CASES", "Cases", "run_cases", "verify_case"]

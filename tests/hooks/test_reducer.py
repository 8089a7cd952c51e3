"""GradientReducer logic on the in-process thread backend (fast); values against references.

Each test runs ``world_size`` ranks as threads of this process (``ThreadGroup``), each with its own
model copy; the reference is one process's gradient on the concatenated global batch.
"""

from __future__ import annotations

import copy
import gc
import io
import math
import weakref
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any, cast
from unittest.mock import PropertyMock, patch

import numpy as np
import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

import gradcomm
from gradcomm.comm.backends.threads import ThreadCommunicator, ThreadGroup
from gradcomm.hooks import GradientReducer, apply_gradient_allreduce
from gradcomm.hooks._structure import StructureWatch
from gradcomm.hooks.reducer import (
    default_predivide_factor,
    resolve_first_bucket_cap_mb,
    resolve_in_place_min_mb,
)

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
    seeded,
)


def run_ranks(world_size: int, fn: Callable[[ThreadCommunicator], Any],
              timeout: float = 20.0) -> list[Any]:
    """Run ``fn(comm)`` on every rank; a rank's exception is returned (not raised)."""

    def body(comm: ThreadCommunicator) -> Any:
        try:
            return fn(comm)
        except Exception as exc:  # noqa: BLE001 - the test inspects it
            return exc

    return ThreadGroup(world_size, timeout=timeout).run(body)


def grads_of(model: nn.Module) -> dict[str, torch.Tensor | None]:
    return {n: None if p.grad is None else p.grad.clone() for n, p in model.named_parameters()}


def assert_identical(results: list[dict[str, torch.Tensor | None]]) -> None:
    for r in results[1:]:
        for name, g in results[0].items():
            other = r[name]
            assert (g is None) == (other is None), name
            if g is not None:
                assert other is not None and torch.equal(g, other), name


def assert_reference_on_every_rank(results: list[Any], ref: dict[str, torch.Tensor]) -> None:
    """No rank raised, rank 0's grads match ``ref`` and every rank's are bit-identical to them."""
    assert not any(isinstance(r, Exception) for r in results), results
    assert grads_close(results[0], ref) == []
    assert_identical(results)


# in_place_min_mb settings: every gradient through shared buckets; the two weights of fc1 and
# fc2 (3 KiB and 1 KiB) reduced in place among shared buckets; every gradient in place (the
# channels_last conv weight through a contiguous copy).
IN_PLACE = [math.inf, 0.0009, 0.0]


# ---------------------------------------------------------------------------- core values
@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("view", [False, True])
@pytest.mark.parametrize("in_place", IN_PLACE)
def test_grads_equal_global_batch_reference(
    world_size: int, view: bool, in_place: float
) -> None:
    ref = reference_grads(world_size)

    def fn(comm: ThreadCommunicator) -> dict[str, torch.Tensor | None]:
        model = eval_bn(make_model(seed=comm.rank))  # different init per rank: broadcast fixes it
        GradientReducer(model, comm, bucket_cap_mb=0.002, first_bucket_cap_mb=0.0005,
                        gradient_as_bucket_view=view, in_place_min_mb=in_place)
        loss_fn(model, *batch(comm.rank)).backward()
        return grads_of(model)

    out = run_ranks(world_size, fn)
    assert grads_close(out[0], ref) == []
    assert_identical(out)


@pytest.mark.parametrize("view", [False, True])
@pytest.mark.parametrize("in_place", IN_PLACE)
@pytest.mark.parametrize("overlap", [False, True])
def test_a_gradient_hook_registered_before_the_reducer_is_part_of_the_sum(
    view: bool, in_place: float, overlap: bool
) -> None:
    # A post-accumulate-grad hook of the user's (per-parameter clipping, noise) that runs before
    # the reducer's changes what is reduced, on every path: shared buckets copy the gradient in
    # the reducer's hook, in-place ones read it at the end of backward (docs/reducer.md: such
    # hooks go before the reducer).
    ref = reference_grads(2)

    def double(p: torch.Tensor) -> None:
        assert p.grad is not None
        p.grad.mul_(2.0)

    def fn(comm: ThreadCommunicator) -> dict[str, torch.Tensor | None]:
        model = eval_bn(make_model())
        for p in model.parameters():
            p.register_post_accumulate_grad_hook(double)
        GradientReducer(model, comm, bucket_cap_mb=0.002, first_bucket_cap_mb=0.0005,
                        gradient_as_bucket_view=view, in_place_min_mb=in_place, overlap=overlap)
        loss_fn(model, *batch(comm.rank)).backward()
        return grads_of(model)

    out = run_ranks(2, fn)
    assert grads_close(out[0], {n: 2.0 * g for n, g in ref.items()}) == []
    assert_identical(out)


@pytest.mark.parametrize("view", [False, True])
@pytest.mark.parametrize("in_place", [math.inf, 0.0])
@pytest.mark.parametrize("conj", [False, True])
def test_complex_parameters_equal_global_batch_reference(
    view: bool, in_place: float, conj: bool
) -> None:
    # No transport reduces complex numbers: the buckets go as their real view (as DDP does).
    # conj: the gradient autograd makes is a lazy conjugate view, its sign kept in a bit.
    ref = complex_reference_grads(2, conj)

    def fn(comm: ThreadCommunicator) -> dict[str, torch.Tensor | None]:
        model = ComplexNet(conj)
        GradientReducer(model, comm, gradient_as_bucket_view=view, in_place_min_mb=in_place)
        complex_loss(model, complex_batch(comm.rank)).backward()
        return grads_of(model)

    out = run_ranks(2, fn)
    assert not any(isinstance(r, Exception) for r in out), out
    assert out[0]["w"] is not None and out[0]["w"].dtype == torch.complex64
    for name, want in ref.items():
        got = out[0][name]
        assert got is not None and torch.allclose(got, want, rtol=1e-5, atol=1e-6), name
    assert not torch.allclose(ref["w"].imag, torch.zeros(3, 4))  # the imaginary part counts
    assert_identical(out)


@pytest.mark.parametrize("hook", ["fp16_compress", "bf16_compress"])
@pytest.mark.parametrize("in_place", [math.inf, 0.0])
@pytest.mark.parametrize("conj", [False, True])
def test_compression_of_a_complex_bucket_keeps_the_imaginary_part(
    hook: str, in_place: float, conj: bool
) -> None:
    # conj: a lazy conjugate gradient has no real view; the hook must get one that has
    ref = complex_reference_grads(2, conj)["w"]

    def fn(comm: ThreadCommunicator) -> torch.Tensor:
        model = ComplexNet(conj)
        GradientReducer(model, comm, comm_hook=hook, in_place_min_mb=in_place)
        complex_loss(model, complex_batch(comm.rank)).backward()
        return model.w.grad.clone()

    out = run_ranks(2, fn)
    assert not any(isinstance(r, Exception) for r in out), out
    scale = float(ref.abs().max())
    for got in out:
        assert got.dtype == torch.complex64
        assert float((got - ref).abs().max()) < 2e-2 * scale, (got, ref)  # 16-bit rounding
    assert float(ref.imag.abs().max()) > 0.1 * scale  # a lost imaginary part would show


@pytest.mark.parametrize("view", [False, True])
@pytest.mark.parametrize("in_place", IN_PLACE)
def test_backward_with_create_graph_averages_values(view: bool, in_place: float) -> None:
    # backward(create_graph=True) (gradient penalties) leaves grad mode on inside the hooks: the
    # staging copy must still run without autograd (an out= copy of a grad with history raises).
    ref = reference_grads(2)

    def fn(comm: ThreadCommunicator) -> dict[str, torch.Tensor | None]:
        model = eval_bn(make_model(seed=comm.rank))
        GradientReducer(model, comm, bucket_cap_mb=0.002, first_bucket_cap_mb=0.0005,
                        gradient_as_bucket_view=view, in_place_min_mb=in_place)
        loss_fn(model, *batch(comm.rank)).backward(create_graph=True)
        return {n: None if p.grad is None else p.grad.detach().clone()
                for n, p in model.named_parameters()}

    out = run_ranks(2, fn)
    assert_reference_on_every_rank(out, ref)


def test_copies_of_a_wrapped_module_are_local_modules() -> None:
    # copy.deepcopy (an EMA or evaluation copy) and torch.save of the whole module must work after
    # wrapping -- the hooks hold the communicator, which cannot be copied -- and give an ordinary
    # local module, as DDP's .module is; the original keeps being reduced.
    ref = reference_grads(2)

    def fn(comm: ThreadCommunicator) -> dict[str, Any]:
        model = eval_bn(make_model())
        GradientReducer(model, comm, bucket_cap_mb=0.002, first_bucket_cap_mb=0.0005)
        # apply_gradient_allreduce also keeps the reducer in module.gradient_reducer
        applied = gradcomm.apply_gradient_allreduce(eval_bn(make_model()), comm)
        out: dict[str, Any] = {"copies": {}}
        for what, wrapped in (("reducer", model), ("applied", applied)):
            copied = copy.deepcopy(wrapped)
            saved = io.BytesIO()
            torch.save(wrapped, saved)
            saved.seek(0)
            loaded = torch.load(saved, weights_only=False)
            out["copies"][what] = {"copied": copied, "loaded": loaded}
        plain = eval_bn(make_model())
        for name, m in (("plain", plain), ("wrapped", model), ("applied", applied)):
            loss_fn(m, *batch(comm.rank)).backward()
            out[name] = grads_of(m)
        for what, copies in out["copies"].items():
            for name, m in copies.items():
                loss_fn(m, *batch(comm.rank)).backward()
                out[(what, name)] = grads_of(m)
                out[(what, name, "attr")] = getattr(m, "gradient_reducer", "absent")
        return out

    out = run_ranks(2, fn)
    assert not any(isinstance(r, Exception) for r in out), out
    for rank_out in out:
        assert isinstance(rank_out["applied"], dict)
        for what, expected_attr in (("reducer", "absent"), ("applied", None)):
            for name in ("copied", "loaded"):  # local gradients, not averaged
                assert rank_out[(what, name, "attr")] == expected_attr, (what, name)
                for pname, g in rank_out["plain"].items():
                    got = rank_out[(what, name)][pname]
                    assert g is not None and torch.equal(got, g), (what, name, pname)
    for key in ("wrapped", "applied"):
        assert grads_close(out[0][key], ref) == [], key
        assert_identical([r[key] for r in out])
    assert not torch.equal(out[0][("reducer", "copied")]["fc1.weight"],
                           out[1][("reducer", "copied")]["fc1.weight"])


def test_module_is_walked_again_only_after_torch_registers_something() -> None:
    # The forward pre-hook walks module.named_parameters() (2/3 of its cost) only after torch's
    # global registration hooks saw a parameter, buffer or submodule registered; unfreezing, which
    # registers nothing, is caught on every forward without a walk.
    def fn(comm: ThreadCommunicator) -> dict[str, Any]:
        model = eval_bn(make_model())
        model.head_b.requires_grad_(False)
        GradientReducer(model, comm)
        walks: list[int] = []
        named_parameters = model.named_parameters

        def counting(*args: Any, **kwargs: Any) -> Any:
            walks.append(1)
            return named_parameters(*args, **kwargs)

        model.named_parameters = counting  # type: ignore[method-assign]
        out: dict[str, Any] = {}
        for _ in range(3):
            loss_fn(model, *batch(comm.rank)).backward()
        out["steps"] = len(walks)
        nn.Linear(2, 2)  # registers parameters on some other module: one walk more
        loss_fn(model, *batch(comm.rank)).backward()
        loss_fn(model, *batch(comm.rank)).backward()
        out["after_registration"] = len(walks)
        model.head_b.requires_grad_(True)
        try:
            loss_fn(model, *batch(comm.rank)).backward()
        except RuntimeError as exc:
            out["unfrozen"] = str(exc)
        out["after_unfreezing"] = len(walks)
        model.head_b.requires_grad_(False)
        model.bn.register_buffer("extra", torch.zeros(1))  # buffers are not watched: no walk
        model.bn.extra = torch.ones(1)
        loss_fn(model, *batch(comm.rank)).backward()
        out["after_buffers"] = len(walks)
        return out

    (out,) = run_ranks(1, fn)
    assert not isinstance(out, Exception), out
    assert out["steps"] == 1 and out["after_registration"] == 2, out
    assert out["after_unfreezing"] == 2, out
    assert "parameter head_b.weight was added, replaced or unfrozen" in out["unfrozen"], out
    assert out["after_buffers"] == 2, out


def test_structure_watch_sees_registrations_until_closed() -> None:
    watch = StructureWatch()
    assert watch.changed  # nothing checked yet
    for register in (lambda: nn.Linear(1, 1), lambda: nn.Sequential().add_module("a", nn.ReLU())):
        watch.changed = False
        register()
        assert watch.changed
    bn = nn.BatchNorm1d(1)
    watch.changed = False
    bn.register_buffer("b", torch.zeros(1))  # buffers carry no gradient: not watched
    bn.running_mean = torch.zeros(1)
    assert not watch.changed
    watch.close()
    watch.close()  # idempotent
    watch.changed = False
    nn.Linear(1, 1)
    assert not watch.changed


def test_building_and_removing_reducers_leaves_torchs_global_hooks_alone() -> None:
    # torch iterates its global registration hooks on every module registration; a reducer that
    # added and removed its own raced with other threads building modules ("OrderedDict mutated
    # during iteration"). The watch's hooks are installed once, at import.
    from torch.nn.modules import module as hooks

    tables = (hooks._global_parameter_registration_hooks,
              hooks._global_module_registration_hooks, hooks._global_buffer_registration_hooks)
    before = [dict(t) for t in tables]
    comm = ThreadGroup(1).communicator(0)
    reducer = GradientReducer(nn.Linear(2, 2), comm)
    assert [dict(t) for t in tables] == before
    watch = reducer._watch
    assert watch is not None
    watch.changed = False
    nn.Linear(1, 1)  # any module's registration is still noticed
    assert watch.changed
    reducer.remove()
    assert [dict(t) for t in tables] == before
    watch.changed = False
    nn.Linear(1, 1)
    assert not watch.changed  # a removed reducer's watch is closed


@pytest.mark.slow
def test_a_reducer_lives_as_long_as_what_it_wraps() -> None:
    # Wrapping a module: dropped with it, without remove() (torch does not show tensor hooks to
    # the garbage collector, so strong references from the gradient hooks kept both alive for
    # good), and its registration watch is closed. Built from parameters: nothing else holds it,
    # so the hooks keep it alive and it goes on reducing.
    comm = ThreadGroup(1).communicator(0)
    model = nn.Linear(2, 2)
    reducer = GradientReducer(model, comm)
    refs, its_watch = (weakref.ref(reducer), weakref.ref(model)), reducer._watch
    assert its_watch is not None
    del reducer, model
    gc.collect()
    assert [r() for r in refs] == [None, None]
    its_watch.changed = False
    nn.Linear(1, 1)
    assert not its_watch.changed

    ref = reference_grads(2)

    def fn(comm: ThreadCommunicator) -> dict[str, torch.Tensor | None]:
        model = eval_bn(make_model())
        GradientReducer(model.named_parameters(), comm)  # the reducer object is not kept
        gc.collect()
        loss_fn(model, *batch(comm.rank)).backward()
        return grads_of(model)

    out = run_ranks(2, fn)
    assert_reference_on_every_rank(out, ref)


@pytest.mark.parametrize("in_place", IN_PLACE)
def test_overlap_equals_end_of_backward_bit_for_bit(in_place: float) -> None:
    def fn(comm: ThreadCommunicator) -> list[torch.Tensor]:
        res = []
        for overlap in (True, False):
            model = eval_bn(make_model())
            reducer = GradientReducer(model, comm, bucket_cap_mb=0.002,
                                      first_bucket_cap_mb=0.0005, overlap=overlap,
                                      in_place_min_mb=in_place)
            assert len(reducer.buckets) > 2
            loss_fn(model, *batch(comm.rank)).backward()
            res.append(flat_grads(model))
            reducer.remove()
        return res

    for overlapped, at_end in run_ranks(3, fn):
        assert torch.equal(overlapped, at_end)


@pytest.mark.parametrize("set_to_none", [True, False])
def test_view_mode_trains_bit_for_bit_like_copy_mode(set_to_none: bool) -> None:
    # In view mode a fresh gradient is copied and pre-divided in one pass, one accumulated in
    # place into its view is divided at launch; both must give the copy mode's values exactly.
    # Gradients reduced in place (pre-divided in param.grad) give the same values too.
    def fn(comm: ThreadCommunicator) -> list[torch.Tensor]:
        res = []
        for view, overlap, in_place in ((False, False, math.inf), (True, True, math.inf),
                                        (True, False, math.inf), (False, True, 0.0009),
                                        (True, True, 0.0), (False, False, 0.0)):
            model = eval_bn(make_model())
            reducer = GradientReducer(model, comm, bucket_cap_mb=0.002,
                                      first_bucket_cap_mb=0.0005, gradient_as_bucket_view=view,
                                      overlap=overlap, in_place_min_mb=in_place)
            opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
            for step in range(3):
                opt.zero_grad(set_to_none=set_to_none)
                loss_fn(model, *batch(comm.rank, seed=step)).backward()
                opt.step()
            res.append(torch.cat([flat_grads(model)] + [p.detach().reshape(-1)
                                                        for p in model.parameters()]))
            reducer.remove()
        return res

    for copy_mode, *view_modes in run_ranks(2, fn):
        for other in view_modes:
            assert torch.equal(copy_mode, other)


@pytest.mark.parametrize("in_place", IN_PLACE)
def test_buckets_launch_during_backward_in_index_order(in_place: float) -> None:
    order: list[tuple[int, int, bool]] = []

    def fn(comm: ThreadCommunicator) -> None:
        model = eval_bn(make_model())
        reducer = GradientReducer(model, comm, bucket_cap_mb=0.002, first_bucket_cap_mb=0.0005,
                                  in_place_min_mb=in_place)
        in_backward = [True]

        def hook(state: Any, bucket: gradcomm.hooks.GradBucket) -> gradcomm.Work:
            order.append((comm.rank, bucket.index(), in_backward[0]))
            return gradcomm.hooks.allreduce_hook(state, bucket)

        reducer.register_comm_hook(hook)
        loss = loss_fn(model, *batch(comm.rank))
        # head_b unused on rank 1 only: its bucket (0) waits for the end on rank 1, and so do all
        model.head_b.weight.register_post_accumulate_grad_hook(lambda p: None)
        loss.backward()
        in_backward[0] = False
        return None

    run_ranks(2, fn)
    for rank in (0, 1):
        idx = [b for r, b, _ in order if r == rank]
        assert idx == sorted(idx) == list(range(len(idx)))
    # with no unused parameter every bucket but the last fills before backward ends
    assert any(during for _, b, during in order if b == 0)


@pytest.mark.parametrize("in_place", IN_PLACE)
def test_unused_on_one_rank_counts_as_zero_and_unused_everywhere_stays_none(
    in_place: float
) -> None:
    ws = 2
    g_local = []
    for r in range(ws):
        m = eval_bn(make_model())
        loss_fn(m, *batch(r), use_b=(r == 0)).backward()
        g_local.append(grads_of(m))

    def fn(comm: ThreadCommunicator) -> dict[str, torch.Tensor | None]:
        model = eval_bn(make_model())
        model.extra = nn.Linear(2, 2)  # never used by any rank
        GradientReducer(model, comm, in_place_min_mb=in_place)
        loss_fn(model, *batch(comm.rank), use_b=(comm.rank == 0)).backward()
        return grads_of(model)

    out = run_ranks(ws, fn)
    assert_identical(out)
    assert out[0]["extra.weight"] is None and out[0]["extra.bias"] is None
    for name in ("head_b.weight", "head_b.bias"):
        want = g_local[0][name] / ws  # (g + 0) / world_size
        assert g_local[1][name] is None
        assert torch.allclose(out[0][name], want, rtol=1e-6, atol=0)
    g = out[0]["fc2.weight"]
    assert torch.allclose(g, (g_local[0]["fc2.weight"] + g_local[1]["fc2.weight"]) / ws,
                          rtol=1e-5, atol=1e-8)


# ---------------------------------------------------------------------------- accumulation etc.
@pytest.mark.parametrize("view", [False, True])
@pytest.mark.parametrize("in_place", [math.inf, 0.0])
def test_no_sync_accumulation_equals_single_process_sum(view: bool, in_place: float) -> None:
    ws, micro = 2, 3
    ref_model = eval_bn(make_model())
    for step in range(micro):
        loss_fn(ref_model, *global_batch(ws, seed=10 + step)).backward()
    ref = grads_of(ref_model)

    def fn(comm: ThreadCommunicator) -> dict[str, torch.Tensor | None]:
        model = eval_bn(make_model())
        reducer = GradientReducer(model, comm, gradient_as_bucket_view=view,
                                  bucket_cap_mb=0.002, first_bucket_cap_mb=0.0005,
                                  in_place_min_mb=in_place)
        for step in range(micro - 1):
            with reducer.no_sync():
                loss_fn(model, *batch(comm.rank, seed=10 + step)).backward()
        loss_fn(model, *batch(comm.rank, seed=10 + micro - 1)).backward()
        return grads_of(model)

    out = run_ranks(ws, fn)
    assert grads_close(out[0], ref, rtol=1e-5) == []  # type: ignore[arg-type]
    assert_identical(out)


@pytest.mark.parametrize("in_place", [math.inf, 0.0])
def test_several_backwards_per_step_each_reduced_once(in_place: float) -> None:
    ws = 2
    ref_model = eval_bn(make_model())
    x, y = global_batch(ws)
    out_ref = ref_model(x)
    ((out_ref - y) ** 2).mean().backward(retain_graph=True)
    out_ref.abs().mean().backward()
    ref = grads_of(ref_model)

    def fn(comm: ThreadCommunicator) -> dict[str, torch.Tensor | None]:
        model = eval_bn(make_model())
        GradientReducer(model, comm, in_place_min_mb=in_place)
        xl, yl = batch(comm.rank)
        out = model(xl)
        ((out - yl) ** 2).mean().backward(retain_graph=True)
        after_first = grads_of(model)
        out.abs().mean().backward()
        return after_first, grads_of(model)

    res = run_ranks(ws, fn)
    assert grads_close(res[0][1], ref, rtol=1e-5) == []  # type: ignore[arg-type]
    assert_identical([r[0] for r in res])
    assert_identical([r[1] for r in res])


class _Checkpointed(nn.Module):
    def __init__(self, reentrant: bool, where: str) -> None:
        super().__init__()
        with seeded(0):
            self.a = nn.Linear(6, 6)
            self.b = nn.Linear(6, 6)
            self.c = nn.Linear(6, 1)
        self.reentrant = reentrant
        self.where = where

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        seg = {"first": self.a, "middle": self.b, "last": self.c}[self.where]
        for layer in (self.a, self.b, self.c):
            if layer is seg:
                x = checkpoint(layer, x, use_reentrant=self.reentrant)
            else:
                x = layer(x)
            if layer is not self.c:
                x = torch.tanh(x)
        return x


@pytest.mark.parametrize("view", [False, True])
@pytest.mark.parametrize("reentrant", [True, False])
@pytest.mark.parametrize("where", ["first", "middle", "last"])
@pytest.mark.parametrize("in_place", [math.inf, 0.0])
def test_activation_checkpointing(
    reentrant: bool, where: str, view: bool, in_place: float
) -> None:
    ws = 2

    def data(rank: int) -> torch.Tensor:
        return torch.randn(3, 6, generator=torch.Generator().manual_seed(rank))

    ref_model = _Checkpointed(reentrant, where)
    x = torch.cat([data(r) for r in range(ws)]).requires_grad_(reentrant)
    ref_model(x).pow(2).mean().backward()
    ref = grads_of(ref_model)

    def fn(comm: ThreadCommunicator) -> dict[str, torch.Tensor | None]:
        model = _Checkpointed(reentrant, where)
        GradientReducer(model, comm, bucket_cap_mb=1e-4, first_bucket_cap_mb=1e-4,
                        gradient_as_bucket_view=view, in_place_min_mb=in_place)
        xl = data(comm.rank).requires_grad_(reentrant)  # reentrant needs an input requiring grad
        model(xl).pow(2).mean().backward()
        return grads_of(model)

    out = run_ranks(ws, fn)
    assert grads_close(out[0], ref, rtol=1e-5) == []  # type: ignore[arg-type]
    assert_identical(out)


class _SharedInCheckpoint(nn.Module):
    """``a`` used outside and inside a reentrant checkpoint, so its gradient is accumulated twice
    in one backward; with ``leading`` a layer ``b`` runs first, so its gradient comes last and
    keeps the (single) bucket from being sent between the two accumulations."""

    def __init__(self, leading: bool) -> None:
        super().__init__()
        with seeded(0):
            self.b = nn.Linear(4, 4) if leading else nn.Identity()
            self.a = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(self.b(x))
        return checkpoint(self.a, torch.tanh(h), use_reentrant=True)


def _shared_in_checkpoint_reference(leading: bool, ws: int) -> tuple[torch.Tensor, Any]:
    x = torch.randn(2 * ws, 4, generator=torch.Generator().manual_seed(0))
    ref_model = _SharedInCheckpoint(leading)
    ref_model(x).pow(2).mean().backward()
    return x, grads_of(ref_model)


@pytest.mark.parametrize("view", [False, True])
@pytest.mark.parametrize(("leading", "in_place"), [(False, math.inf), (False, 0.0), (True, 0.0)])
def test_reentrant_checkpoint_of_a_shared_parameter_raises_or_is_right(
    view: bool, leading: bool, in_place: float
) -> None:
    ws = 2
    x, ref = _shared_in_checkpoint_reference(leading=leading, ws=ws)

    def fn(comm: ThreadCommunicator) -> Any:
        model = _SharedInCheckpoint(leading=leading)
        GradientReducer(model, comm, gradient_as_bucket_view=view, in_place_min_mb=in_place)
        model(x[2 * comm.rank:2 * comm.rank + 2]).pow(2).mean().backward()
        return grads_of(model)

    for r in run_ranks(ws, fn):
        if isinstance(r, Exception):  # the bucket was sent between the two accumulations
            assert isinstance(r, RuntimeError) and "accumulated again" in str(r)
        else:
            assert grads_close(r, ref, rtol=1e-5) == []  # type: ignore[arg-type]


@pytest.mark.parametrize("view", [False, True])
def test_gradient_accumulated_twice_before_its_bucket_is_sent(view: bool) -> None:
    # View mode must add the second part (divided) to the slot, not lose it or divide it twice.
    ws = 2
    x, ref = _shared_in_checkpoint_reference(leading=True, ws=ws)

    def fn(comm: ThreadCommunicator) -> Any:
        model = _SharedInCheckpoint(leading=True)
        reducer = GradientReducer(model, comm, gradient_as_bucket_view=view)
        assert len(reducer.buckets) == 1
        for step in range(2):  # the second step accumulates into existing views
            model.zero_grad(set_to_none=step == 0)
            model(x[2 * comm.rank:2 * comm.rank + 2]).pow(2).mean().backward()
            got = grads_of(model)
            assert grads_close(got, ref, rtol=1e-6) == []
        return got

    assert_identical(run_ranks(ws, fn))


@pytest.mark.parametrize("in_place", [math.inf, 0.0])
def test_tied_weights_reduced_once(in_place: float) -> None:
    class Tied(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            with seeded(0):
                self.emb = nn.Embedding(5, 3)
                self.out = nn.Linear(3, 5, bias=False)
            self.out.weight = self.emb.weight

        def forward(self, idx: torch.Tensor) -> torch.Tensor:
            return self.out(self.emb(idx))

    ws = 2
    idx = torch.tensor([[0, 1, 2], [3, 4, 1]])
    ref_model = Tied()
    ref_model(idx).pow(2).mean().backward()
    ref = grads_of(ref_model)

    def fn(comm: ThreadCommunicator) -> Any:
        model = Tied()
        reducer = GradientReducer(model, comm, in_place_min_mb=in_place)
        assert reducer.parameter_names == ("emb.weight",)
        model(idx[comm.rank:comm.rank + 1]).pow(2).mean().backward()
        return grads_of(model)

    out = run_ranks(ws, fn)
    assert grads_close(out[0], ref, rtol=1e-5) == []  # type: ignore[arg-type]


# ---------------------------------------------------------------------------- memory, views
def test_bucket_views_alias_grads_and_memory_does_not_grow() -> None:
    def fn(comm: ThreadCommunicator) -> None:
        model = eval_bn(make_model())
        reducer = GradientReducer(model, comm, gradient_as_bucket_view=True,
                                  bucket_cap_mb=0.002, first_bucket_cap_mb=0.0005)
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        flats = [b.flat for b in reducer._buckets]
        ptrs = [f.data_ptr() for f in flats]
        counts = []
        for step in range(6):
            opt.zero_grad(set_to_none=False)
            loss_fn(model, *batch(comm.rank, seed=step)).backward()
            opt.step()
            for b in reducer._buckets:
                lo = b.flat.data_ptr()
                hi = lo + b.numel * b.flat.element_size()
                for p in b.params:
                    assert (p.grad is not None and lo <= p.grad.data_ptr() < hi) or p.numel() == 0
            if comm.rank == 0 and step in (2, 5):
                gc.collect()
                counts.append(sum(type(o) in (torch.Tensor, nn.Parameter)
                                  for o in gc.get_objects()))
        assert [b.flat.data_ptr() for b in reducer._buckets] == ptrs  # allocated once
        assert counts[:1] == counts[1:], counts  # no tensor accumulates step to step
        return None

    run_ranks(2, fn)


@pytest.mark.parametrize("view", [False, True])
def test_in_place_buckets_reduce_the_gradient_autograd_made(view: bool) -> None:
    # fc1.weight and fc2.weight are over the threshold: each is a bucket of its own whose buffer
    # is param.grad itself (no copy, no buffer of the reducer's), and one more all-reduce per
    # backward carries their presence flags. Memory must not grow step to step.
    def fn(comm: ThreadCommunicator) -> Any:
        model = eval_bn(make_model())
        reducer = GradientReducer(model, comm, bucket_cap_mb=0.002, first_bucket_cap_mb=0.0005,
                                  in_place_min_mb=0.0009, gradient_as_bucket_view=view)
        in_place = [b.param_names for b in reducer.buckets if b.in_place]
        made: dict[str, int] = {}
        for name in ("fc1.weight", "fc2.weight"):  # runs after the reducer's hook
            model.get_parameter(name).register_post_accumulate_grad_hook(
                lambda p, name=name: made.__setitem__(name, p.grad.data_ptr()))
        labels: list[str | None] = []
        real = comm.all_reduce

        def counting(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> gradcomm.Work:
            labels.append(kwargs.get("label"))
            return real(tensor, *args, **kwargs)

        comm.all_reduce = counting  # type: ignore[method-assign]
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        counts, kept = [], []
        for step in range(4):
            opt.zero_grad(set_to_none=True)
            labels.clear()
            loss_fn(model, *batch(comm.rank, seed=step)).backward()
            opt.step()
            kept.append([made[n] == model.get_parameter(n).grad.data_ptr()
                         for n in ("fc1.weight", "fc2.weight")])
            assert all(b.buffer is None for b in reducer._buckets)  # nothing kept
            if step in (1, 3):
                comm.barrier()  # both ranks between steps while rank 0 counts
                if comm.rank == 0:
                    gc.collect()
                    counts.append(sum(type(o) in (torch.Tensor, nn.Parameter)
                                      for o in gc.get_objects()))
                comm.barrier()
        shared = [b for b in reducer._buckets if not b.in_place]
        return (in_place, kept, labels, len(reducer.buckets), counts,
                [b.flat.numel() for b in reducer._buckets if b.in_place],
                sum(b.numel for b in shared) + sum(len(b.params) for b in shared))

    for in_place, kept, labels, nbuckets, counts, own, shared_numel in run_ranks(2, fn):
        assert in_place == [("fc2.weight",), ("fc1.weight",)]
        assert all(all(k) for k in kept), kept
        assert len(labels) == nbuckets + 1 and "presence" in str(labels[-1]), labels
        assert counts[:1] == counts[1:], counts
        assert own == [0, 0]  # no buffer allocated for them
        assert shared_numel == sum(p.numel() + 1 for n, p in make_model().named_parameters()
                                   if n not in ("fc1.weight", "fc2.weight"))


class _AliasedGrads(nn.Module):
    """Parameters whose gradients autograd hands out as views of other tensors (batch of 1):
    ``pos.weight.unsqueeze(0)`` (a learned position table) added to an activation gets a view of
    the activation's gradient, which the token embedding's backward reads after it; ``a`` and
    ``b`` go through ``torch.stack(...).sum(0)``, whose backward gives each a view of one
    expanded tensor (the same memory); ``c`` and ``d`` are both added to one activation through
    ``unsqueeze``, so their gradients are views of the same memory; ``e`` and ``f`` go through
    ``torch.stack`` scaled per slice, so their gradients are disjoint slices of one tensor."""

    def __init__(self) -> None:
        super().__init__()
        with seeded(0):
            self.tok = nn.Embedding(10, 4)
            self.pos = nn.Embedding(3, 4)
            self.a = nn.Parameter(torch.randn(3, 4))
            self.b = nn.Parameter(torch.randn(3, 4))
            self.c = nn.Parameter(torch.randn(3, 4))
            self.d = nn.Parameter(torch.randn(3, 4))
            self.e = nn.Parameter(torch.randn(3, 4))
            self.f = nn.Parameter(torch.randn(3, 4))
            self.head = nn.Linear(4, 1)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        h = self.tok(idx) + self.pos.weight.unsqueeze(0)
        h = h * torch.stack([self.a, self.b]).sum(0)
        h = h + (torch.stack([self.e, self.f]) * torch.tensor([1.0, 2.0]).view(2, 1, 1)).sum(0)
        h = torch.tanh(h) + self.c.unsqueeze(0) + self.d.unsqueeze(0)
        return self.head(torch.tanh(h)).sum()


@pytest.mark.parametrize("view", [False, True])
@pytest.mark.parametrize("in_place", [0.0, 1e-5])
def test_in_place_gradients_that_autograd_aliases_stay_right(view: bool, in_place: float) -> None:
    ws = 2
    idx = [torch.tensor([[1, 5, 7]]), torch.tensor([[2, 5, 9]])]
    sums: dict[str, torch.Tensor] = {}
    for r in range(ws):
        ref = _AliasedGrads()
        ref(idx[r]).backward()
        for n, p in ref.named_parameters():
            sums[n] = sums.get(n, 0) + p.grad / ws

    def fn(comm: ThreadCommunicator) -> Any:
        model = _AliasedGrads()
        reducer = GradientReducer(model, comm, in_place_min_mb=in_place,
                                  gradient_as_bucket_view=view)
        own: dict[str, bool] = {}  # in-place bucket: is the buffer param.grad's own memory?

        def hook(state: Any, bucket: gradcomm.hooks.GradBucket) -> gradcomm.Work:
            if bucket.in_place:
                (p,) = bucket.parameters()
                own[bucket.param_names[0]] = bucket.buffer().data_ptr() == p.grad.data_ptr()
            return gradcomm.hooks.allreduce_hook(state, bucket)

        reducer.register_comm_hook(hook)
        got = []
        for _ in range(2):  # set_to_none: with aliased grads, torch's own += would double them
            model.zero_grad(set_to_none=True)
            model(idx[comm.rank]).backward()
            got.append(grads_of(model))
        return got, [b.param_names for b in reducer.buckets if b.in_place], own

    for got, in_place_names, own in run_ranks(ws, fn):
        assert ("pos.weight",) in in_place_names and ("tok.weight",) in in_place_names
        for step in got:
            assert grads_close(step, sums, rtol=1e-6) == []
        # a, b and c, d overlap (one memory each): sent as copies; the others in place, including
        # e and f, which share a storage without overlapping
        assert {n for n, mine in own.items() if not mine} == {"a", "b", "c", "d"}, own
        assert own["pos.weight"] and own["tok.weight"] and own["head.weight"]
        assert own["e"] and own["f"]


@pytest.mark.parametrize("view", [False, True])
@pytest.mark.parametrize("in_place", [math.inf, 0.0, 1e-5])
def test_aliased_gradients_on_one_rank_do_not_stay_aliased(view: bool, in_place: float) -> None:
    # Rank 0's batch of 1 makes autograd alias c's and d's gradients (one memory); rank 1's
    # batch of 2 does not. Written back into that memory, the two would stay one tensor, and with
    # zero_grad(set_to_none=False) the next backward would add both gradients into it (2x).
    idx = [torch.tensor([[1, 5, 7]]), torch.tensor([[2, 5, 9], [3, 0, 4]])]
    sums: dict[str, torch.Tensor] = {}
    for r in range(2):
        ref = _AliasedGrads()
        ref(idx[r]).backward()
        for n, p in ref.named_parameters():
            sums[n] = sums.get(n, 0) + p.grad / 2

    def fn(comm: ThreadCommunicator) -> Any:
        model = _AliasedGrads()
        GradientReducer(model, comm, in_place_min_mb=in_place, gradient_as_bucket_view=view)
        got = []
        for _ in range(3):
            model.zero_grad(set_to_none=False)
            model(idx[comm.rank]).backward()
            got.append(grads_of(model))
        return got, model.c.grad.data_ptr() != model.d.grad.data_ptr()

    out = run_ranks(2, fn)
    assert not any(isinstance(r, Exception) for r in out), out
    for got, apart in out:
        assert apart
        for step in got:
            assert grads_close(step, sums, rtol=1e-6) == []
    assert_identical([step for got, _ in out for step in got])


@pytest.mark.parametrize("in_place", IN_PLACE)
@pytest.mark.parametrize("overlap", [False, True])
def test_grads_that_are_views_of_a_flat_buffer_of_the_users_stay_its_views(
    in_place: float, overlap: bool
) -> None:
    # apex-style: the user points every p.grad at a view of one flat buffer (for a fused optimizer
    # or a norm over it) and zeroes it with set_to_none=False; as with DDP, the averaged gradients
    # must land in those views, not in new tensors that leave the buffer un-averaged.
    ref = reference_grads(2)

    def fn(comm: ThreadCommunicator) -> Any:
        model = eval_bn(make_model())
        GradientReducer(model, comm, bucket_cap_mb=0.002, first_bucket_cap_mb=0.0005,
                        in_place_min_mb=in_place, overlap=overlap)
        params = list(model.parameters())
        flat = torch.zeros(sum(p.numel() for p in params))
        views, offset = [], 0
        for p in params:
            p.grad = flat[offset:offset + p.numel()].view_as(p)
            views.append(p.grad)
            offset += p.numel()
        got = []
        for _ in range(2):
            model.zero_grad(set_to_none=False)
            loss_fn(model, *batch(comm.rank)).backward()
            assert all(p.grad is v for p, v in zip(params, views, strict=True))
            got.append(flat.clone())
        return got

    out = run_ranks(2, fn)
    assert not any(isinstance(r, Exception) for r in out), out
    want = torch.cat([ref[n].reshape(-1) for n, _ in make_model().named_parameters()])
    for got in out:
        for flat in got:
            assert torch.allclose(flat, want, rtol=1e-5, atol=1e-7)


def test_view_mode_with_set_to_none_repoints_grads() -> None:
    def fn(comm: ThreadCommunicator) -> Any:
        model = eval_bn(make_model())
        reducer = GradientReducer(model, comm, gradient_as_bucket_view=True)
        for step in range(2):
            model.zero_grad(set_to_none=True)
            loss_fn(model, *batch(comm.rank, seed=step)).backward()
        b = reducer._buckets[0]
        return all(p.grad is v for p, v in zip(b.params, b.views, strict=True))

    assert run_ranks(2, fn) == [True, True]


def test_view_mode_frees_the_separate_grad_when_its_bucket_is_sent() -> None:
    # With set_to_none, backward hands each parameter a fresh gradient; once it is copied into
    # the bucket and the bucket is sent, .grad must already be the view, so the fresh tensors of
    # sent buckets are freed during backward (peak extra memory: about one bucket).
    from gradcomm.hooks.comm_hooks import allreduce_hook

    def fn(comm: ThreadCommunicator) -> list[bool]:
        model = eval_bn(make_model())
        seen: list[bool] = []

        def hook(state: Any, bucket: Any) -> Any:
            flat = bucket.buffer()
            lo, hi = flat.data_ptr(), flat.data_ptr() + bucket.numel * flat.element_size()
            seen.extend(p.grad is None or lo <= p.grad.data_ptr() < hi
                        for p in bucket.parameters() if p.numel())
            return allreduce_hook(state, bucket)

        GradientReducer(model, comm, bucket_cap_mb=0.002, first_bucket_cap_mb=0.0005,
                        gradient_as_bucket_view=True, comm_hook=hook)
        for step in range(2):
            model.zero_grad(set_to_none=True)
            loss_fn(model, *batch(comm.rank, seed=step)).backward()
        return seen

    for seen in run_ranks(2, fn):
        assert seen and all(seen)


def test_in_place_gradient_missing_on_one_rank_keeps_the_parameter_layout() -> None:
    # The rank without the gradient receives the sum in a zero tensor; its .grad must have the
    # parameter's (channels_last) layout, as autograd would have given it; -0.0 and 0.0 agree.
    w0 = torch.randn(4, 3, 2, 2, generator=torch.Generator().manual_seed(0))
    x = torch.randn(2, 3, 4, 4, generator=torch.Generator().manual_seed(10))

    def fn(comm: ThreadCommunicator) -> Any:
        conv = nn.Parameter(w0.clone().to(memory_format=torch.channels_last))
        other = nn.Parameter(torch.ones(2))
        GradientReducer([("conv", conv), ("other", other)], comm,
                        in_place_min_mb=0.0 if comm.rank == 0 else -0.0)
        y = nn.functional.conv2d(x.contiguous(memory_format=torch.channels_last), conv)
        loss = other.sum() + (y.sum() if comm.rank == 0 else 0.0)
        loss.backward()
        return conv.grad

    local = w0.clone().to(memory_format=torch.channels_last).requires_grad_()
    nn.functional.conv2d(x.contiguous(memory_format=torch.channels_last), local).sum().backward()
    for g in run_ranks(2, fn):
        assert not isinstance(g, Exception), g
        assert g.is_contiguous(memory_format=torch.channels_last)
        assert torch.allclose(g, local.grad / 2, rtol=1e-6)


@pytest.mark.parametrize("in_place", [math.inf, 0.0])
def test_channels_last_and_noncontiguous_grads(in_place: float) -> None:
    ws = 2
    w0 = torch.randn(4, 3, 2, 2, generator=torch.Generator().manual_seed(0))

    def grads(rank: int) -> tuple[torch.Tensor, torch.Tensor]:
        conv = nn.Parameter(w0.clone().to(memory_format=torch.channels_last))
        mat = nn.Parameter(torch.randn(5, 3, generator=torch.Generator().manual_seed(1)).t())
        x = torch.randn(2, 3, 4, 4, generator=torch.Generator().manual_seed(10 + rank))
        y = nn.functional.conv2d(x.contiguous(memory_format=torch.channels_last), conv)
        (y.sum() + (mat * (rank + 1.5)).pow(2).sum()).backward()
        return conv.grad, mat.grad  # type: ignore[return-value]

    local = [grads(r) for r in range(ws)]

    def fn(comm: ThreadCommunicator) -> Any:
        conv = nn.Parameter(w0.clone().to(memory_format=torch.channels_last))
        mat = nn.Parameter(torch.randn(5, 3, generator=torch.Generator().manual_seed(1)).t())
        GradientReducer([("conv", conv), ("mat", mat)], comm, in_place_min_mb=in_place)
        x = torch.randn(2, 3, 4, 4, generator=torch.Generator().manual_seed(10 + comm.rank))
        y = nn.functional.conv2d(x.contiguous(memory_format=torch.channels_last), conv)
        (y.sum() + (mat * (comm.rank + 1.5)).pow(2).sum()).backward()
        return conv.grad, mat.grad

    for conv_g, mat_g in run_ranks(ws, fn):
        assert torch.allclose(conv_g, (local[0][0] + local[1][0]) / ws, rtol=1e-6)
        assert torch.allclose(mat_g, (local[0][1] + local[1][1]) / ws, rtol=1e-6)


# ---------------------------------------------------------------------------- construction
@pytest.mark.parametrize(("progress", "want_first", "want_buckets"),
                         [(True, 1.0, 2), (False, 25.0, 1)])
def test_first_bucket_cap_follows_background_progress(
    progress: bool, want_first: float, want_buckets: int
) -> None:
    # Two weights of 1.4 MiB: split by a 1 MiB first bucket, one bucket under 25 MiB.
    def fn(comm: ThreadCommunicator) -> tuple[float, int]:
        with seeded(0):
            model = nn.Sequential(nn.Linear(600, 600), nn.Linear(600, 600))
        reducer = GradientReducer(model, comm)
        return reducer.first_bucket_cap_mb, len(reducer.buckets)

    with patch.object(ThreadCommunicator, "background_progress", new_callable=PropertyMock,
                      return_value=progress):
        assert run_ranks(2, fn) == [(want_first, want_buckets)] * 2


@pytest.mark.parametrize(("cheap", "want"), [(True, 2.0), (False, math.inf)])
def test_in_place_min_mb_follows_cheap_collectives(cheap: bool, want: float) -> None:
    # A 2.4 MiB weight and its bias: reduced in place by default only where collectives are cheap.
    def fn(comm: ThreadCommunicator) -> tuple[float, list[bool], float]:
        with seeded(0):
            model = nn.Sequential(nn.Linear(800, 800))
        reducer = GradientReducer(model, comm)
        got = reducer.in_place_min_mb, [b.in_place for b in reducer.buckets]
        reducer.remove()  # one live reducer per parameter
        explicit = GradientReducer(model, comm, in_place_min_mb=3.0).in_place_min_mb
        return *got, explicit

    with patch.object(ThreadCommunicator, "cheap_collectives", new_callable=PropertyMock,
                      return_value=cheap):
        for got, in_place, explicit in run_ranks(2, fn):
            assert got == want and explicit == 3.0
            assert in_place == ([False, True] if cheap else [False])  # bias first
    assert resolve_in_place_min_mb(None, ThreadGroup(1).communicator(0)) == math.inf


def test_resolve_first_bucket_cap_mb_explicit_value_wins() -> None:
    for progress in (True, False):
        comm = cast(Any, SimpleNamespace(background_progress=progress))
        assert resolve_first_bucket_cap_mb(4.0, 25.0, comm) == 4.0
        assert resolve_first_bucket_cap_mb(None, 8.0, comm) == (1.0 if progress else 8.0)


def test_bucket_options_that_differ_across_ranks_raise_on_every_rank() -> None:
    def fn(comm: ThreadCommunicator) -> Any:
        GradientReducer(make_model(), comm, first_bucket_cap_mb=1.0 + comm.rank)
        return None

    for r in run_ranks(2, fn):
        assert isinstance(r, ValueError) and "first_bucket_cap_mb" in str(r), r
        assert "explicitly, the same on every rank" in str(r)


def test_construction_broadcasts_params_and_buffers_keeping_dtypes() -> None:
    def fn(comm: ThreadCommunicator) -> Any:
        model = make_model(seed=comm.rank)
        model.bn.num_batches_tracked.fill_(7 + comm.rank)
        model.bn.running_mean.fill_(float(comm.rank))
        GradientReducer(model, comm)
        return (torch.cat([p.detach().reshape(-1) for p in model.parameters()]),
                model.bn.num_batches_tracked.clone(), model.bn.running_mean.clone())

    out = run_ranks(3, fn)
    want = torch.cat([p.detach().reshape(-1) for p in make_model(seed=0).parameters()])
    for params, count, mean in out:
        assert torch.equal(params, want)
        assert count.dtype == torch.int64 and int(count) == 7
        assert torch.equal(mean, torch.zeros(3))


def test_broadcast_buffers_each_forward() -> None:
    def fn(comm: ThreadCommunicator) -> Any:
        model = eval_bn(make_model())
        GradientReducer(model, comm, broadcast_buffers=True)
        model.bn.running_var.fill_(float(comm.rank + 2))
        model(batch(comm.rank)[0])  # broadcast from rank 0 before the forward
        return model.bn.running_var.clone()

    for running_var in run_ranks(2, fn):
        assert torch.equal(running_var, torch.full((3,), 2.0))


def test_fingerprint_mismatch_raises_on_every_rank_naming_it() -> None:
    def fn(comm: ThreadCommunicator) -> Any:
        model = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2 if comm.rank == 0 else 5))
        GradientReducer(model, comm)

    out = run_ranks(3, fn)
    for err in out:
        assert isinstance(err, ValueError), err
        assert "1.weight" in str(err) and "(5, 4)" in str(err) and "rank 1" in str(err)


def test_a_first_parameter_that_differs_is_named_not_numbered() -> None:
    # The options' entries come first in the compared list: a new user read "entry #2" for the
    # model's first parameter.
    def fn(comm: ThreadCommunicator) -> Any:
        GradientReducer(nn.Sequential(nn.Linear(3 + comm.rank, 4)), comm)

    for err in run_ranks(2, fn):
        assert isinstance(err, ValueError), err
        assert str(err).startswith("the model differs across ranks at param 0.weight: rank 0 "
                                   "has '(4, 3)"), err
        assert "entry" not in str(err), err


def test_a_bucket_timeout_message_stays_within_200_characters() -> None:
    # The reducer's message quotes the collective's, which quotes its description: nested, it
    # once reached about 255 characters.
    def fn(comm: ThreadCommunicator) -> Any:
        model = nn.Sequential(nn.Linear(3, 4))
        reducer = GradientReducer(model, comm)
        model(torch.ones(2, 3)).sum().backward()  # every rank: the hook is agreed on
        if comm.rank == 1:
            return None  # skips the second backward
        with pytest.raises(gradcomm.CollectiveTimeoutError) as info:
            model(torch.ones(2, 3)).sum().backward()
        del reducer
        return str(info.value)

    out = ThreadGroup(2, timeout=1.0).run(fn)
    assert out[0].startswith("reducing ") and "did not complete within 1.0 s" in out[0], out[0]
    assert len(out[0]) <= 200, (len(out[0]), out[0])


def test_a_parameter_layout_that_differs_across_ranks_raises_on_every_rank() -> None:
    # A shared bucket holds each gradient in its parameter's memory order: a channels_last conv
    # weight on one rank against a contiguous one on the other summed unrelated elements (the
    # ranks' grads differed by 8.1 before the layout was part of the fingerprint).
    def fn(comm: ThreadCommunicator) -> Any:
        with seeded(0):
            model = nn.Conv2d(2, 3, 2)
        if comm.rank == 0:
            model = model.to(memory_format=torch.channels_last)
        GradientReducer(model, comm, in_place_min_mb=math.inf)

    for err in run_ranks(2, fn):
        assert isinstance(err, ValueError), err
        assert "param weight" in str(err) and "strides=(8, 1, 4, 2)" in str(err), err
        assert "strides=(8, 4, 2, 1)" in str(err), err


def test_size_one_dims_do_not_count_as_a_layout_difference() -> None:
    # (3, 1) with strides (1, 1) and (1, 3) lie alike in memory: no false mismatch
    def fn(comm: ThreadCommunicator) -> Any:
        w = torch.ones(3, 1) if comm.rank == 0 else torch.ones(1, 3).t()
        p = nn.Parameter(w)
        reducer = GradientReducer([("w", p)], comm)
        (p * (comm.rank + 1)).sum().backward()
        reducer.remove()
        return p.grad.clone()

    out = run_ranks(2, fn)
    assert not any(isinstance(r, Exception) for r in out), out
    for got in out:
        assert torch.equal(got, torch.full((3, 1), 1.5))


def test_fingerprint_mismatch_in_count() -> None:
    def fn(comm: ThreadCommunicator) -> Any:
        layers = [nn.Linear(2, 2) for _ in range(2 + comm.rank)]
        GradientReducer(nn.Sequential(*layers), comm)

    for err in run_ranks(2, fn):
        assert isinstance(err, ValueError) and "2.weight" in str(err)
        # the extra layer is reported as such, not as a difference in the reducer's options
        assert "'<no such entry>'" in str(err) and "bucket options differ" not in str(err)


def test_degenerate_models_and_world_size_one_issue_no_collective() -> None:
    group = ThreadGroup(1)

    def fn(comm: ThreadCommunicator) -> Any:
        model = eval_bn(make_model())
        GradientReducer(model, comm)
        loss_fn(model, *batch(0)).backward()
        return grads_of(model)

    out = group.run(fn)
    assert group.calls == [0]
    ref = {n: g for n, g in reference_grads(1).items()}
    assert grads_close(out[0], ref) == []


@pytest.mark.parametrize("kind", ["empty", "frozen", "zero_size"])
def test_degenerate_models(kind: str) -> None:
    def fn(comm: ThreadCommunicator) -> Any:
        if kind == "empty":
            model: nn.Module = nn.Sequential()
        elif kind == "frozen":
            model = nn.Linear(3, 2).requires_grad_(False)
        else:
            model = nn.Linear(0, 2)
        reducer = GradientReducer(model, comm)
        if kind == "zero_size":
            x = torch.randn(4, 0)
            (model(x).sum() * (comm.rank + 1)).backward()
            return model.weight.grad.shape, model.bias.grad.clone()  # type: ignore[union-attr]
        return len(reducer.buckets)

    out = run_ranks(2, fn)
    if kind == "zero_size":
        for shape, bias_grad in out:
            assert shape == (2, 0)
            assert torch.equal(bias_grad, torch.full((2,), 4 * 1.5))  # (4 + 8) / 2
    else:
        assert out == [0, 0]


# ---------------------------------------------------------------------------- errors
def test_replaced_parameter_detected() -> None:
    def fn(comm: ThreadCommunicator) -> Any:
        model = eval_bn(make_model())
        GradientReducer(model, comm)
        model.fc2.weight = nn.Parameter(torch.zeros(16, 16))
        loss_fn(model, *batch(comm.rank)).backward()

    for err in run_ranks(2, fn):
        assert isinstance(err, RuntimeError) and "fc2.weight" in str(err)


def test_parameter_frozen_on_one_rank_after_wrapping_raises_on_every_rank() -> None:
    # Without the check the rank that froze fc2.weight silently received the other rank's
    # gradient, halved, and its optimizer updated the "frozen" parameter.
    def fn(comm: ThreadCommunicator) -> Any:
        model = eval_bn(make_model())
        GradientReducer(model, comm)
        if comm.rank == 1:
            model.fc2.weight.requires_grad_(False)
        loss_fn(model, *batch(comm.rank)).backward()

    frozen_rank_error, other_error = run_ranks(2, fn, timeout=1.0)[::-1]
    assert isinstance(frozen_rank_error, RuntimeError)
    assert "fc2.weight was frozen" in str(frozen_rank_error)
    assert isinstance(other_error, gradcomm.CollectiveTimeoutError)  # its peer stopped: no hang


class _TwoPaths(nn.Module):
    """``proj`` registered first, and used through its second registration, ``blocks.0``."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(3, 3)
        self.blocks = nn.Sequential(self.proj, nn.Tanh())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.blocks(x)


@pytest.mark.parametrize("how", ["identity", "del", "nested", "second_path"])
def test_submodule_replaced_or_deleted_on_one_rank_raises_on_every_rank(how: str) -> None:
    # The replaced submodule's own parameter table still held its parameters, so replacing fc2 by
    # a module without parameters (or deleting it) passed the check: rank 1 trained another model
    # and rank 0 got fc2's gradient halved, with no error.
    def fn(comm: ThreadCommunicator) -> Any:
        if how == "nested":
            model: nn.Module = nn.Sequential(
                nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 3)), nn.Linear(3, 1))
        elif how == "second_path":  # one Linear registered twice; forward uses the second path
            model = _TwoPaths()
        else:
            model = eval_bn(make_model())
        GradientReducer(model, comm)
        if comm.rank == 1:
            if how == "identity":
                model.fc2 = nn.Identity()
            elif how == "del":
                del model.fc2  # Net.forward would fail on it: the check must come first
            elif how == "nested":
                cast(nn.Sequential, model[0])[1] = nn.Identity()
            else:
                cast(_TwoPaths, model).blocks[0] = nn.Identity()
        if how in ("nested", "second_path"):
            model(torch.ones(2, 3)).sum().backward()
        else:
            loss_fn(model, *batch(comm.rank)).backward()

    other_error, changed_rank_error = run_ranks(2, fn, timeout=1.0)
    name = {"nested": "0.1", "second_path": "blocks.0"}.get(how, "fc2")
    assert isinstance(changed_rank_error, RuntimeError), changed_rank_error
    assert f"submodule {name} was replaced, moved or deleted" in str(changed_rank_error)
    assert isinstance(other_error, gradcomm.CollectiveTimeoutError)  # its peer stopped: no hang


def test_parameter_free_submodule_replaced_is_fine() -> None:
    # Only submodules on the way to a reduced parameter are watched: swapping an activation
    # changes no parameter, and the gradients stay averaged.
    def fn(comm: ThreadCommunicator) -> Any:
        with torch.no_grad():
            model = nn.Sequential(nn.Linear(3, 3), nn.ReLU(), nn.Linear(3, 1))
            for k, p in enumerate(model.parameters()):
                p.copy_(torch.linspace(-1, 1, p.numel()).reshape(p.shape) * (k + 1))
        GradientReducer(model, comm)
        model[1] = nn.Tanh()
        model(torch.full((2, 3), float(comm.rank + 1))).sum().backward()
        return [p.grad.clone() for p in model.parameters()]

    out = run_ranks(2, fn)
    with torch.no_grad():
        ref = nn.Sequential(nn.Linear(3, 3), nn.Tanh(), nn.Linear(3, 1))
        for k, p in enumerate(ref.parameters()):
            p.copy_(torch.linspace(-1, 1, p.numel()).reshape(p.shape) * (k + 1))
    (ref(torch.cat([torch.full((2, 3), 1.0), torch.full((2, 3), 2.0)])).sum() / 2).backward()
    for got in out:
        for g, p in zip(got, ref.parameters(), strict=True):
            torch.testing.assert_close(g, p.grad)


def test_reassigned_buffer_is_picked_up() -> None:
    # A buffer has no gradient; broadcast_buffers reads the module's buffers at every forward,
    # so a reassigned one is what gets broadcast (DDP keeps broadcasting the stale tensor).
    def fn(comm: ThreadCommunicator) -> Any:
        model = eval_bn(make_model())
        GradientReducer(model, comm, broadcast_buffers=True)
        loss_fn(model, *batch(comm.rank)).backward()
        model.bn.running_mean = torch.full((3,), float(comm.rank + 7))
        loss_fn(model, *batch(comm.rank)).backward()
        return model.bn.running_mean.clone()

    for got in run_ranks(2, fn):
        assert torch.equal(got, torch.full((3,), 7.0)), got  # rank 0's new tensor, everywhere


def test_sparse_gradients_rejected_naming_the_parameter() -> None:
    def fn(comm: ThreadCommunicator) -> Any:
        model = nn.Sequential(nn.Embedding(4, 2, sparse=True))
        GradientReducer(model, comm)

    for err in run_ranks(2, fn):
        assert isinstance(err, TypeError) and "0.weight" in str(err)

    def fn2(comm: ThreadCommunicator) -> Any:
        emb = nn.Embedding(4, 2, sparse=True)
        GradientReducer([("table", emb.weight)], comm)
        emb(torch.tensor([1, 2])).sum().backward()

    for err in run_ranks(2, fn2):
        assert isinstance(err, TypeError) and "table" in str(err)

    def fn3(comm: ThreadCommunicator) -> Any:
        # The sparse gradient arrives after the pass began: refused when its bucket is sent.
        emb, head = nn.Embedding(4, 2, sparse=True), nn.Linear(2, 1)
        GradientReducer([("table", emb.weight), ("head", head.weight)], comm)
        head(emb(torch.tensor([1, 2]))).sum().backward()

    for err in run_ranks(2, fn3):
        assert isinstance(err, TypeError) and "table" in str(err) and "sparse" in str(err), err


@pytest.mark.parametrize("in_place", [math.inf, 0.0])
def test_timeout_names_the_bucket(in_place: float) -> None:
    def fn(comm: ThreadCommunicator) -> Any:
        model = nn.Sequential(nn.Linear(3, 3))
        GradientReducer(model, comm, in_place_min_mb=in_place)
        model(torch.ones(1, 3)).sum().backward()  # both ranks: one normal step
        if comm.rank == 0:
            model(torch.ones(1, 3)).sum().backward()
        return "done"

    out = run_ranks(2, fn, timeout=1.0)
    assert out[1] == "done"
    assert isinstance(out[0], gradcomm.CollectiveTimeoutError)
    assert "bucket 0" in str(out[0]) and "0.bias" in str(out[0])


def test_a_comm_hook_registered_on_some_ranks_only_raises_on_every_rank() -> None:
    # register_comm_hook is local; without a check, rank 0 would send float16 buckets against
    # rank 1's float32 ones (garbage on MPI, an abort on gloo).
    def fn(comm: ThreadCommunicator) -> Any:
        model = nn.Sequential(nn.Linear(3, 3))
        reducer = GradientReducer(model, comm)
        if comm.rank == 0:
            reducer.register_comm_hook("fp16_compress")
        try:
            model(torch.ones(1, 3)).sum().backward()
        except ValueError as exc:
            mismatch = str(exc)
        reducer.register_comm_hook("fp16_compress")  # now alike, still before a synced backward
        model(torch.ones(1, 3)).sum().backward()
        grads = model[0].weight.grad.clone()
        with pytest.raises(RuntimeError, match="before the first synchronised backward"):
            reducer.register_comm_hook("allreduce")
        return mismatch, grads

    out = run_ranks(2, fn)
    assert not any(isinstance(r, Exception) for r in out), out
    for mismatch, grads in out:
        assert "comm hook differs across ranks" in mismatch, mismatch
        assert "differs across ranks at register_comm_hook:" in mismatch, mismatch
        assert "shape" not in mismatch and "entry" not in mismatch, mismatch
        assert "fp16_compress_hook" in mismatch and "allreduce_hook" in mismatch, mismatch
        assert torch.equal(grads, out[0][1])


class _FailedWork(gradcomm.Work):
    """A collective the transport reports as failed, as gloo does when a peer closed."""

    def _wait(self, timeout: float | None) -> None:
        raise RuntimeError("fake transport: connection closed by peer")

    def _test(self) -> bool:
        raise RuntimeError("fake transport: connection closed by peer")


@pytest.mark.parametrize("overlap", [True, False])
@pytest.mark.parametrize("in_place", [math.inf, 0.0])
def test_a_failure_seen_anywhere_in_backward_refuses_later_backwards(
    overlap: bool, in_place: float
) -> None:
    # With overlap the failure shows first in the progress poll of a gradient hook, mid-backward;
    # without, in the wait at the end. Either way later backwards must refuse (a peer may have
    # completed that step), not send new collectives.
    def fn(comm: ThreadCommunicator) -> Any:
        model = nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 3), nn.Linear(3, 3))
        reducer = GradientReducer(model, comm, bucket_cap_mb=1e-5, first_bucket_cap_mb=1e-5,
                                  overlap=overlap, in_place_min_mb=in_place)
        model(torch.ones(1, 3)).sum().backward()  # a good step (and the comm-hook check)
        sent: list[int] = []

        def failing(state: Any, bucket: gradcomm.hooks.GradBucket) -> gradcomm.Work:
            sent.append(bucket.index())
            return _FailedWork("fake all_reduce", None)

        reducer._comm_hook.fn = failing  # the transport breaks (register_comm_hook refuses)
        errors = []
        for _ in range(2):
            with pytest.raises(RuntimeError) as info:
                model(torch.ones(1, 3)).sum().backward()
            errors.append(str(info.value))
        return errors, sent

    for errors, sent in run_ranks(2, fn):
        assert "connection closed by peer" in errors[0], errors
        assert "an earlier backward pass failed" in errors[1], errors
        assert "connection closed by peer" in errors[1], errors  # names the first failure
        assert sorted(set(sent)) == sorted(sent) and sent, sent  # nothing sent again


def test_first_backward_alone_times_out_checking_the_hook() -> None:
    def fn(comm: ThreadCommunicator) -> Any:
        model = nn.Sequential(nn.Linear(3, 3))
        GradientReducer(model, comm)
        if comm.rank == 0:
            model(torch.ones(1, 3)).sum().backward()
        return "done"

    out = run_ranks(2, fn, timeout=1.0)
    assert isinstance(out[0], gradcomm.CollectiveTimeoutError), out
    assert "same comm hook" in str(out[0]) and "all_gather" in str(out[0]), out[0]


def test_predivide_factor_given_as_int_or_numpy_scalar_is_one_option() -> None:
    # 2 on one rank and np.float32(2.0) on the other are the same factor: no false mismatch
    ref = reference_grads(2)

    def fn(comm: ThreadCommunicator) -> dict[str, torch.Tensor | None]:
        factor = 2 if comm.rank == 0 else np.float32(2.0)
        model = eval_bn(make_model())
        reducer = GradientReducer(model, comm, gradient_predivide_factor=factor)
        assert reducer.predivide_factors()[0] == (2.0, 1.0)
        loss_fn(model, *batch(comm.rank)).backward()
        return grads_of(model)

    out = run_ranks(2, fn)
    assert_reference_on_every_rank(out, ref)


def test_bad_arguments() -> None:
    comm = ThreadGroup(1).communicator(0)
    model = nn.Linear(2, 2)
    with pytest.raises(ValueError, match="bucket_cap_mb"):
        GradientReducer(model, comm, bucket_cap_mb=0)
    with pytest.raises(TypeError, match="bucket_cap_mb"):
        GradientReducer(model, comm, bucket_cap_mb="25")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="gradient_as_bucket_view must be True or False"):
        GradientReducer(model, comm, gradient_as_bucket_view="yes")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="overlap must be True or False"):
        GradientReducer(model, comm, overlap=None)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="in_place_min_mb must be a number of MiB >= 0"):
        GradientReducer(model, comm, in_place_min_mb=-1.0)
    with pytest.raises(TypeError, match="in_place_min_mb must be a number of MiB, got str"):
        GradientReducer(model, comm, in_place_min_mb="2")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="in_place_min_mb must be a number of MiB >= 0"):
        GradientReducer(model, comm, in_place_min_mb=math.nan)
    for bad, error in ((True, TypeError), (-1.0, ValueError), (math.nan, ValueError)):
        with pytest.raises(error, match="in_place_min_mb"):
            resolve_in_place_min_mb(bad, comm)  # type: ignore[arg-type]
    assert math.copysign(1.0, resolve_in_place_min_mb(-0.0, comm)) == 1.0  # ranks compare equal
    # sizes too large to count in bytes: refused early for caps, "none" for in_place_min_mb
    with pytest.raises(ValueError, match="bucket_cap_mb must be a positive number of MiB, finite"):
        GradientReducer(model, comm, bucket_cap_mb=1e308)
    with pytest.raises(ValueError, match="first_bucket_cap_mb"):
        GradientReducer(model, comm, first_bucket_cap_mb=math.inf)
    assert resolve_in_place_min_mb(1e308, comm) == math.inf
    big = GradientReducer(nn.Linear(2, 2), comm, in_place_min_mb=1e308)
    assert big.in_place_min_mb == math.inf and not any(b.in_place for b in big.buckets)
    big.remove()
    # numpy scalars are numbers too (a config read with numpy); numpy bools are not
    np_made = GradientReducer(nn.Linear(2, 2), comm, bucket_cap_mb=np.float32(0.5),
                              first_bucket_cap_mb=np.int64(1), in_place_min_mb=np.float32(0.0))
    assert np_made.in_place_min_mb == 0.0 and all(b.in_place for b in np_made.buckets)
    np_made.remove()
    # 1e30 MiB in bytes overflows float32, not float64
    np_big = GradientReducer(nn.Linear(2, 2), comm, bucket_cap_mb=np.float32(1e30))
    assert len(np_big.buckets) == 1
    np_big.remove()
    with pytest.raises(TypeError, match="in_place_min_mb must be a number of MiB, got bool"):
        GradientReducer(model, comm, in_place_min_mb=np.bool_(True))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="gradient_predivide_factor"):
        GradientReducer(model, comm, gradient_predivide_factor=-1.0)
    # outside [1, world_size] a factor multiplies: 1e39 gave zeros, 1e-39 NaN
    two = ThreadGroup(2)
    for bad in (0.5, 3.0, 1e39, 1e-39, math.inf, math.nan):
        with pytest.raises(ValueError, match=r"between 1 and world_size \(2\)"):
            GradientReducer(model, two.communicator(0), gradient_predivide_factor=bad)
    with pytest.raises(TypeError, match="gradient_predivide_factor must be a number"):
        GradientReducer(model, comm, gradient_predivide_factor="2")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="unknown comm hook"):
        GradientReducer(model, comm, comm_hook="fp8")
    with pytest.raises(TypeError, match="Communicator"):
        GradientReducer(model, object())  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="single tensor"):
        GradientReducer(torch.ones(2, requires_grad=True), comm)
    with pytest.raises(TypeError, match=r"an nn\.Module or an iterable of parameters, got int"):
        GradientReducer(42, comm)  # type: ignore[arg-type]
    comm.close()


# ---------------------------------------------------------------------------- half precision
def test_default_predivide_factor() -> None:
    assert default_predivide_factor(1, torch.float16) == 1.0
    assert default_predivide_factor(2, torch.float16) == 2.0
    assert default_predivide_factor(8, torch.float16) == 2.0
    assert default_predivide_factor(16, torch.float16) == 4.0
    assert default_predivide_factor(3, torch.float32) == 3.0


@pytest.mark.parametrize(("world_size", "value"), [(2, 40000.0), (8, 1e-7)])
@pytest.mark.parametrize("in_place", [math.inf, 0.0])
def test_fp16_average_neither_overflows_nor_underflows(
    world_size: int, value: float, in_place: float
) -> None:
    def fn(comm: ThreadCommunicator) -> Any:
        p = nn.Parameter(torch.zeros(3, dtype=torch.float16))
        GradientReducer([p], comm, in_place_min_mb=in_place)
        (p * torch.tensor(value, dtype=torch.float16)).sum().backward()
        return p.grad

    want = torch.full((3,), value, dtype=torch.float16)  # the average of equal values
    for g in run_ranks(world_size, fn):
        assert torch.isfinite(g).all() and bool((g != 0).all())
        assert torch.equal(g, want), (g, want)


def test_apply_gradient_allreduce_returns_module() -> None:
    ref = reference_grads(2)

    def fn(comm: ThreadCommunicator) -> Any:
        model = eval_bn(make_model(seed=comm.rank))
        assert apply_gradient_allreduce(model, comm) is model
        assert isinstance(model.gradient_reducer, GradientReducer)
        loss_fn(model, *batch(comm.rank)).backward()
        return grads_of(model)

    assert grads_close(run_ranks(2, fn)[1], ref) == []


def test_recovers_after_a_backward_pass_that_raised(caplog: pytest.LogCaptureFixture) -> None:
    def fn(comm: ThreadCommunicator) -> Any:
        a = nn.Parameter(torch.ones(3))
        b = nn.Parameter(torch.ones(3))
        GradientReducer([("a", a), ("b", b)], comm, first_bucket_cap_mb=1e-6, bucket_cap_mb=1e-6)
        handle = b.register_post_accumulate_grad_hook(
            lambda p: (_ for _ in ()).throw(KeyError("user hook failed")))
        try:  # a's bucket is sent, then a user hook raises: no end-of-backward callback
            ((b * 2).sum() + (a * (comm.rank + 1.0)).sum()).backward()
        except KeyError:
            pass
        handle.remove()
        a.grad = b.grad = None
        ((b * (comm.rank + 1.0)).sum() + (a * (comm.rank + 1.0)).sum()).backward()
        return a.grad, b.grad

    with caplog.at_level("WARNING", logger="gradcomm.hooks"):
        out = run_ranks(2, fn)
    for ga, gb in out:
        assert torch.equal(ga, torch.full((3,), 1.5)) and torch.equal(gb, torch.full((3,), 1.5))
    assert sum("ended with an error" in r.getMessage() for r in caplog.records) == 2


@pytest.mark.slow
@pytest.mark.parametrize("when", ["before", "after"])
def test_torch_compile_with_reducer_attached_before_or_after_first_call(when: str) -> None:
    def make() -> nn.Module:
        with seeded(0):
            return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 1))

    xs = [torch.randn(3, 6, generator=torch.Generator().manual_seed(r)) for r in range(2)]
    ref_model = make()
    ref_model(torch.cat(xs)).pow(2).mean().backward()
    ref = grads_of(ref_model)

    def fn(comm: ThreadCommunicator) -> Any:
        model = make()
        if when == "after":
            compiled = torch.compile(model, backend="aot_eager")  # no C++ compiler needed
            compiled(xs[comm.rank])
            GradientReducer(model, comm)
        else:
            GradientReducer(model, comm)
            compiled = torch.compile(model, backend="aot_eager")
        compiled(xs[comm.rank]).pow(2).mean().backward()
        return grads_of(model)

    out = run_ranks(2, fn, timeout=60)
    assert grads_close(out[0], ref, rtol=1e-5) == []  # type: ignore[arg-type]
    assert_identical(out)


def test_synchronize_is_idempotent_after_backward() -> None:
    def fn(comm: ThreadCommunicator) -> Any:
        p = nn.Parameter(torch.zeros(4))
        reducer = GradientReducer([p], comm)
        (p * (comm.rank + 1.0)).sum().backward()
        reducer.synchronize()  # nothing in flight: no collective, values unchanged
        reducer.synchronize()
        return p.grad

    for g in run_ranks(2, fn):
        assert torch.equal(g, torch.full((4,), 1.5))


def test_a_closed_communicator_is_refused_at_any_world_size() -> None:
    # at world_size 1 no collective runs, so the reducer and the profiler used to accept it
    from gradcomm.profiler import profile

    comm = gradcomm.init("gloo", env={})
    comm.close()
    model = nn.Linear(2, 2)
    with pytest.raises(RuntimeError, match="communicator is closed"):
        GradientReducer(model, comm)
    with pytest.raises(RuntimeError, match="communicator is closed"):
        gradcomm.apply_gradient_allreduce(model, comm)
    with pytest.raises(RuntimeError, match="communicator is closed"), profile(comm):
        pass
    assert not model._forward_pre_hooks  # nothing was attached


@pytest.mark.parametrize("name", [1, None, b"w"])
def test_parameter_names_must_be_strings(name: object) -> None:
    p = nn.Parameter(torch.ones(2))
    with gradcomm.init("gloo", env={}) as comm, pytest.raises(
        TypeError, match="parameter names must be str"
    ):
        GradientReducer([("ok", nn.Parameter(torch.ones(1))), (name, p)], comm)

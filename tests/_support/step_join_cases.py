"""Cases for the step consistency check and ``GradientReducer.join()``, on any backend.

As in ``reducer_cases``: each case is ``run(comm) -> result`` (every rank) and
``verify(results, world_size) -> problems`` (once, on every rank's result in rank order);
``tests/hooks/suite_step_join.py`` runs them on every backend, given this module's :data:`CASES`.

References are single-process computations: the mean over ranks of each rank's local gradient
(every rank's batch has the same size, so this is the gradient of the global batch).
"""

from __future__ import annotations

import io
from typing import Any

import torch
from torch import nn

import gradcomm
from gradcomm.hooks import GradientReducer, PowerSGDState
from gradcomm.hooks._autograd import STALE_GRAPH

from tests._support import reducer_cases as rc

Result = Any
Problems = list[str]
error_of = rc.error_of
SKIPPER = 1  # the rank that skips a backward
LR = 0.1


# ----------------------------------------------------------------------------- helpers
def net(seed: int = 0, bn: bool = False) -> nn.Module:
    g = torch.Generator().manual_seed(seed)
    layers: list[nn.Module] = [nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh(),
                               nn.Linear(8, 3)]
    if bn:
        layers.insert(1, nn.BatchNorm1d(8))
    model = nn.Sequential(*layers)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.5)
    return model


def x_of(rank: int, step: int, micro: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * rank + 10 * step + micro + 1)
    return torch.randn(4, 6, generator=g)


def loss_of(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return model(x).pow(2).mean()


def grads_of(model: nn.Module) -> dict[str, torch.Tensor | None]:
    return {n: None if p.grad is None else p.grad.detach().clone()
            for n, p in model.named_parameters()}


def state_of(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: t.detach().clone() for n, t in model.state_dict().items()}


def local_grads(model: nn.Module, xs: list[torch.Tensor]) -> dict[str, torch.Tensor]:
    """The gradient of the sum of ``loss_of`` over ``xs`` on an unwrapped copy of ``model``."""
    m = _copy(model)
    for x in xs:
        loss_of(m, x).backward()
    return {n: p.grad.detach().clone() for n, p in m.named_parameters()}


def _copy(model: nn.Module) -> nn.Module:
    buf = io.BytesIO()
    torch.save(model.state_dict(), buf)
    m = net(bn=any(isinstance(c, nn.BatchNorm1d) for c in model.modules()))
    m.load_state_dict(torch.load(io.BytesIO(buf.getvalue())))
    return m


def mean_of(dicts: list[dict[str, torch.Tensor]], divisor: int | None = None
            ) -> dict[str, torch.Tensor]:
    n = divisor or len(dicts)
    return {k: sum(d[k] for d in dicts) / n for k in dicts[0]}  # type: ignore[misc]


def close(got: dict[str, Any], want: dict[str, torch.Tensor], what: str,
          rtol: float = 1e-5, atol: float = 1e-6) -> Problems:
    out = []
    for k, w in want.items():
        g = got.get(k)
        if g is None or not torch.allclose(g, w, rtol=rtol, atol=atol):
            err = "None" if g is None else f"{(g - w).abs().max().item():.3g}"
            out.append(f"{what} {k}: off by {err}")
    return out


def out_of_step(counts: list[int]) -> str:
    """The message every rank must raise, given each rank's forward count (independent of
    gradcomm's formatting code only in that it is spelt out here)."""
    groups: dict[int, list[int]] = {}
    for r, c in enumerate(counts):
        groups.setdefault(c, []).append(r)
    parts = [f"{c} on rank{'s' if len(rs) > 1 else ''} {', '.join(map(str, rs))}"
             for c, rs in sorted(groups.items(), key=lambda kv: (-len(kv[1]), kv[0]))]
    return ("GradientReducer: ranks out of step (forwards with grad since the last synced "
            f"backward: {'; '.join(parts)}): a rank skipped a backward; nothing written back "
            "(docs/failures.md)")


# ----------------------------------------------------------------------------- step check
#: mode -> (reducer options, comm hook or None, micro-batches per step, forwards per micro-batch)
SKIP_MODES: dict[str, tuple[dict[str, Any], str | None, int, int]] = {
    "copy": ({"bucket_cap_mb": 1e-4}, None, 1, 1),
    "view": ({"bucket_cap_mb": 1e-4, "gradient_as_bucket_view": True}, None, 1, 1),
    "in_place": ({"in_place_min_mb": 0.0}, None, 1, 1),
    "fp16": ({"bucket_cap_mb": 1e-4}, "fp16_compress", 1, 1),
    "powersgd": ({}, "powersgd", 1, 1),
    "no_sync": ({"bucket_cap_mb": 1e-4}, None, 2, 1),
    "two_forwards": ({"bucket_cap_mb": 1e-4}, None, 1, 2),
}


def _step(model: nn.Module, reducer: GradientReducer, rank: int, step: int, micro: int,
          forwards: int, skip: bool = False) -> None:
    """One step: ``micro`` micro-batches (all but the last under no_sync), each ``forwards``
    forwards summed; ``skip``: the last micro-batch's backward is skipped (a NaN loss)."""
    for m in range(micro):
        loss = sum(loss_of(model, x_of(rank, step, 2 * m + f)) for f in range(forwards))
        if m < micro - 1:
            with reducer.no_sync():
                loss.backward()  # type: ignore[union-attr]
        elif not skip:
            loss.backward()  # type: ignore[union-attr]


def _step_inputs(rank: int, step: int, micro: int, forwards: int) -> list[torch.Tensor]:
    return [x_of(rank, step, 2 * m + f) for m in range(micro) for f in range(forwards)]


def _skip_mode(comm: gradcomm.Communicator, options: dict[str, Any], hook: str | None,
               micro: int, forwards: int) -> Result:
    model = net()
    reducer = GradientReducer(model, comm, **options)
    if hook == "powersgd":  # compressing from the first step
        reducer.register_comm_hook(hook, PowerSGDState(comm, start_powerSGD_iter=0,
                                                       min_compression_rate=0.0))
    elif hook is not None:
        reducer.register_comm_hook(hook)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    rank = comm.rank

    def train_step(s: int) -> None:
        _step(model, reducer, rank, s, micro, forwards)
        opt.step()  # only when the backward did not raise

    first = 0
    if rank == SKIPPER:
        _step(model, reducer, rank, 0, micro, forwards, skip=True)
        model.zero_grad()
        first = 1
    params = state_of(model)
    err = error_of(lambda: train_step(first))
    after_error, params_after = grads_of(model), state_of(model)
    model.zero_grad()
    ok = error_of(lambda: _step(model, reducer, rank, first + 1, micro, forwards))
    reducer.remove()
    return {"error": err, "after_error": after_error, "params": params,
            "params_after": params_after, "ok_error": ok, "grads": grads_of(model),
            "first": first}


def run_skipped_backward(comm: gradcomm.Communicator) -> Result:
    """Rank SKIPPER skips the backward of step 0 (its forward ran); every rank then runs one
    backward that must raise (no optimizer step follows), and one more that must give the
    reference."""
    return {mode: _skip_mode(comm, *spec) for mode, spec in SKIP_MODES.items()}


def verify_skipped_backward(results: list[Result], ws: int) -> Problems:
    problems = []
    for mode, (_, _, micro, forwards) in SKIP_MODES.items():
        counts = [micro * forwards * (2 if r == SKIPPER else 1) for r in range(ws)]
        want = ("RuntimeError", out_of_step(counts))
        model = net()
        ref = mean_of([local_grads(model, _step_inputs(r, results[r][mode]["first"] + 1, micro,
                                                        forwards)) for r in range(ws)])
        for r, res in enumerate(results):
            got = res[mode]
            if got["error"] != want:
                problems.append(f"{mode} rank {r}: raised {got['error']}, expected {want}")
            problems += close(got["params_after"], got["params"], f"{mode} rank {r} params")
            if mode in ("copy", "no_sync", "two_forwards", "fp16", "powersgd"):
                # copies were sent: param.grad still holds this rank's own gradient
                local = local_grads(model, _step_inputs(r, got["first"], micro, forwards))
                problems += close(got["after_error"], local, f"{mode} rank {r} grads after error")
            if got["ok_error"] is not None:
                problems.append(f"{mode} rank {r}: the step after raised {got['ok_error']}")
            if mode == "powersgd":  # an approximation: the same on every rank
                problems += close(got["grads"], results[0][mode]["grads"],  # type: ignore[arg-type]
                                  f"{mode} rank {r} next step against rank 0", 0, 0)
                continue
            tol = 2e-3 if mode == "fp16" else 1e-5
            problems += close(got["grads"], ref, f"{mode} rank {r} next step", rtol=tol, atol=tol)
    return problems


def run_consistent_loops(comm: gradcomm.Communicator) -> Result:
    """No false alarm: evaluation forwards under no_grad on rank 0 only, two reducers on one
    communicator (one model skips a backward: only its reducer raises), remove() and a new
    reducer after a skipped backward, and a reducer built from parameters."""
    rank = comm.rank
    out: dict[str, Any] = {}
    # evaluation under no_grad on rank 0 only, between steps
    model = net()
    reducer = GradientReducer(model, comm, bucket_cap_mb=1e-4)
    errs = []
    for step in range(2):
        if rank == 0:
            with torch.no_grad():
                model(x_of(9, step))
        model.zero_grad()
        errs.append(error_of(lambda s=step: loss_of(model, x_of(rank, s)).backward()))
    out["eval"] = {"errors": errs, "grads": grads_of(model)}
    reducer.remove()
    # two reducers, one communicator: model a skips a backward on SKIPPER, model b does not
    a, b = net(1), net(2)
    ra, rb = GradientReducer(a, comm), GradientReducer(b, comm)
    errors: dict[str, list[Any]] = {"a": [], "b": []}
    first = 0
    if rank == SKIPPER:
        loss_of(a, x_of(rank, 0))
        first = 1
    for s in range(first, first + 2):
        for name, m in (("a", a), ("b", b)):
            m.zero_grad()
            errors[name].append(error_of(lambda m=m, s=s: loss_of(m, x_of(rank, s)).backward()))
    out["two"] = {"errors": errors, "a": grads_of(a), "b": grads_of(b), "first": first}
    ra.remove()
    rb.remove()
    # remove() after a skipped backward, then a new reducer: it counts from its own start
    model = net()
    reducer = GradientReducer(model, comm)
    if rank == SKIPPER:
        loss_of(model, x_of(rank, 0))
    reducer.remove()
    reducer = GradientReducer(model, comm)
    err = error_of(lambda: loss_of(model, x_of(rank, 1)).backward())
    out["remove"] = {"error": err, "grads": grads_of(model)}
    reducer.remove()
    return out


def verify_consistent_loops(results: list[Result], ws: int) -> Problems:
    problems = []
    model = net()
    ref = mean_of([local_grads(model, [x_of(r, 1)]) for r in range(ws)])
    for r, res in enumerate(results):
        if res["eval"]["errors"] != [None, None]:
            problems.append(f"eval rank {r}: {res['eval']['errors']}")
        problems += close(res["eval"]["grads"], ref, f"eval rank {r}")
        if res["remove"]["error"] is not None:
            problems.append(f"remove rank {r}: {res['remove']['error']}")
        problems += close(res["remove"]["grads"], ref, f"remove rank {r}")
        two = res["two"]
        want_a = [("RuntimeError", out_of_step([2 if q == SKIPPER else 1 for q in range(ws)])),
                  None]
        if two["errors"]["a"] != want_a or two["errors"]["b"] != [None, None]:
            problems.append(f"two reducers rank {r}: {two['errors']}")
        ref_b = mean_of([local_grads(net(2), [x_of(q, results[q]["two"]["first"] + 1)])
                         for q in range(ws)])
        problems += close(two["b"], ref_b, f"two reducers rank {r} model b")
        ref_a = mean_of([local_grads(net(1), [x_of(q, results[q]["two"]["first"] + 1)])
                         for q in range(ws)])
        problems += close(two["a"], ref_a, f"two reducers rank {r} model a")
    return problems


def run_graph_before_reducer(comm: gradcomm.Communicator) -> Result:
    """A forward run before the reducer was built, backwarded after: an error on every rank before
    any collective (the reducer's with a module, autograd's with a parameter list), also while
    another graph recorded before stays alive; the next step works."""
    out: Result = {}
    for kind in ("module", "params"):
        model = net()
        if comm.rank != 0:
            with torch.no_grad():  # ranks start from different weights: the broadcast changes them
                model[0].weight.add_(1.0)
        loss = loss_of(model, x_of(comm.rank, 0))
        unused = loss_of(model, x_of(comm.rank, 2))  # recorded before, never backwarded
        reducer = GradientReducer(model if kind == "module" else list(model.parameters()), comm)
        err = error_of(loss.backward)
        model.zero_grad()
        del unused
        ok = error_of(lambda model=model: loss_of(model, x_of(comm.rank, 1)).backward())
        out[kind] = {"error": err, "ok": ok, "grads": grads_of(model)}
        reducer.remove()
    return out


def verify_graph_before_reducer(results: list[Result], ws: int) -> Problems:
    ref = mean_of([local_grads(net(), [x_of(r, 1)]) for r in range(ws)])
    problems = []
    for r, res in enumerate(results):
        for kind, got in res.items():
            error = got["error"]
            # A parameter-list reducer sees no forward: autograd's own error (versions bumped)
            if kind == "module":
                right = error == ("RuntimeError", STALE_GRAPH)
            else:
                right = error is not None and error[0] == "RuntimeError" and \
                    "modified by an inplace operation" in error[1]
            if not right or got["ok"] is not None:
                problems.append(f"rank {r} {kind}: {got['error']}, then {got['ok']}")
            problems += close(got["grads"], ref, f"rank {r} {kind}")
    return problems


# ----------------------------------------------------------------------------- join
#: mode -> (reducer options, join's divide_by_initial_world_size, micro-batches per step, bn)
JOIN_MODES: dict[str, tuple[dict[str, Any], bool, int, bool]] = {
    "plain": ({"bucket_cap_mb": 1e-4}, False, 1, False),
    "initial_world_size": ({"bucket_cap_mb": 1e-4}, True, 1, False),
    "view_in_place": ({"gradient_as_bucket_view": True, "in_place_min_mb": 2e-4}, False, 1,
                      False),
    "no_sync": ({"bucket_cap_mb": 1e-4}, False, 2, False),
    "buffers": ({"broadcast_buffers": True}, False, 1, True),
    "fp16": ({"bucket_cap_mb": 1e-4, "comm_hook": "fp16_compress"}, False, 1, False),
}
BASE_STEPS = 2


def join_extra_rank(ws: int) -> int:
    """The rank with extra batches: not rank 0 where there are 3 ranks (so rank 0 joins first,
    and the final sync and buffer broadcasts must come from another rank)."""
    return 0 if ws == 2 else 1


def _steps_of(rank: int, ws: int, extra: int) -> int:
    return BASE_STEPS + (extra if rank == join_extra_rank(ws) else 0)


def run_join(comm: gradcomm.Communicator, extras: tuple[int, ...] = (1, 2, 5)) -> Result:
    out = {}
    rank = comm.rank
    for extra in extras:
        for mode, (options, divide, micro, bn) in JOIN_MODES.items():
            model = net(bn=bn)
            reducer = GradientReducer(model, comm, **options)
            opt = torch.optim.SGD(model.parameters(), lr=LR)
            grads = []
            with reducer.join(divide_by_initial_world_size=divide):
                for step in range(_steps_of(rank, comm.world_size, extra)):
                    opt.zero_grad()
                    for m in range(micro):
                        loss = loss_of(model, x_of(rank, step, m))
                        if m < micro - 1:
                            with reducer.no_sync():
                                loss.backward()
                        else:
                            loss.backward()
                    grads.append(grads_of(model))
                    opt.step()
            out[f"{mode}/{extra}"] = {"grads": grads, "state": state_of(model)}
            reducer.remove()
    return out


def verify_join(results: list[Result], ws: int, extras: tuple[int, ...] = (1, 2, 5)) -> Problems:
    problems = []
    for extra in extras:
        for mode, (_, divide, micro, bn) in JOIN_MODES.items():
            key = f"{mode}/{extra}"
            tol = 5e-3 if mode == "fp16" else 1e-5  # float16 on the wire
            model = net(bn=bn)
            params = dict(model.named_parameters())
            n_steps = [_steps_of(r, ws, extra) for r in range(ws)]
            for step in range(max(n_steps)):
                active = [r for r in range(ws) if step < n_steps[r]]
                want = mean_of([local_grads(model, [x_of(r, step, m) for m in range(micro)])
                                for r in active], ws if divide else None)
                for r in active:
                    problems += close(results[r][key]["grads"][step], want,
                                      f"{key} rank {r} step {step}", tol, tol)
                with torch.no_grad():
                    for n, p in params.items():
                        p.sub_(LR * want[n])
            final = {n: p.detach() for n, p in params.items()}
            for r in range(ws):
                problems += close(results[r][key]["state"], final, f"{key} rank {r} final",
                                  tol, tol)
                if bn:  # buffers: the same on every rank
                    for n, t in results[r][key]["state"].items():
                        if not torch.equal(t, results[0][key]["state"][n]):
                            problems.append(f"{key} rank {r} buffer {n} differs from rank 0's")
    return problems


# ----------------------------------------------------------------------------- registry
CASES: rc.Cases = {
    "skipped_backward": (run_skipped_backward, verify_skipped_backward),
    "consistent_loops": (run_consistent_loops, verify_consistent_loops),
    "graph_before_reducer": (run_graph_before_reducer, verify_graph_before_reducer),
    "join": (run_join, verify_join),
}

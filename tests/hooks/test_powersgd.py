"""The PowerSGD comm hook: against a numpy reference of the algorithm (P, Q and the error memory
after each step), selection by name, plain all-reduce before ``start_powerSGD_iter``, and the
example trained with it under mpiexec (mpi and gloo). Ranks that end bit-identical on every
backend are the module tier's (``tests/hooks/suite_powersgd.py``).
"""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn

import gradcomm
from gradcomm.comm.backends.threads import ThreadCommunicator, ThreadGroup
from gradcomm.hooks import GradientReducer, PowerSGDState, powersgd_hook

from tests._support.dist_utils import run_mpi
from tests.test_example import RUN_TIMEOUT, SCRIPT, _check_output

WS = 2
SHAPE = (8, 6)  # compressed at rank 2 with min_compression_rate 1: 48 > (8 + 6) * 2
RANK = 2


def _run(world_size: int, fn: Any) -> list[Any]:
    def body(comm: ThreadCommunicator) -> Any:
        try:
            return fn(comm)
        except Exception as exc:  # noqa: BLE001 - the test inspects it
            return exc

    out = ThreadGroup(world_size, timeout=20.0).run(body)
    for r in out:
        if isinstance(r, Exception):
            raise r
    return out


def _grads(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's (weight, bias) gradients of step ``step`` (float64)."""
    g = torch.Generator().manual_seed(100 * step + rank)
    return (torch.randn(SHAPE, generator=g, dtype=torch.float64),
            torch.randn(SHAPE[0], generator=g, dtype=torch.float64))


def _orth(m: np.ndarray) -> np.ndarray:
    """Gram-Schmidt on the columns (the paper's orthogonalisation; epsilon 0)."""
    m = m.copy()
    for i in range(m.shape[1]):
        m[:, i] /= np.linalg.norm(m[:, i])
        for j in range(i + 1, m.shape[1]):
            m[:, j] -= m[:, i] * (m[:, i] @ m[:, j])
    return m


def _reference(steps: int) -> list[dict[str, Any]]:
    """Per step: P, Q (summed), each rank's error and the averaged gradients, in numpy float64.

    The reducer pre-divides by world_size (float64 default) and post-divides by 1, so the hook's
    input on rank r is ``M_r = g_r / 2 + E_r`` and the gradient it leaves is ``P Q^T`` (the sum).
    """
    seed = random.Random(0).randrange(2**31)  # PowerSGDState's first draw, random_seed=0
    q = torch.randn(SHAPE[1] * RANK, generator=torch.Generator().manual_seed(seed),
                    dtype=torch.float64).numpy().reshape(SHAPE[1], RANK)
    err = [np.zeros(SHAPE) for _ in range(WS)]
    out = []
    for step in range(steps):
        grads = [_grads(r, step) for r in range(WS)]
        m = [g[0].numpy() / WS + err[r] for r, g in enumerate(grads)]
        q = _orth(q)
        p = _orth(sum(mr @ q for mr in m))
        q = sum(mr.T @ p for mr in m)
        approx = p @ q.T
        err = [mr - approx / WS for mr in m]
        bias = sum(g[1].numpy() / WS for g in grads)
        out.append({"p": p, "q": q, "err": [e.copy() for e in err], "weight": approx,
                    "bias": bias})
    return out


def _toy(comm: gradcomm.Communicator, steps: int, **options: Any) -> list[dict[str, Any]]:
    w = nn.Parameter(torch.zeros(SHAPE, dtype=torch.float64))
    b = nn.Parameter(torch.zeros(SHAPE[0], dtype=torch.float64))
    state = PowerSGDState(comm, matrix_approximation_rank=RANK, start_powerSGD_iter=0,
                          min_compression_rate=1, **options)
    reducer = GradientReducer([("w", w), ("b", b)], comm, comm_hook="powersgd")
    reducer.register_comm_hook("powersgd", state=state)
    out = []
    for step in range(steps):
        gw, gb = _grads(comm.rank, step)
        w.grad = b.grad = None
        ((w * gw).sum() + (b * gb).sum()).backward()
        (index,) = state.error_dict
        n = SHAPE[0] * SHAPE[1]
        out.append({"w": w.grad.clone(), "b": b.grad.clone(),
                    "p": state.p_memory_dict[index].view(SHAPE[0], RANK).clone(),
                    "q": state.q_memory_dict[index].view(SHAPE[1], RANK).clone(),
                    "err": state.error_dict[index].clone(), "n": n})
    return out


@pytest.mark.timeout(60)
def test_p_q_and_error_feedback_equal_a_numpy_reference() -> None:
    steps = 3  # step 0 from a random Q; steps 1 and 2 warm-started and with error feedback
    ref = _reference(steps)
    out = _run(WS, lambda comm: _toy(comm, steps))
    for rank, got in enumerate(out):
        for step, (g, r) in enumerate(zip(got, ref, strict=True)):
            n = g["n"]
            # the error memory is ordered as the bucket: bias (registered last) first
            err_w = g["err"][SHAPE[0]:SHAPE[0] + n].view(SHAPE).numpy()
            where = f"rank {rank} step {step}"
            np.testing.assert_allclose(g["p"].numpy(), r["p"], rtol=1e-10, atol=1e-12,
                                       err_msg=where)
            np.testing.assert_allclose(g["q"].numpy(), r["q"], rtol=1e-10, atol=1e-12,
                                       err_msg=where)
            np.testing.assert_allclose(err_w, r["err"][rank], rtol=1e-10, atol=1e-12,
                                       err_msg=where)
            assert torch.equal(g["err"][:SHAPE[0]], torch.zeros(SHAPE[0], dtype=torch.float64))
            np.testing.assert_allclose(g["w"].numpy(), r["weight"], rtol=1e-10, atol=1e-12,
                                       err_msg=where)
            np.testing.assert_allclose(g["b"].numpy(), r["bias"], rtol=1e-12, err_msg=where)
    for a, b in zip(out[0], out[1], strict=True):  # bit-identical across ranks
        assert torch.equal(a["w"], b["w"]) and torch.equal(a["b"], b["b"])


@pytest.mark.timeout(60)
def test_without_warm_start_or_error_feedback_ranks_stay_identical() -> None:
    def fn(comm: gradcomm.Communicator) -> list[torch.Tensor]:
        w = nn.Parameter(torch.zeros(SHAPE, dtype=torch.float64))
        state = PowerSGDState(comm, matrix_approximation_rank=1, start_powerSGD_iter=0,
                              use_error_feedback=False, warm_start=False, min_compression_rate=1)
        reducer = GradientReducer([w], comm)
        reducer.register_comm_hook(powersgd_hook, state)
        out = []
        for step in range(2):
            w.grad = None
            (w * _grads(comm.rank, step)[0]).sum().backward()
            out.append(w.grad.clone())
        assert state.error_dict == {}
        return out

    out = _run(WS, fn)
    for a, b in zip(out[0], out[1], strict=True):
        assert torch.equal(a, b)
    assert torch.linalg.matrix_rank(out[0][1]) == 1  # a rank-1 approximation of the sum


@pytest.mark.timeout(60)
def test_plain_all_reduce_before_start_iter_and_default_options() -> None:
    def fn(comm: gradcomm.Communicator) -> Any:
        w = nn.Parameter(torch.zeros(SHAPE, dtype=torch.float64))
        reducer = GradientReducer([w], comm, comm_hook="powersgd")
        state = reducer._comm_hook.state
        grads = []
        for step in range(2):
            w.grad = None
            (w * _grads(comm.rank, step)[0]).sum().backward()
            grads.append(w.grad.clone())
        return state, grads

    out = _run(WS, fn)
    state = out[0][0]
    assert isinstance(state, PowerSGDState)
    assert (state.matrix_approximation_rank, state.start_powerSGD_iter,
            state.min_compression_rate, state.use_error_feedback, state.warm_start) == (
                1, 1000, 2.0, True, True)
    assert state.iter == 2 and state.error_dict == {}
    for step in range(2):
        want = sum(_grads(r, step)[0] for r in range(WS)) / WS
        assert torch.equal(out[0][1][step], out[1][1][step])
        torch.testing.assert_close(out[0][1][step], want, rtol=1e-15, atol=1e-15)


def test_bad_options() -> None:
    comm = ThreadGroup(1).communicator(0)
    with pytest.raises(ValueError, match="matrix_approximation_rank"):
        PowerSGDState(comm, matrix_approximation_rank=0)
    with pytest.raises(TypeError, match="start_powerSGD_iter"):
        PowerSGDState(comm, start_powerSGD_iter=1.5)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="min_compression_rate"):
        PowerSGDState(comm, min_compression_rate=-1)
    with pytest.raises(TypeError, match="Communicator"):
        PowerSGDState("gloo")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="PowerSGDState"):
        powersgd_hook(comm, None)  # type: ignore[arg-type]


@pytest.mark.mpi
@pytest.mark.slow
@pytest.mark.timeout(RUN_TIMEOUT + 30)
@pytest.mark.parametrize("backend", ["mpi", "gloo"])
def test_digits_example_with_powersgd_under_mpiexec(backend: str) -> None:
    result = run_mpi(SCRIPT, 2, ["--comm-hook", "powersgd"],
                     env={"GRADCOMM_BACKEND": backend}, timeout=RUN_TIMEOUT)
    acc, _ = _check_output(result.stdout, 2)
    assert acc >= 0.95

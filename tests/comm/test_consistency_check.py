"""The cross-rank collective check (gradcomm.comm.consistency): mismatched calls raise the same
RuntimeError on every rank (in ``GRADCOMM_DEBUG=detail`` mode), and
matching calls give the values they give without it. Every case of
``tests/_support/consistency_cases.py`` on every backend is the module tier's
(``tests/comm/suite_consistency.py``); here, the messages, the debug level and the reducer.
"""

from __future__ import annotations

import re

import pytest
import torch

import gradcomm
from gradcomm.comm.backends.threads import ThreadGroup
from gradcomm.comm.consistency import DebugLevel, debug_level_from_env, mismatch_message
from gradcomm.hooks import GradientReducer

from tests._support import consistency_cases as cc
from tests._support.reducer_common import (
    batch,
    eval_bn,
    grads_close,
    loss_fn,
    make_model,
    reference_grads,
)


def test_message_is_exact_on_every_rank() -> None:
    group = ThreadGroup(2, timeout=20)
    outcomes = group.run(lambda comm: cc.run_cases(comm, ["dtype"]))
    expected = ("ranks called different collectives at rank 0's all_reduce #0, first difference "
                "in dtype (rank 0: float32; rank 1: float64)")
    assert outcomes == [[("error", ("RuntimeError", expected))]] * 2


def test_fingerprint_fields_in_messages() -> None:
    group = ThreadGroup(2, timeout=20)

    def labelled(comm: gradcomm.Communicator) -> str:
        comm.debug = DebugLevel.DETAIL
        with pytest.raises(RuntimeError) as err:
            comm.all_reduce(torch.ones(2), label=f"bucket {comm.rank}")
        return str(err.value)

    assert group.run(labelled) == [
        "ranks called different collectives at rank 0's all_reduce #0, first difference in "
        "label (rank 0: 'bucket 0'; rank 1: 'bucket 1')"] * 2
    width = len(cc_fingerprint_row())
    row = cc_fingerprint_row()
    other = list(row)
    other[6] = 1234  # the split sizes' digest (after magic, op name, seq, dtype, numel)
    assert mismatch_message([row, row]) is None
    assert mismatch_message([row, other, row]) == (
        "ranks called different collectives at rank 0's all_reduce #7, first difference in "
        "split sizes (ranks 0,2: A; rank 1: B)")
    assert "sent no fingerprint" in str(mismatch_message([row, [0] * width]))


def cc_fingerprint_row() -> list[int]:
    from gradcomm.comm.consistency import fingerprint
    from gradcomm.comm.work import Description

    desc = Description("all_reduce", 7, 10, "", gradcomm.ReduceOp.SUM, splits=(1, 2))
    return fingerprint("all_reduce", desc, torch.float32)


def test_debug_is_off_by_default_and_parsed_once() -> None:
    comm = gradcomm.init("gloo", rank=0, world_size=1, env={})
    assert comm.debug is DebugLevel.OFF
    comm.close()
    comm = gradcomm.init("gloo", rank=0, world_size=1, env={"GRADCOMM_DEBUG": "DETAIL"})
    assert comm.debug is DebugLevel.DETAIL
    comm.close()
    comm = gradcomm.init("gloo", rank=0, world_size=1, env={"GRADCOMM_DEBUG": "detail"},
                         debug="off")  # the argument wins
    assert comm.debug is DebugLevel.OFF
    comm.close()
    assert debug_level_from_env({}) is DebugLevel.OFF
    with pytest.raises(ValueError, match=re.escape("GRADCOMM_DEBUG must be 'off' or 'detail'")):
        gradcomm.init("gloo", rank=0, world_size=1, env={"GRADCOMM_DEBUG": "verbose"})
    with pytest.raises(TypeError, match="debug must be a str or DebugLevel, got int"):
        gradcomm.init("gloo", rank=0, world_size=1, env={}, debug=2)  # type: ignore[arg-type]


@pytest.mark.parametrize("in_place", [float("inf"), 0.0])
def test_reducer_in_debug_mode_gives_the_reference_gradients(in_place: float) -> None:
    """The reducer's bucket all-reduces (asynchronous, labelled) pass the check unchanged."""
    def fn(comm: gradcomm.Communicator) -> dict[str, torch.Tensor]:
        comm.debug = "detail"
        model = eval_bn(make_model(seed=comm.rank))
        GradientReducer(model, comm, bucket_cap_mb=0.002, first_bucket_cap_mb=0.0005,
                        in_place_min_mb=in_place)
        loss_fn(model, *batch(comm.rank)).backward()
        return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    out = ThreadGroup(2, timeout=20).run(fn)
    ref = reference_grads(2)
    # 1e-4 of each tensor's largest value: thread ranks' convolutions may round differently from
    # the main thread's reference once other tests changed the intra-op thread settings (seen:
    # 2.5e-5); a wrong average or a mispaired bucket is off by far more. Ranks: bit-identical.
    assert grads_close(out[0], ref, rtol=1e-4) == []  # type: ignore[arg-type]
    assert all(torch.equal(out[0][n], out[1][n]) for n in ref)  # type: ignore[index]


def test_a_rank_that_never_comes_is_a_timeout_of_the_check() -> None:
    def fn(comm: gradcomm.Communicator) -> str:
        if comm.rank == 1:
            return "absent"
        comm.debug = "detail"
        with pytest.raises(gradcomm.CollectiveTimeoutError) as err:
            comm.all_gather(torch.zeros(4), torch.ones(2))
        return str(err.value)

    out = ThreadGroup(2, timeout=1).run(fn)
    assert out[1] == "absent"
    assert out[0] == ("consistency check before all_gather #0 of 2 torch.float32 on cpu (threads, "
                      "rank 0/2) did not complete within 1 s; a rank may have died or stalled")


def test_gather_and_scatter_with_none_off_the_root_pass_the_check() -> None:
    # docs/collectives.md's calls: the root-only buffer is None elsewhere; the check compares the
    # tensor every rank passes (a new user once saw "first difference in dtype (rank 0: none;
    # rank 1: float32)" on every rank).
    def fn(comm: gradcomm.Communicator) -> tuple[list[float], list[float]]:
        comm.debug = "detail"
        root = comm.rank == 0
        out = torch.empty(comm.world_size * 2) if root else None
        comm.gather(out, torch.full((2,), float(comm.rank)), 0)
        got = torch.empty(2)
        comm.scatter(got, torch.arange(2.0 * comm.world_size) if root else None, 0)
        return (out.tolist() if out is not None else []), got.tolist()

    out = ThreadGroup(3, timeout=20).run(fn)
    assert out[0][0] == [0.0, 0.0, 1.0, 1.0, 2.0, 2.0]
    assert [got for _, got in out] == [[0.0, 1.0], [2.0, 3.0], [4.0, 5.0]]


def _init_with_debug_on_rank_1(rank: int, world_size: int) -> str:
    with pytest.raises(ValueError) as info:  # on every rank, or the run fails with its traceback
        gradcomm.init("gloo", timeout=30, debug="detail" if rank == 1 else None)
    return str(info.value)


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_debug_levels_that_differ_are_refused_by_init_on_every_rank_under_torchrun() -> None:
    # Under an MPI launcher the settings check compares them (test_mpi_backend); a torchrun-style
    # launch compares them on the new communicator, before any check could pair with data.
    from tests._support.dist_utils import run_processes

    out = run_processes(_init_with_debug_on_rank_1, 2, timeout=90)
    assert out == ["the ranks chose different debug levels (rank 0: off; rank 1: detail); pass "
                   "the same debug or set the same GRADCOMM_DEBUG on every rank"] * 2

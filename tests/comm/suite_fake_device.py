"""Device correctness without a GPU, as rank-agnostic tests (the module tier,
:mod:`tests._support.rank_suite`; run by ``tests/comm/test_rank_suites.py`` on gloo and mpi at 2
and 3 ranks): the reducer (overlap, many buckets, bucket views, in-place buckets, fp16/bf16
compression), comm hooks, fingerprint and parameter broadcast, profiler and bench run on a
fake-device communicator wrapping the run's, bit for bit against the same run on the CPU
(``tests/_support/fake_device_checks.py``). The harness itself is tested in
``tests/comm/test_fake_device.py``.
"""

from __future__ import annotations

from torch import nn

import gradcomm
from gradcomm.hooks import GradientReducer

from tests._support import rank_suite
from tests._support.fake_device import FakeDeviceCommunicator, fake_device, to_fake_module
from tests._support.fake_device_checks import CASES, run_device_checks


def _processes(run: rank_suite.Run) -> bool:
    return run.backend in ("gloo", "mpi") and run.world_size >= 2


@rank_suite.only(_processes)
def test_every_layer_on_the_fake_device_matches_the_cpu(comm: gradcomm.Communicator) -> None:
    result = run_device_checks(comm)
    assert set(result) == {*CASES, "collectives", "bench"}, sorted(result)
    differs = {k: v for k, v in result.items() if v}
    assert differs == {}, differs


@rank_suite.only(lambda run: _processes(run) and run.world_size == 2)
def test_reducer_builds_on_a_device_communicator(comm: gradcomm.Communicator) -> None:
    # Before the fix the fingerprint's all-gather got CPU tensors: ValueError on every rank.
    with fake_device():
        model = to_fake_module(nn.Linear(4, 3))
        GradientReducer(model, FakeDeviceCommunicator(comm), comm_hook="fp16_compress").remove()
        devices = [str(p.device) for p in model.parameters()]
    assert devices == ["meta", "meta"], devices


@rank_suite.only(lambda run: _processes(run) and run.world_size == 2)
def test_fingerprint_mismatch_is_found_on_a_device_communicator(comm: gradcomm.Communicator
                                                                ) -> None:
    # The mismatch path's two extra all-gathers (hash table, descriptions) run on comm.device too.
    with fake_device():
        model = to_fake_module(nn.Linear(4, 3 + (comm.rank == 1)))  # rank 1's differs
        try:
            GradientReducer(model, FakeDeviceCommunicator(comm))
            text = "no error"
        except ValueError as exc:
            text = str(exc)
    assert comm.all_gather_object(text) == [text] * comm.world_size  # the same error everywhere
    assert "differs across ranks at param weight: rank 0 has" in text, text
    assert "rank 0 has '(3, 4)'; rank 1 has '(4, 4)'" in text, text

"""Device correctness without a GPU: every layer on a fake device, bit for bit against the CPU.

The harness (:mod:`fake_device`) is tested first: it must refuse what CUDA refuses, or the
checks below could pass on code that mixes devices. Then the reducer (overlap, many buckets,
bucket views, in-place buckets, fp16/bf16 compression), comm hooks, fingerprint and parameter
broadcast, profiler and bench run on a fake-device communicator over real gloo (2 and 3
spawned processes) and real MPI (``mpiexec -n 2`` and ``-n 3``).
"""

from __future__ import annotations

import copy
import re

import pytest
import torch
from torch import nn

import gradcomm
from gradcomm.hooks import GradientReducer

from tests._support.dist_utils import MPI_SCRIPTS, run_mpi, run_processes
from tests._support.fake_device import (
    FAKE,
    FakeDeviceCommunicator,
    FakeDeviceTensor,
    fake_device,
    to_cpu,
    to_fake,
    to_fake_module,
)
from tests._support.fake_device_checks import CASES, run_device_checks


# ============================================================================ the harness itself
def test_fake_tensor_reports_the_fake_device_and_computes_on_cpu_data() -> None:
    with fake_device():
        a = to_fake(torch.arange(6.0).view(2, 3))
        b = torch.ones(2, 3, device=FAKE)
        c = a * 2 + b
        assert isinstance(c, FakeDeviceTensor) and c.device == FAKE
        assert torch.equal(to_cpu(c), torch.arange(6.0).view(2, 3) * 2 + 1)
        view = c.t()[1]  # views alias the CPU data, as on a real device
        view.fill_(-1.0)
        assert torch.equal(to_cpu(c)[:, 1], torch.tensor([-1.0, -1.0]))
        assert c.data_ptr() == c._data.data_ptr()


def test_fake_tensor_refuses_mixing_with_cpu_tensors_like_cuda() -> None:
    with fake_device():
        a = to_fake(torch.ones(3))
        with pytest.raises(RuntimeError, match="Expected all tensors to be on the same device"):
            a + torch.ones(3)
        with pytest.raises(RuntimeError, match="same device"):
            torch.cat([a, torch.ones(3)])
        assert torch.equal(to_cpu(a + torch.tensor(2.0)), torch.full((3,), 3.0))  # 0-dim: ok
        a.copy_(torch.full((3,), 5.0))  # copies between devices are allowed, as on CUDA
        back = a.to("cpu")
        assert type(back) is torch.Tensor and back.device.type == "cpu"
        assert torch.equal(back, torch.full((3,), 5.0))
        assert isinstance(torch.zeros(2).to(FAKE), FakeDeviceTensor)
        assert a.tolist() == [5.0, 5.0, 5.0] and bool((a == 5).all())


def test_fake_module_autograd_runs_on_the_fake_device() -> None:
    torch.manual_seed(0)
    cpu = nn.Linear(3, 2)
    fake = to_fake_module(copy.deepcopy(cpu))
    x = torch.randn(4, 3)
    with fake_device():
        cpu(x).square().sum().backward()
        fake(to_fake(x)).square().sum().backward()
        assert fake.weight.device == FAKE and isinstance(fake.weight.grad, FakeDeviceTensor)
        assert torch.equal(to_cpu(fake.weight.grad), cpu.weight.grad)


def test_fake_communicator_refuses_cpu_tensors_like_a_cuda_communicator() -> None:
    inner = gradcomm.init("gloo", rank=0, world_size=1)
    with fake_device(), FakeDeviceCommunicator(inner) as comm:
        with pytest.raises(ValueError, match="tensor is on cpu, but this fake-gloo communicator "
                                             "works on meta"):
            comm.all_reduce(torch.ones(2))
        t = to_fake(torch.ones(2))
        comm.all_reduce(t)  # world_size 1: no collective, no error
        assert torch.equal(to_cpu(t), torch.ones(2))


# ============================================================================ finding 1
def _construct_on_fake(rank: int, world_size: int) -> list[str]:
    with gradcomm.init("gloo", timeout=60) as inner, fake_device():
        comm = FakeDeviceCommunicator(inner)
        model = to_fake_module(nn.Linear(4, 3))
        GradientReducer(model, comm, comm_hook="fp16_compress").remove()
        return [str(p.device) for p in model.parameters()]


@pytest.mark.multiprocess
@pytest.mark.slow
@pytest.mark.timeout(120)
def test_reducer_builds_on_a_device_communicator_with_two_ranks() -> None:
    # Before the fix the fingerprint's all-gather got CPU tensors: ValueError on every rank.
    assert run_processes(_construct_on_fake, 2, timeout=90) == [["meta", "meta"]] * 2


def _mismatch_on_fake(rank: int, world_size: int) -> str:
    with gradcomm.init("gloo", timeout=60) as inner, fake_device():
        comm = FakeDeviceCommunicator(inner)
        model = to_fake_module(nn.Linear(4, 3 + (rank == 1)))  # rank 1's differs
        try:
            GradientReducer(model, comm)
        except ValueError as exc:
            return str(exc)
        return "no error"


@pytest.mark.multiprocess
@pytest.mark.slow
@pytest.mark.timeout(120)
def test_fingerprint_mismatch_is_found_on_a_device_communicator() -> None:
    # The mismatch path's two extra all-gathers (hash table, descriptions) run on comm.device too.
    texts = run_processes(_mismatch_on_fake, 2, timeout=90)
    assert texts[0] == texts[1]  # every rank raises the same error
    assert "differs across ranks at param weight: rank 0 has" in texts[0], texts[0]
    assert "rank 0 has '(3, 4)'; rank 1 has '(4, 4)'" in texts[0], texts[0]


# ============================================================================ every layer
def _gloo_checks(rank: int, world_size: int) -> dict[str, list[str]]:
    torch.set_num_threads(1)
    with gradcomm.init("gloo", timeout=120) as comm:
        return run_device_checks(comm)


@pytest.mark.multiprocess
@pytest.mark.slow
@pytest.mark.timeout(400)
@pytest.mark.parametrize("world_size", [2, 3])
def test_every_layer_on_the_fake_device_matches_cpu_over_gloo(world_size: int) -> None:
    results = run_processes(_gloo_checks, world_size, timeout=360)
    for rank, result in enumerate(results):
        assert set(result) == {*CASES, "collectives", "bench"}
        assert {k: v for k, v in result.items() if v} == {}, f"rank {rank}"


@pytest.mark.mpi
@pytest.mark.slow
@pytest.mark.timeout(400)
@pytest.mark.parametrize("world_size", [2, 3])
def test_every_layer_on_the_fake_device_matches_cpu_over_mpi(world_size: int) -> None:
    proc = run_mpi(MPI_SCRIPTS / "fake_device.py", world_size, timeout=360)
    # Ranks print concurrently, so their lines may run together: search, do not split.
    found = re.findall(r"fake-device rank (\d+): (\d+) checks, all equal", proc.stdout)
    assert sorted(found) == [(str(r), str(len(CASES) + 2)) for r in range(world_size)], proc.stdout
    assert "differs" not in proc.stdout, proc.stdout

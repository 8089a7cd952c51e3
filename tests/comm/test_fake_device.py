"""Device correctness without a GPU: every layer on a fake device, bit for bit against the CPU.

Here, the harness (:mod:`tests._support.fake_device`): it must refuse what CUDA refuses, or the
checks could pass on code that mixes devices. The checks themselves -- the reducer (overlap, many
buckets, bucket views, in-place buckets, fp16/bf16 compression), comm hooks, fingerprint and
parameter broadcast, profiler and bench on a fake-device communicator over real gloo and MPI at
2 and 3 ranks -- are the module tier's (``tests/comm/suite_fake_device.py``).
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import gradcomm

from tests._support.fake_device import (
    FAKE,
    FakeDeviceCommunicator,
    FakeDeviceTensor,
    fake_device,
    to_cpu,
    to_fake,
    to_fake_module,
)


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

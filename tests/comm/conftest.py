"""Fixtures shared by the GPU-path tests of gradcomm.comm (fake CUDA, fake NCCL; see fake_cuda)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch.distributed as dist

from gradcomm.comm import Launcher, LaunchInfo
from gradcomm.comm.backends import cupy_nccl

from tests._support.fake_cuda import install, install_cupy


@pytest.fixture
def cupy_comm(monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[Any, Any, Any]]:
    """Rank 0 of 2 of a cupy-nccl communicator on the fake CUDA runtime and NCCL:
    ``(comm, fake, nccl_module)``, with the fake's call log cleared after construction."""
    fake = install(monkeypatch)
    nccl_mod = install_cupy(monkeypatch, fake.log)
    monkeypatch.setattr(cupy_nccl, "create_store", lambda *a: dist.HashStore())
    comm = cupy_nccl.CupyNCCLCommunicator(LaunchInfo(0, 2, 0, 1, Launcher.EXPLICIT), timeout=5.0)
    fake.log.calls.clear()
    yield comm, fake, nccl_mod
    comm.close()

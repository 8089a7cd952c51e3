"""Registration, the transport rule and the env:// handler, in this process (no job started)."""

from __future__ import annotations

import datetime
from typing import Any

import pytest
import torch.distributed as dist

import gradcomm
from gradcomm.torch_backend import Options, _launch
from gradcomm.torch_backend._options import transport_for

from tests._support.dist_utils import plain_python

_LAUNCH_VARIABLES = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK",
                     "PMI_RANK", "PMI_SIZE", "OMPI_COMM_WORLD_RANK", "PMIX_RANK",
                     "MV2_COMM_WORLD_RANK", "SLURM_PROCID", "SLURM_NTASKS", "GRADCOMM_BACKEND")


def test_import_registers_gradcomm_for_cpu_and_cuda_without_starting_mpi() -> None:
    assert dist.Backend.GRADCOMM == "gradcomm"  # type: ignore[attr-defined]
    assert dist.Backend.backend_capability["gradcomm"] == ["cpu", "cuda"]
    gradcomm.torch_backend.register()  # idempotent
    out = plain_python("import sys, gradcomm, torch.distributed as dist; "
                       "print('gradcomm' in dist.Backend.backend_list, 'mpi4py' in sys.modules)")
    assert out.stdout.split() == ["True", "False"], out.stderr


@pytest.mark.parametrize(("env", "options", "cpu", "cuda"), [
    ({}, None, "gloo", "nccl-or-mpi"),
    ({"GRADCOMM_BACKEND": "mpi"}, None, "mpi", "mpi"),
    ({"GRADCOMM_BACKEND": "nccl"}, None, "gloo", "nccl"),
    ({"GRADCOMM_BACKEND": "gloo"}, None, "gloo", "nccl-or-mpi"),
    ({"GRADCOMM_BACKEND": "cpu:mpi,cuda:cupy-nccl"}, None, "mpi", "cupy-nccl"),
    ({"GRADCOMM_BACKEND": "mpi"}, Options(transport="gloo"), "gloo", "nccl-or-mpi"),
    ({}, Options(transport={"cpu": "MPI", "cuda": "mpi"}), "mpi", "mpi"),
])
def test_transport_per_device_type(env: dict[str, str], options: Options | None, cpu: str,
                                   cuda: str) -> None:
    assert transport_for("cpu", options, env) == cpu
    found = transport_for("cuda", options, env)
    assert found == cuda or (cuda == "nccl-or-mpi" and found in ("nccl", "mpi"))


def test_bad_transports_raise_clear_errors() -> None:
    with pytest.raises(ValueError, match="unknown transport 'mpii'"):
        Options(transport="mpii")
    with pytest.raises(ValueError, match="names no device type"):
        Options(transport=":mpi")
    with pytest.raises(TypeError, match="must be a str, a mapping or None"):
        Options(transport=3)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="GRADCOMM_BACKEND: unknown transport"):
        transport_for("cpu", None, {"GRADCOMM_BACKEND": "tcp"})


class _Recorder:
    def __init__(self) -> None:
        self.calls: list[str] = []

    def __call__(self, url: str, timeout: datetime.timedelta, **kwargs: Any) -> Any:
        self.calls.append(url)
        yield "torch's store", 0, 1


@pytest.fixture
def torch_handler(monkeypatch: pytest.MonkeyPatch) -> _Recorder:
    for name in _LAUNCH_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    recorder = _Recorder()
    monkeypatch.setattr(_launch, "_torch_env_handler", recorder)
    return recorder


def test_env_handler_is_torchs_when_torchrun_variables_are_set(
        torch_handler: _Recorder, monkeypatch: pytest.MonkeyPatch) -> None:
    for name, value in (("RANK", "0"), ("WORLD_SIZE", "1"), ("MASTER_ADDR", "127.0.0.1"),
                        ("MASTER_PORT", "29999"), ("PMI_RANK", "0"), ("PMI_SIZE", "1")):
        monkeypatch.setenv(name, value)
    assert next(_launch.env_rendezvous("env://"))[0] == "torch's store"
    assert torch_handler.calls == ["env://"]


def test_env_handler_is_torchs_without_a_launcher(torch_handler: _Recorder) -> None:
    assert next(_launch.env_rendezvous("env://"))[0] == "torch's store"


def test_env_handler_reads_slurm_variables(torch_handler: _Recorder,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SLURM_PROCID", "0")
    monkeypatch.setenv("SLURM_NTASKS", "1")
    store, rank, size = next(_launch.env_rendezvous("env://"))
    assert (rank, size) == (0, 1) and torch_handler.calls == []
    store.set("k", "v")
    assert store.get("k") == b"v"


def test_env_handler_under_srun_without_master_addr_says_what_to_set(
        torch_handler: _Recorder, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SLURM_PROCID", "1")
    monkeypatch.setenv("SLURM_NTASKS", "2")
    with pytest.raises(RuntimeError, match="set MASTER_ADDR and MASTER_PORT"):
        next(_launch.env_rendezvous("env://"))


def test_pg_options_of_another_type_are_refused() -> None:
    from gradcomm.torch_backend._registration import create_process_group

    with pytest.raises(TypeError, match=r"gradcomm\.torch_backend\.Options"):
        create_process_group(object(), pg_options={"transport": "mpi"})

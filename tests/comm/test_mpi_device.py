"""The MPI device-buffer adapter and CUDA-awareness detection, exercised without a GPU.

The CUDA-aware path is driven with a fake device array that exposes ``__cuda_array_interface__``
over host memory (mpi4py's own test trick) and a recording ``synchronize``; the staging path runs
on CPU tensors, which stand in for device tensors (pinned memory is used only for CUDA tensors).
``test_real_mpi_job`` runs this file as a script under ``mpiexec -n 2``: mpi4py reduces the fake
arrays and the staged buffers for real.
"""

from __future__ import annotations

import ctypes
import re
import sys
import traceback
import warnings
from typing import Any

import numpy as np
import pytest
import torch

from gradcomm import SlowPathWarning
from gradcomm.comm.backends import cuda_packages
from gradcomm.comm.backends.mpi import device as mpi_device
from gradcomm.comm.backends.mpi.device import (
    DeviceBufferAdapter,
    cuda_aware_mpi,
    wire_view,
)


class FakeDeviceArray:
    """Host memory of a CPU tensor presented through ``__cuda_array_interface__`` (version 3)."""

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor  # keeps the memory alive
        self.__cuda_array_interface__ = {
            "shape": tuple(tensor.shape),
            "typestr": tensor.numpy().dtype.str,
            "data": (tensor.data_ptr(), False),
            "strides": None,
            "version": 3,
            "stream": None,
        }


def host_view(array: Any) -> np.ndarray:
    """numpy over the memory a CAI object points at (what an MPI library would touch)."""
    cai = array.__cuda_array_interface__
    dtype = np.dtype(cai["typestr"])
    count = int(np.prod(cai["shape"]))
    raw = (ctypes.c_char * (count * dtype.itemsize)).from_address(cai["data"][0])
    return np.frombuffer(raw, dtype=dtype, count=count)


class Recorder:
    """Records the calls of synchronize / to_array / the fake MPI op / finish in order."""

    def __init__(self) -> None:
        self.events: list[str] = []

    def synchronize(self) -> None:
        self.events.append("synchronize")

    def to_array(self, wire: torch.Tensor) -> FakeDeviceArray:
        self.events.append("to_array")
        return FakeDeviceArray(wire)


@pytest.fixture
def fresh_warning(monkeypatch: pytest.MonkeyPatch) -> None:
    """Forget that the once-per-process staging warning was given."""
    monkeypatch.setattr(mpi_device, "_warned", set())


# ----------------------------------------------------------------------------- detection
@pytest.mark.parametrize(
    "value, expected", [("1", True), ("true", True), ("0", False), ("no", False)]
)
def test_env_override(value: str, expected: bool) -> None:
    aware, reason = cuda_aware_mpi({"GRADCOMM_MPI_CUDA_AWARE": value})
    assert aware is expected
    assert "GRADCOMM_MPI_CUDA_AWARE" in reason


def test_env_override_rejects_other_values() -> None:
    with pytest.raises(ValueError, match="GRADCOMM_MPI_CUDA_AWARE must be one of 1/true/yes/on"):
        cuda_aware_mpi({"GRADCOMM_MPI_CUDA_AWARE": "maybe"})


def test_mpich_gpu_switched_off() -> None:
    aware, reason = cuda_aware_mpi({"MPIR_CVAR_ENABLE_GPU": "0"})
    assert not aware and "MPIR_CVAR_ENABLE_GPU=0" in reason


# ----------------------------------------------------------------------------- CUDA-aware path
def test_cuda_aware_path_is_zero_copy_and_synchronises_first() -> None:
    rec = Recorder()
    adapter = DeviceBufferAdapter(True, synchronize=rec.synchronize, to_array=rec.to_array)
    t = torch.arange(6, dtype=torch.float32).reshape(2, 3)
    buf, finish = adapter.prepare(t)
    rec.events.append("mpi")
    view = host_view(buf)
    view *= 10  # the "MPI library" writes through the device pointer
    finish()
    rec.events.append("finish done")
    assert rec.events == ["synchronize", "to_array", "mpi", "finish done"]
    assert t.flatten().tolist() == [0.0, 10.0, 20.0, 30.0, 40.0, 50.0]
    assert buf.__cuda_array_interface__["shape"] == (6,)


def test_cuda_aware_bfloat16_travels_as_int16_bits() -> None:
    rec = Recorder()
    adapter = DeviceBufferAdapter(True, synchronize=rec.synchronize, to_array=rec.to_array)
    t = torch.tensor([1.5, -2.0, 3.25], dtype=torch.bfloat16)
    buf, _ = adapter.prepare(t)
    assert buf.__cuda_array_interface__["typestr"] == "<i2"
    assert host_view(buf).tolist() == t.view(torch.int16).tolist()


def test_wire_view_shares_memory_and_detaches() -> None:
    p = torch.ones(4, requires_grad=True)
    w = wire_view(p)
    assert w.data_ptr() == p.data_ptr() and not w.requires_grad
    assert wire_view(torch.zeros(2, 2, dtype=torch.bfloat16)).dtype == torch.int16


# ----------------------------------------------------------------------------- staging path
def test_staging_copies_out_and_back(fresh_warning: None) -> None:
    rec = Recorder()
    adapter = DeviceBufferAdapter(False, synchronize=rec.synchronize)
    t = torch.tensor([1.0, 2.0, 3.0])
    with pytest.warns(SlowPathWarning, match="staged through pinned host memory"):
        buf, finish = adapter.prepare(t)
    assert isinstance(buf, np.ndarray) and buf.tolist() == [1.0, 2.0, 3.0]
    assert not np.shares_memory(buf, t.numpy())
    assert rec.events == ["synchronize"]
    buf *= 2  # MPI's result lands in host memory only ...
    assert t.tolist() == [1.0, 2.0, 3.0]
    finish()  # ... until finish copies it back
    assert t.tolist() == [2.0, 4.0, 6.0]
    with pytest.raises(RuntimeError, match="called twice"):
        finish()


def test_staging_bfloat16_round_trip_is_bit_exact(fresh_warning: None) -> None:
    adapter = DeviceBufferAdapter(False, synchronize=lambda: None)
    t = torch.tensor([0.1, -7.5, 1e-3, 3e38], dtype=torch.bfloat16)
    bits = t.view(torch.int16).clone()
    with pytest.warns(SlowPathWarning):
        buf, finish = adapter.prepare(t)
    assert buf.dtype == np.int16 and buf.tolist() == bits.tolist()
    t.zero_()
    finish()
    assert torch.equal(t.view(torch.int16), bits)


def test_staging_warns_once_per_process(fresh_warning: None) -> None:
    adapter = DeviceBufferAdapter(False, synchronize=lambda: None)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(3):
            _, finish = adapter.prepare(torch.ones(5))
            finish()
        DeviceBufferAdapter(False, synchronize=lambda: None).prepare(torch.ones(2))
    assert [w.category for w in caught] == [SlowPathWarning]


def test_staging_pool_reuses_buffers_but_never_shares_one_in_flight(fresh_warning: None) -> None:
    adapter = DeviceBufferAdapter(False, synchronize=lambda: None)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", SlowPathWarning)
        a, finish_a = adapter.prepare(torch.ones(8))
        b, finish_b = adapter.prepare(torch.ones(8))  # in flight together: separate memory
        assert not np.shares_memory(a, b)
        ptr_a = a.ctypes.data
        finish_a()
        finish_b()
        c, finish_c = adapter.prepare(torch.ones(8))
        assert c.ctypes.data in (ptr_a, b.ctypes.data)  # reused from the pool
        finish_c()


def test_staging_read_and_write_hints(fresh_warning: None) -> None:
    adapter = DeviceBufferAdapter(False, synchronize=lambda: None)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", SlowPathWarning)
        src = torch.full((4,), 7.0)
        buf, finish = adapter.prepare(src, write=False)  # a pure input
        buf[:] = -1.0
        finish()
        assert src.tolist() == [7.0] * 4  # not written back
        out = torch.zeros(4)
        buf, finish = adapter.prepare(out, read=False)  # a pure output, reusing that buffer
        assert buf.tolist() == [-1.0] * 4  # the tensor was not copied in
        buf[:] = 3.0
        finish()
        assert out.tolist() == [3.0] * 4


def test_prepare_rejects_bad_input() -> None:
    adapter = DeviceBufferAdapter(True, synchronize=lambda: None, to_array=FakeDeviceArray)
    with pytest.raises(TypeError, match=r"torch\.Tensor"):
        adapter.prepare(np.zeros(3))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="contiguous"):
        adapter.prepare(torch.zeros(4, 4).t())


def test_default_synchronize_and_conversion_on_cpu(fresh_warning: None) -> None:
    """Defaults: no stream to synchronise for a CPU tensor; the default converter needs CuPy."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", SlowPathWarning)
        _buf, finish = DeviceBufferAdapter(False).prepare(torch.ones(3))
        finish()
    aware = DeviceBufferAdapter(True)
    try:
        import cupy  # type: ignore[import-not-found, unused-ignore]  # noqa: F401
    except ImportError:
        with pytest.raises(ImportError, match=re.escape(cuda_packages.cupy_pip())):
            aware.prepare(torch.ones(3))
    else:
        pytest.skip("cupy is installed: its CPU-side error path cannot be reached here")


# ----------------------------------------------------------------------------- real MPI
@pytest.mark.slow
@pytest.mark.mpi
def test_real_mpi_job() -> None:
    from tests._support.dist_utils import run_mpi

    out = run_mpi(__file__, 2, ["--mpi-job"], timeout=90).stdout
    for rank in range(2):
        assert f"RESULT mpi_device ok rank={rank}" in out, out


def _mpi_job() -> None:
    """Under mpiexec: detection, the CAI path and the staging path with real MPI reductions."""
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()

    aware, reason = cuda_aware_mpi({})
    if "pypi.org/p/mpich" in MPI.Get_library_version():  # PyPI's MPICH: built without CUDA
        assert not aware and "MPIX_Query_cuda_support() of libmpi" in reason, reason
    assert cuda_aware_mpi({"GRADCOMM_MPI_CUDA_AWARE": "1"})[0] is True

    # CUDA-aware path: mpi4py takes the fake device arrays as buffers (host memory underneath).
    for dtype in (torch.float32, torch.float64, torch.int64):
        rec = Recorder()
        adapter = DeviceBufferAdapter(True, synchronize=rec.synchronize, to_array=rec.to_array)
        t = (torch.arange(10) * (rank + 1)).to(dtype)
        buf, finish = adapter.prepare(t)
        rec.events.append("mpi")
        comm.Allreduce(MPI.IN_PLACE, buf, op=MPI.SUM)
        finish()
        expected = (torch.arange(10) * sum(range(1, size + 1))).to(dtype)
        assert torch.equal(t, expected), (dtype, t)
        assert rec.events == ["synchronize", "to_array", "mpi"], rec.events

    b = torch.tensor([0.1, 2.5, -3.0], dtype=torch.bfloat16) * (1 if rank == 0 else 0)
    buf, finish = DeviceBufferAdapter(True, synchronize=lambda: None, to_array=FakeDeviceArray) \
        .prepare(b)
    comm.Bcast(buf, root=0)
    finish()
    assert torch.equal(b, torch.tensor([0.1, 2.5, -3.0], dtype=torch.bfloat16)), b

    # Staging path: non-blocking reductions on separate host copies, written back by finish().
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        staging = DeviceBufferAdapter(False, synchronize=lambda: None)
        x = torch.full((1000,), float(rank + 1))
        y = torch.arange(7, dtype=torch.int32) + rank
        bx, fx = staging.prepare(x)
        by, fy = staging.prepare(y)
        reqs = [comm.Iallreduce(MPI.IN_PLACE, bx), comm.Iallreduce(MPI.IN_PLACE, by, op=MPI.MAX)]
        MPI.Request.Waitall(reqs)
        assert x[0].item() == rank + 1  # nothing lands before finish()
        fx()
        fy()
    assert torch.equal(x, torch.full((1000,), float(sum(range(1, size + 1)))))
    assert torch.equal(y, torch.arange(7, dtype=torch.int32) + size - 1)
    assert [w.category for w in caught] == [SlowPathWarning], caught
    print(f"RESULT mpi_device ok rank={rank}", flush=True)


if __name__ == "__main__" and "--mpi-job" in sys.argv:
    try:
        _mpi_job()
    except BaseException:  # noqa: BLE001 - one failing rank must end the whole job
        traceback.print_exc()
        sys.stdout.flush()
        from mpi4py import MPI

        MPI.COMM_WORLD.Abort(1)

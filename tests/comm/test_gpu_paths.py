"""The GPU paths' defects found by reading them against the real APIs, each tested on the CPU.

Fake CUDA, CuPy and NCCL (tests/fake_cuda.py) record what the backends call, in order; tensors
that report ``cuda:N`` over CPU memory (tests/fake_device.py) go through the real base-class
checks. What only a GPU settles (that NCCL really runs on the side stream, that WorkNCCL polls
end, that a CUDA-aware MPI reads device memory) is left to scripts/gpu_check.sh.
"""

from __future__ import annotations

import sys
import threading
import time
from typing import Any

import pytest
import tomllib
import torch
import torch.distributed as dist

from gradcomm import CollectiveTimeoutError, ReduceOp
from gradcomm.comm import Launcher, LaunchInfo
from gradcomm.comm.backends import cuda_packages, cupy_nccl, nccl, torch_dist
from gradcomm.comm.backends.mpi import device as mpi_device
from gradcomm.comm.launch.rendezvous import Rendezvous

from tests._support.dist_utils import REPO_ROOT
from tests._support.fake_cuda import Log, install, install_cupy
from tests._support.fake_device import FakeDeviceTensor

CUDA0 = torch.device("cuda", 0)


def _cuda(t: torch.Tensor, index: int = 0) -> FakeDeviceTensor:
    return FakeDeviceTensor(t.clone(), f"cuda:{index}")


def _launch(rank: int = 0, world: int = 2, local_rank: int = 0, local_world: int = 1) -> LaunchInfo:
    return LaunchInfo(rank, world, local_rank, local_world, Launcher.EXPLICIT)


# ============================================================================ 2. cupy-nccl streams
def test_cupy_nccl_runs_on_its_own_stream_ordered_like_process_group_nccl(cupy_comm: Any) -> None:
    comm, fake, _ = cupy_comm
    [side] = fake.side_streams
    t = _cuda(torch.arange(4.0))
    work = comm.all_reduce(t, async_op=True)
    calls = fake.log.calls
    # side waits for current, NCCL gets the side stream (not the current one), the tensor is
    # recorded on the side stream, then the completion event is recorded there.
    assert calls[0] == ("wait_stream", "side0", "current")
    assert calls[1][0] == "allReduce" and calls[1][-1] == side.cuda_stream
    assert side.cuda_stream != fake.current.cuda_stream
    assert calls[2] == ("record_stream", t.data_ptr(), "side0")
    assert calls[3] == ("event.record", fake.events[0].name, "side0")
    assert len(calls) == 4  # nothing waits yet: the caller's stream goes on computing
    work.wait()
    assert fake.log.calls[4] == ("wait_event", "current", fake.events[0].name)
    assert torch.equal(t._data, torch.arange(4.0) * 2)
    assert comm.background_progress


def test_cupy_nccl_all_gather_records_both_buffers_and_wait_polls_the_event(
    cupy_comm: Any,
) -> None:
    comm, fake, _ = cupy_comm
    fake.events_complete = False
    src, out = _cuda(torch.ones(3)), _cuda(torch.zeros(6))
    work = comm.all_gather(out, src, async_op=True)
    recorded = [c[1] for c in fake.log.calls if c[0] == "record_stream"]
    assert recorded == [src.data_ptr(), out.data_ptr()]
    assert not work.is_completed()
    assert ("check_async_error",) in fake.log.calls  # polling also asks NCCL for errors
    threading.Timer(0.05, lambda: setattr(fake.events[0], "done", True)).start()
    work.wait()
    assert fake.log.calls[-1] == ("wait_event", "current", fake.events[0].name)


def test_cupy_nccl_debug_check_gathers_a_fingerprint_on_the_device_first(cupy_comm: Any) -> None:
    comm, fake, _ = cupy_comm
    comm.debug = "detail"
    t = _cuda(torch.arange(4.0))
    comm.all_reduce(t)
    sent = [c[0] for c in fake.log.calls if c[0] in ("allGather", "allReduce")]
    assert sent == ["allGather", "allReduce"]  # the check first, then the collective
    recorded = [c[1] for c in fake.log.calls if c[0] == "record_stream"]
    assert len(recorded) == 3 and recorded[-1] == t.data_ptr()  # fingerprints are device tensors
    assert torch.equal(t._data, torch.arange(4.0) * 2)


def test_cupy_nccl_timeout_aborts_and_the_communicator_stays_unusable(cupy_comm: Any) -> None:
    comm, fake, nccl_mod = cupy_comm
    fake.events_complete = False
    work = comm.all_reduce(_cuda(torch.ones(2)), async_op=True)
    with pytest.raises(CollectiveTimeoutError):
        work.wait(timeout=0.05)
    assert nccl_mod.comms[0].aborted
    with pytest.raises(RuntimeError, match="timed out and NCCL was aborted"):
        comm.all_reduce(_cuda(torch.ones(2)))
    with pytest.raises(RuntimeError, match="timed out and NCCL was aborted"):
        work.wait()  # the Work itself fails too, instead of waiting again


# ============================================================================ 7. AVG, NCCL < 2.10
def test_cupy_nccl_avg_before_nccl_2_10_takes_the_base_class_path(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    fake = install(monkeypatch)
    install_cupy(monkeypatch, fake.log, nccl_version=2905)  # NCCL 2.9.5: no ncclAvg, no bf16
    monkeypatch.setattr(cupy_nccl, "create_store", lambda *a: dist.HashStore())
    with cupy_nccl.CupyNCCLCommunicator(_launch(), timeout=5.0) as comm:
        half = _cuda(torch.tensor([40000.0, 1.0, -3.0], dtype=torch.float16))
        comm.all_reduce(half, ReduceOp.AVG)  # summed in float32: 80000 would be inf in fp16
        assert torch.equal(half._data, torch.tensor([40000.0, 1.0, -3.0], dtype=torch.float16))
        assert ReduceOp.AVG not in comm.native_reduce_ops
        sent = [c for c in fake.log.calls if c[0] == "allReduce"]
        assert [c[3] for c in sent] == [7] and [c[4] for c in sent] == [0]  # float32 SUM
        ints = _cuda(torch.arange(3, dtype=torch.int32))
        with pytest.raises(TypeError, match=r"ReduceOp\.AVG needs a floating-point tensor"):
            comm.all_reduce(ints, ReduceOp.AVG)
        assert len([c for c in fake.log.calls if c[0] == "allReduce"]) == 1  # nothing sent
        with pytest.raises(TypeError, match=r"cannot reduce torch\.bfloat16"):
            comm.all_reduce(_cuda(torch.ones(2, dtype=torch.bfloat16)))


# ============================================================================ 3. nccl waits
class _FakeWork:
    """A WorkNCCL without blocking wait: ``wait()`` returns at once, done after ``polls``."""

    def __init__(self, polls: float) -> None:
        self.polls, self.calls, self.waited_at = polls, 0, None

    def is_completed(self) -> bool:
        self.calls += 1
        return self.calls > self.polls

    def wait(self, timeout: Any = None) -> bool:
        self.waited_at = self.calls
        return True


class _FakeGroup:
    def __init__(self, polls: float) -> None:
        self.polls, self.works, self.aborts, self.shutdowns = polls, [], 0, 0

    def allreduce(self, tensors: list[torch.Tensor], opts: Any) -> _FakeWork:
        self.works.append(_FakeWork(self.polls))
        return self.works[-1]

    def abort(self) -> None:
        self.aborts += 1

    def shutdown(self) -> None:
        self.shutdowns += 1


def _nccl_comm(monkeypatch: pytest.MonkeyPatch, group: _FakeGroup,
               timeout: float) -> nccl.NCCLCommunicator:
    install(monkeypatch)
    monkeypatch.setattr(dist, "is_nccl_available", lambda: True)
    monkeypatch.setattr(torch_dist, "rendezvous",
                        lambda *a, **k: Rendezvous(store=None, bind_address=None, interface=None))
    monkeypatch.setattr(nccl.NCCLCommunicator, "_make_group", lambda self, *a: group)
    real_zeros = torch.zeros  # the barrier's token: CPU memory here (a CPU build has no CUDA)
    monkeypatch.setattr(torch, "zeros", lambda *a, device=None, **k: real_zeros(*a, **k))
    return nccl.NCCLCommunicator(_launch(), timeout=timeout)


def test_nccl_barrier_returns_only_once_the_collective_completed(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    group = _FakeGroup(polls=5)
    comm = _nccl_comm(monkeypatch, group, timeout=10.0)
    comm.barrier()
    [work] = group.works
    assert work.calls == 6 and work.waited_at == 6  # polled until done, then torch's wait()
    comm.close()
    assert group.shutdowns == 1


def test_nccl_wait_times_out_aborts_the_group_and_leaves_the_communicator_unusable(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    group = _FakeGroup(polls=float("inf"))  # a peer that never arrives
    comm = _nccl_comm(monkeypatch, group, timeout=0.2)
    start = time.monotonic()
    with pytest.raises(CollectiveTimeoutError, match=r"did not complete within 0\.2 s"):
        comm.barrier()
    assert 0.2 <= time.monotonic() - start < 5.0
    assert group.aborts == 1 and comm.aborted
    with pytest.raises(RuntimeError, match="NCCL process group was aborted"):
        comm.barrier()
    assert len(group.works) == 1  # no collective was issued on the aborted group
    comm.close()  # succeeds, releases nothing more
    assert group.shutdowns == 0 and group.aborts == 1


# ============================================================================ 4. MPI picks its GPU
@pytest.mark.parametrize(("count", "want"), [(2, 1), (1, 0)])
def test_mpi_with_cuda_selects_the_local_ranks_gpu(
    monkeypatch: pytest.MonkeyPatch, count: int, want: int
) -> None:
    pytest.importorskip("mpi4py")
    from gradcomm.comm.backends.mpi.communicator import MPICommunicator

    fake = install(monkeypatch, device_count=count)
    # The second rank of a host (local_rank 1): cuda:1, or cuda:0 on a one-GPU host; MPI itself
    # has one rank here, which is all the launch check compares.
    second = LaunchInfo(0, 1, 1, 2, Launcher.EXPLICIT)
    with MPICommunicator(second, device="cuda") as comm:
        assert comm.device == torch.device("cuda", want)
        assert fake.devices_set == [torch.device("cuda", want)]


def test_cupy_arrays_are_made_under_the_tensors_device(monkeypatch: pytest.MonkeyPatch) -> None:
    log = Log()
    install_cupy(monkeypatch, log)
    mpi_device.cupy_array(_cuda(torch.ones(3), index=1))
    assert log.calls == [("cupy.Device", 1), ("cupy.asarray", 1)]


# ============================================================================ 6. MPI thread level
def test_mpi_refuses_a_thread_level_below_multiple_on_every_device(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    pytest.importorskip("mpi4py")
    from mpi4py import MPI

    from gradcomm.comm.backends.mpi.communicator import MPICommunicator

    install(monkeypatch)
    for level, name in ((MPI.THREAD_FUNNELED, "funneled"), (MPI.THREAD_SERIALIZED, "serialized")):
        monkeypatch.setattr(MPI, "Query_thread", lambda level=level: level)
        for device in ("cuda", "cpu"):  # the progress thread calls MPI beside the caller
            with pytest.raises(RuntimeError, match=rf"thread level '{name}'.*needs 'multiple'"):
                MPICommunicator(_launch(world=1), device=device)
    monkeypatch.setattr(MPI, "Query_thread", lambda: MPI.THREAD_MULTIPLE)
    with MPICommunicator(_launch(world=1), device="cuda") as comm:
        assert comm.device == CUDA0


# ======================================================================== 5. CuPy per CUDA major
@pytest.mark.parametrize(("cuda", "package"), [("12.8", "cupy-cuda12x"), ("13.0", "cupy-cuda13x"),
                                               ("11.8", "cupy-cuda12x"), ("14.1", "cupy-cuda13x")])
def test_every_cupy_message_names_the_package_of_torchs_cuda(
    monkeypatch: pytest.MonkeyPatch, cuda: str, package: str
) -> None:
    monkeypatch.setattr(torch.version, "cuda", cuda)
    monkeypatch.setitem(sys.modules, "cupy", None)
    assert cuda_packages.cupy_package() == package
    problem = cupy_nccl.cupy_nccl_unavailable()
    assert isinstance(problem, ImportError) and f'pip install "{package}[ctk]"' in str(problem)
    with pytest.raises(ImportError, match=rf'pip install "{package}\[ctk\]"'):
        mpi_device.cupy_array(torch.ones(1))
    major = cuda.split(".")[0]
    assert cuda_packages.nccl_pip() == f"pip install nvidia-nccl-cu{major}"


def test_cupy_message_on_a_cpu_build_names_both_majors(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.version, "cuda", None)
    text = cuda_packages.cupy_pip()
    assert '"cupy-cuda12x[ctk]"' in text and '"cupy-cuda13x[ctk]"' in text
    with pytest.raises(ValueError, match="not a CUDA version"):
        cuda_packages.cuda_major("x.1")


def test_pyproject_has_a_gpu_extra_per_cuda_major() -> None:
    extras = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["project"][
        "optional-dependencies"]
    assert extras["gpu-cuda12"] == ["cupy-cuda12x[ctk]"]
    assert extras["gpu-cuda13"] == ["cupy-cuda13x[ctk]"]

"""GPU backends: nccl, cupy-nccl, and mpi with CUDA buffers.

Tests marked ``gpu`` need CUDA and are skipped with the reason without it; ``scripts/gpu_check.sh``
runs them on a GPU machine. NCCL refuses two ranks on one GPU ("Duplicate GPU detected"), so on a
one-GPU machine nccl runs at world_size 1 (its process group still exercised directly) and
cupy-nccl under ``mpiexec -n 1``; the mpi backend, which has no such limit, runs two ranks that
share the GPU. The other tests run everywhere: the errors and reasons a machine without CUDA or
CuPy gives, device selection, the capability table, and the CUDA-event Work with fake events.

This file is also the script of its ``mpiexec`` runs: ``python tests/comm/test_gpu.py --job NAME``.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import ctypes
import datetime
import importlib.machinery
import os
import re
import sys
import traceback
import types
from typing import Any, ClassVar

import pytest
import torch
import torch.distributed as dist

import gradcomm
from gradcomm import (
    BackendUnavailableError,
    CollectiveTimeoutError,
    ReduceOp,
)
from gradcomm.comm import Launcher, LaunchInfo, available_backends, select_backend
from gradcomm.comm.backends import cuda_packages
from gradcomm.comm.backends.cupy_nccl import CudaEventWork
from gradcomm.comm.backends.nccl import nccl_support, resolve_cuda_device

from tests._support.gpu_jobs import collective_checks, grad_check

HAS_CUDA = torch.cuda.is_available()
N_GPUS = torch.cuda.device_count() if HAS_CUDA else 0
needs_cuda = pytest.mark.skipif(
    not HAS_CUDA, reason="no CUDA device: torch.cuda.is_available() is False"
)
needs_two_gpus = pytest.mark.skipif(
    N_GPUS < 2, reason=f"needs 2 GPUs (NCCL allows one rank per GPU); this machine has {N_GPUS}"
)


def _launch(rank: int = 0, world: int = 1, local_world: int | None = None) -> LaunchInfo:
    lws = world if local_world is None else local_world
    return LaunchInfo(rank, world, rank % lws, lws, Launcher.EXPLICIT)


@pytest.fixture
def no_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)


@pytest.fixture
def no_cupy(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "cupy", None)  # find_spec -> None, import -> ImportError


# ============================================================================ CPU: errors, reasons
def test_init_nccl_without_cuda_raises_clear_error(no_cuda: None) -> None:
    with pytest.raises(BackendUnavailableError, match=r"nccl backend needs a CUDA device: "
                       r"torch.cuda.is_available\(\) is False"):
        gradcomm.init("nccl", rank=0, world_size=1)


def test_init_nccl_without_nccl_in_torch(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(dist, "is_nccl_available", lambda: False)
    with pytest.raises(BackendUnavailableError, match="is_nccl_available"):
        gradcomm.init("nccl", rank=0, world_size=1)


def test_init_cupy_nccl_without_cupy_names_pip_command(no_cupy: None) -> None:
    # The command for this torch's CUDA major (a CPU build names both).
    with pytest.raises(ImportError, match=re.escape(cuda_packages.cupy_pip())):
        gradcomm.init("cupy-nccl", rank=0, world_size=1)


def test_init_cupy_nccl_without_cuda(monkeypatch: pytest.MonkeyPatch, no_cuda: None) -> None:
    fake = types.ModuleType("cupy")
    fake.__spec__ = importlib.machinery.ModuleSpec("cupy", None)
    monkeypatch.setitem(sys.modules, "cupy", fake)
    with pytest.raises(BackendUnavailableError, match="cupy-nccl backend needs a CUDA device"):
        gradcomm.init("cupy_nccl", rank=0, world_size=1)  # "_" spelling is normalised


def test_available_backends_say_why_gpu_backends_are_unavailable(
    no_cuda: None, no_cupy: None
) -> None:
    status = available_backends()
    assert not status["nccl"].available
    assert "torch.cuda.is_available() is False" in status["nccl"].reason
    assert not status["cupy-nccl"].available
    assert cuda_packages.cupy_pip() in status["cupy-nccl"].reason
    assert status["gloo"].available


@pytest.mark.skipif(HAS_CUDA, reason="this machine has CUDA; the no-CUDA answer is tested on CPU")
def test_available_backends_on_this_machine() -> None:
    status = available_backends()
    for name in ("nccl", "cupy-nccl"):
        assert not status[name].available and status[name].reason


def test_auto_selection_picks_nccl_only_when_usable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert select_backend(env={}).name == "gloo"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(dist, "is_nccl_available", lambda: True)
    assert select_backend(env={}).name == "nccl"


# ============================================================================ CPU: device, table
def test_resolve_cuda_device(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert resolve_cuda_device(_launch(1, 2), None, "nccl") == torch.device("cuda", 1)
    assert resolve_cuda_device(_launch(1, 2), "cuda", "nccl") == torch.device("cuda", 1)
    assert resolve_cuda_device(_launch(1, 2), "cuda:0", "nccl") == torch.device("cuda", 0)
    with pytest.raises(ValueError, match="CUDA devices, not cpu"):
        resolve_cuda_device(_launch(), "cpu", "nccl")
    with pytest.raises(ValueError, match="cuda:2 does not exist"):
        resolve_cuda_device(_launch(), "cuda:2", "nccl")
    # Every rank of a host with 3 ranks and 2 GPUs raises the same error, before any rendezvous.
    for rank in range(3):
        with pytest.raises(BackendUnavailableError, match="3 ranks on this host but 2 CUDA"):
            resolve_cuda_device(_launch(rank, 3), None, "cupy-nccl")


def test_nccl_capability_table() -> None:
    cuda = torch.device("cuda", 0)
    for dtype in (torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.int8,
                  torch.uint8, torch.int32, torch.int64):
        s = nccl_support(dtype, cuda)
        assert s.level.value == "native" and s.transfer_dtype == dtype and not s.is_slow
    assert not nccl_support(torch.bool, cuda).is_supported
    assert not nccl_support(torch.complex64, cuda).is_supported
    cpu = nccl_support(torch.float32, torch.device("cpu"))
    assert not cpu.is_supported and "CUDA tensors" in cpu.reason


# ============================================================================ CPU: CudaEventWork
class FakeEvent:
    """``query()`` is True from the ``ready_after``-th call on (never when None)."""

    def __init__(self, ready_after: int | None) -> None:
        self.ready_after = ready_after
        self.queries = 0

    def query(self) -> bool:
        self.queries += 1
        return self.ready_after is not None and self.queries >= self.ready_after


def test_event_work_completes_and_runs_callbacks() -> None:
    event, done = FakeEvent(ready_after=3), []
    work = CudaEventWork(event, "all_reduce #0", 5.0, lambda: None, lambda: done.append("abort"))
    work.add_callback(lambda: done.append("callback"))
    assert not work.is_completed()
    work.wait()
    assert work.is_completed() and done == ["callback"]


def test_event_work_timeout_aborts_once_and_raises() -> None:
    aborted: list[int] = []
    work = CudaEventWork(FakeEvent(None), "all_reduce #7", 0.05, lambda: None,
                         lambda: aborted.append(1))
    with pytest.raises(CollectiveTimeoutError, match="all_reduce #7 did not complete"):
        work.wait()
    assert aborted == [1]


def test_event_work_reports_asynchronous_nccl_errors() -> None:
    def check() -> None:
        raise RuntimeError("NCCL_ERROR_REMOTE_ERROR: a peer went away")

    work = CudaEventWork(FakeEvent(None), "broadcast #1", 5.0, check, lambda: None)
    with pytest.raises(RuntimeError, match="peer went away"):
        work.wait()


# ============================================================================ CPU: fake NCCL
def test_nccl_communicator_set_up_with_a_fake_process_group(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Device choice, set_device before the group, and the ProcessGroupNCCL constructor's use."""
    from gradcomm.comm.backends.nccl import NCCLCommunicator

    made: list[Any] = []

    class FakePG:
        class Options:
            def __init__(self, is_high_priority_stream: bool = False) -> None:
                self.is_high_priority_stream = is_high_priority_stream
                self._timeout: Any = None

        def __init__(self, store: Any, rank: int, size: int, opts: Options) -> None:
            made.append((type(store).__name__, rank, size, opts._timeout,
                         opts.is_high_priority_stream))

        def shutdown(self) -> None:
            made.append("shutdown")

    devices: list[Any] = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    monkeypatch.setattr(torch.cuda, "set_device", devices.append)
    monkeypatch.setattr(dist, "is_nccl_available", lambda: True)
    monkeypatch.setattr(dist, "ProcessGroupNCCL", FakePG, raising=False)
    comm = NCCLCommunicator(LaunchInfo(0, 1, 2, 4, Launcher.EXPLICIT), timeout=12.0)
    assert comm.device == torch.device("cuda", 2) and devices == [torch.device("cuda", 2)]
    assert comm.process_group is None  # world_size 1: no group, no collective
    assert ReduceOp.AVG in comm.native_reduce_ops
    for dtype in (torch.float16, torch.bfloat16):
        assert comm.supports(dtype).level.value == "native"
    group = comm._make_group(dist.HashStore(), _launch(), 12.0)
    assert isinstance(group, FakePG)
    assert made == [("HashStore", 0, 1, datetime.timedelta(seconds=12), False)]
    comm._group = group
    with pytest.raises(ValueError, match="on meta, but this nccl communicator works on cuda:2"):
        comm._checks.check(torch.empty(2, device="meta"), "x")
    # no CUDA tensors here: the verdict on a (dtype, device) pair, as the check caches it
    other_gpu = types.SimpleNamespace(dtype=torch.float32, device=torch.device("cuda", 3))
    error, reason, _ = comm._checks.classify(other_gpu)  # type: ignore[arg-type]
    assert error is ValueError
    assert reason == "tensor is on cuda:3, but this communicator's GPU is cuda:2"
    comm.close()
    assert made[-1] == "shutdown"


# ============================================================================ CPU: fake CuPy
class FakeNcclComm:
    """Stands in for ``cupy.cuda.nccl.NcclCommunicator``: records calls, acts as one rank."""

    def __init__(self, ndev: int, uid: bytes, rank: int) -> None:
        self.log = FakeCupy.log
        self.log.append(("init", ndev, uid, rank))

    def allReduce(self, *args: int) -> None:
        self.log.append(("allReduce", *args))

    def broadcast(self, *args: int) -> None:
        self.log.append(("broadcast", *args))

    def allGather(self, send: int, recv: int, count: int, dtype: int, stream: int) -> None:
        self.log.append(("allGather", send, recv, count, dtype, stream))
        ctypes.memmove(recv, send, count)  # one rank: the output is the input

    def check_async_error(self) -> None:
        return None

    def destroy(self) -> None:
        self.log.append(("destroy",))

    def abort(self) -> None:
        self.log.append(("abort",))


class FakeCupy:
    """``cupy``, ``cupy.cuda`` and ``cupy.cuda.nccl`` modules, plus torch.cuda pieces, on CPU."""

    log: ClassVar[list[tuple[Any, ...]]] = []

    def __init__(self, monkeypatch: pytest.MonkeyPatch, nccl_version: int, gpus: int = 1) -> None:
        FakeCupy.log = []
        self.ready = True
        ids = iter(bytes([i]) * 128 for i in range(100))
        nccl = types.ModuleType("cupy.cuda.nccl")
        for name, value in dict(
            available=True, get_version=lambda: nccl_version, get_unique_id=lambda: next(ids),
            NcclCommunicator=FakeNcclComm, NCCL_INT8=0, NCCL_UINT8=1, NCCL_INT32=2,
            NCCL_INT64=4, NCCL_FLOAT16=6, NCCL_FLOAT32=7, NCCL_FLOAT64=8,
            NCCL_SUM=0, NCCL_PROD=1, NCCL_MAX=2, NCCL_MIN=3,
        ).items():
            setattr(nccl, name, value)
        cuda = types.ModuleType("cupy.cuda")
        cuda.nccl = nccl  # type: ignore[attr-defined]
        cuda.Device = lambda index: contextlib.nullcontext()  # type: ignore[attr-defined]
        cupy = types.ModuleType("cupy")
        cupy.__spec__ = importlib.machinery.ModuleSpec("cupy", None)
        cupy.cuda = cuda  # type: ignore[attr-defined]
        for name, mod in (("cupy", cupy), ("cupy.cuda", cuda), ("cupy.cuda.nccl", nccl)):
            monkeypatch.setitem(sys.modules, name, mod)
        log, outer = FakeCupy.log, self

        class Stream:
            def __init__(self, handle: int = 1234) -> None:
                self.cuda_stream = handle

            def synchronize(self) -> None:
                log.append(("synchronize", self.cuda_stream))

            def wait_stream(self, other: Stream) -> None:
                log.append(("wait_stream", self.cuda_stream, other.cuda_stream))

            def wait_event(self, event: Event) -> None:
                log.append(("wait_event", self.cuda_stream))

        class Event:
            def record(self, stream: Stream) -> None:
                log.append(("record", stream.cuda_stream))

            def query(self) -> bool:
                return outer.ready

        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: gpus)
        monkeypatch.setattr(torch.cuda, "set_device", lambda dev: None)
        monkeypatch.setattr(torch.cuda, "current_stream", lambda dev=None: Stream())
        monkeypatch.setattr(torch.cuda, "Event", Event)
        monkeypatch.setattr(torch.cuda, "Stream", lambda dev=None: Stream(5678))  # the side one
        monkeypatch.setattr(torch.cuda, "device", lambda dev: contextlib.nullcontext())
        monkeypatch.setattr(torch.Tensor, "record_stream",
                            lambda t, stream: log.append(("record_stream", stream.cuda_stream)))


def test_cupy_nccl_calls_nccl_with_pointers_counts_and_its_side_stream(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    fake = FakeCupy(monkeypatch, nccl_version=22105)
    from gradcomm.comm.backends.cupy_nccl import CupyNCCLCommunicator

    comm = CupyNCCLCommunicator(_launch(), timeout=5.0)
    assert comm.device == torch.device("cuda", 0) and fake.log == [("init", 1, b"\0" * 128, 0)]
    # CPU tensors stand in for CUDA ones: the private methods take pointers only.
    t = torch.arange(6, dtype=torch.bfloat16)
    work = comm._all_reduce(t, ReduceOp.AVG, "all_reduce #0")
    work.wait()
    assert isinstance(work, CudaEventWork) and work.is_completed()
    # bf16 = 9, ncclAvg = 4, on the side stream (5678) after it waited for the current (1234)
    assert fake.log[1:] == [("wait_stream", 5678, 1234),
                            ("allReduce", t.data_ptr(), t.data_ptr(), 6, 9, 4, 5678),
                            ("record_stream", 5678), ("record", 5678), ("wait_event", 1234)]
    del fake.log[1:]
    b = torch.zeros(5, dtype=torch.float64)
    comm._broadcast(b, 0, "broadcast #1").wait()
    assert fake.log[2] == ("broadcast", b.data_ptr(), b.data_ptr(), 40, 1, 0, 5678)  # bytes
    del fake.log[1:]
    inp, out = torch.arange(3, dtype=torch.int32), torch.zeros(3, dtype=torch.int32)
    comm._all_gather(out, inp, "all_gather #2").wait()
    assert out.tolist() == [0, 1, 2] and fake.log[2][3:6] == (12, 1, 5678)
    assert not comm.supports(torch.bool).is_supported
    assert not comm.supports(torch.float32, "cpu").is_supported
    comm.close()
    assert fake.log[-2:] == [("synchronize", 5678), ("destroy",)]


def test_cupy_nccl_old_nccl_has_no_bf16_and_emulates_avg(monkeypatch: pytest.MonkeyPatch) -> None:
    fake = FakeCupy(monkeypatch, nccl_version=20903)
    from gradcomm.comm.backends.cupy_nccl import CupyNCCLCommunicator

    comm = CupyNCCLCommunicator(_launch(), timeout=5.0)
    assert not comm.supports(torch.bfloat16).is_supported
    # No ncclAvg: the base class emulates AVG (values: tests/comm/test_gpu_paths.py).
    assert ReduceOp.AVG not in comm.native_reduce_ops and fake.log[0][0] == "init"


def test_cupy_nccl_timeout_aborts_and_disables(monkeypatch: pytest.MonkeyPatch) -> None:
    fake = FakeCupy(monkeypatch, nccl_version=22105)
    from gradcomm.comm.backends.cupy_nccl import CupyNCCLCommunicator

    comm = CupyNCCLCommunicator(_launch(), timeout=0.05)
    fake.ready = False
    with pytest.raises(CollectiveTimeoutError):
        comm._all_reduce(torch.ones(2), ReduceOp.SUM, "stuck").wait()
    assert fake.log[-1] == ("abort",)
    with pytest.raises(RuntimeError, match="aborted after a timed-out collective"):
        comm._all_reduce(torch.ones(2), ReduceOp.SUM, "after")
    comm.close()  # no destroy after an abort
    assert ("destroy",) not in fake.log


def _cupy_nccl_store_rank(rank: int) -> gradcomm.Communicator:
    from gradcomm.comm.backends.cupy_nccl import CupyNCCLCommunicator

    return CupyNCCLCommunicator(_launch(rank, 2), timeout=30.0)  # kept alive, like a real rank


def test_cupy_nccl_unique_id_travels_over_the_store(monkeypatch: pytest.MonkeyPatch) -> None:
    from gradcomm.comm.backends import cupy_nccl

    from tests._support.dist_utils import free_port

    fake = FakeCupy(monkeypatch, nccl_version=22105, gpus=2)
    port = free_port()

    def store(launch: LaunchInfo, timeout: float | None, backend: str) -> dist.Store:
        # Both "ranks" are threads of one process: one fixed prefix instead of create_store's
        # per-process counter (which matches across real processes, not across threads).
        tcp = dist.TCPStore("127.0.0.1", port, 2, launch.rank == 0)
        return dist.PrefixStore(backend, tcp)

    monkeypatch.setattr(cupy_nccl, "create_store", store)
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        comms = [f.result(timeout=60) for f in [pool.submit(_cupy_nccl_store_rank, r)
                                                 for r in range(2)]]
    for comm in comms:
        comm.close()
    inits = sorted(e for e in fake.log if e[0] == "init")
    assert inits == [("init", 2, b"\0" * 128, 0), ("init", 2, b"\0" * 128, 1)]  # rank 0's id


# ============================================================================ GPU: shared checks
# In tests/gpu_jobs.py, which scripts/gpu_check.sh runs without pytest.
_grad_check = grad_check
_collective_checks = collective_checks


# ============================================================================ GPU: nccl
@pytest.mark.gpu
@needs_cuda
def test_nccl_world_size_1_and_its_process_group() -> None:
    with gradcomm.init("nccl", rank=0, world_size=1, timeout=60) as comm:
        assert comm.device == torch.device("cuda", 0)
        assert torch.cuda.current_device() == 0
        _collective_checks(comm)
        _grad_check(comm)
        # world_size 1 issues no collective; drive a 1-rank ProcessGroupNCCL directly.
        group = comm._make_group(dist.HashStore(), _launch(), 60.0)  # type: ignore[attr-defined]
        for dtype in (torch.float32, torch.float16, torch.bfloat16):
            t = torch.arange(8, dtype=dtype, device="cuda:0")
            opts = dist.AllreduceOptions()
            opts.reduceOp = dist.ReduceOp.AVG  # type: ignore[assignment]
            group.allreduce([t], opts).wait()
            assert torch.equal(t, torch.arange(8, dtype=dtype, device="cuda:0"))
        group.shutdown()


def _nccl_rank(rank: int, world_size: int) -> float:
    with gradcomm.init("nccl", timeout=60) as comm:
        assert comm.device == torch.device("cuda", rank)
        _collective_checks(comm)
        return _grad_check(comm)


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.gpu
@needs_cuda
@needs_two_gpus
def test_nccl_two_processes() -> None:
    from tests._support.dist_utils import run_processes

    errors = run_processes(_nccl_rank, 2, timeout=180)  # each rank asserts its values
    assert len(errors) == 2


# ============================================================================ GPU: cupy-nccl
@pytest.mark.gpu
@needs_cuda
def test_cupy_nccl_world_size_1_drives_nccl() -> None:
    cupy = pytest.importorskip("cupy", reason="cupy is not installed")
    from gradcomm.comm.backends.cupy_nccl import as_tensor

    with gradcomm.init("cupy-nccl", rank=0, world_size=1, timeout=60) as comm:
        _collective_checks(comm)
        # world_size 1 issues no collective through the public methods: call NCCL directly.
        for dtype in (torch.float32, torch.float16, torch.bfloat16, torch.int64):
            t = torch.arange(16, device=comm.device).to(dtype)
            op = ReduceOp.AVG if dtype.is_floating_point else ReduceOp.SUM
            work = comm._all_reduce(t, op, "direct")
            assert isinstance(work, CudaEventWork)
            work.wait()
            assert work.is_completed()
            assert torch.equal(t, torch.arange(16, device=comm.device).to(dtype))
        x = cupy.arange(5, dtype=cupy.float32)
        view = as_tensor(x)
        comm._all_reduce(view, ReduceOp.SUM, "cupy").wait()
        view.mul_(2)  # the view is the array's memory
        assert cupy.asnumpy(x).tolist() == [0.0, 2.0, 4.0, 6.0, 8.0]


@pytest.mark.slow
@pytest.mark.mpi
@pytest.mark.gpu
@needs_cuda
def test_cupy_nccl_under_mpiexec_without_master_addr() -> None:
    pytest.importorskip("cupy", reason="cupy is not installed")
    from tests._support.dist_utils import require_mpi, run_mpi

    require_mpi()
    n = min(2, N_GPUS)  # one rank per GPU (NCCL's rule)
    out = run_mpi(__file__, n, ["--job", "cupy-nccl"], timeout=180).stdout
    for r in range(n):
        assert f"RESULT cupy-nccl ok rank={r}" in out, out


# ============================================================================ GPU: mpi + CUDA
@pytest.mark.slow
@pytest.mark.mpi
@pytest.mark.gpu
@needs_cuda
def test_mpi_with_cuda_buffers_two_ranks_sharing_a_gpu() -> None:
    from tests._support.dist_utils import require_mpi, run_mpi

    require_mpi()
    out = run_mpi(__file__, 2, ["--job", "mpi-cuda"], timeout=180).stdout
    for r in range(2):
        assert f"RESULT mpi-cuda ok rank={r}" in out, out


# ============================================================================ mpiexec jobs
def _job(name: str) -> None:
    if name == "cupy-nccl":
        assert "MASTER_ADDR" not in os.environ  # the unique id must travel over MPI
        comm = gradcomm.init("cupy-nccl", timeout=60)
    elif name == "mpi-cuda":
        comm = gradcomm.init("mpi", device="cuda:0", timeout=60)  # both ranks share GPU 0
    else:
        raise SystemExit(f"unknown job {name!r}")
    with comm:
        _collective_checks(comm)
        worst = _grad_check(comm)
    print(f"RESULT {name} ok rank={comm.rank} world={comm.world_size} grad_rel_err={worst:.2e}",
          flush=True)


if __name__ == "__main__" and "--job" in sys.argv:
    try:
        _job(sys.argv[sys.argv.index("--job") + 1])
    except BaseException:  # noqa: BLE001 - one failing rank must end the whole job
        traceback.print_exc()
        sys.stdout.flush()
        from mpi4py import MPI

        MPI.COMM_WORLD.Abort(1)

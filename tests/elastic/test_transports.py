"""What fault tolerance needs of the transports: a communicator built over a given store, and
``abort()`` from another thread ending a wait at once. gloo runs for real (two ranks as threads
of this process); nccl and cupy-nccl run on the fake CUDA runtime and NCCL of
tests/_support/fake_cuda.py, which record what they are called with. The backends the elastic layer
accepts, and its refusal of MPI, are checked here too."""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest
import torch
import torch.distributed as dist

from gradcomm.comm import Communicator, Launcher, LaunchInfo
from gradcomm.comm.backends import cupy_nccl, nccl, torch_dist
from gradcomm.comm.backends.gloo import GlooCommunicator
from gradcomm.comm.backends.threads import ThreadGroup
from gradcomm.elastic._transports import MPI_REFUSED, factory_for

from tests._support.fake_cuda import install, install_cupy
from tests._support.fake_device import FakeDeviceTensor


def _launch(rank: int = 0, world: int = 2, local_world: int = 2,
            store: dist.Store | None = None) -> LaunchInfo:
    return LaunchInfo(rank, world, rank % local_world, local_world, Launcher.EXPLICIT,
                      store=store)


def _gloo_pair(timeout: float) -> list[GlooCommunicator]:
    """Two gloo ranks in this process over one HashStore (``LaunchInfo.store``: no
    rendezvous)."""
    store = dist.PrefixStore("pair", dist.HashStore())
    comms: list[Any] = [None, None]

    def make(rank: int) -> None:
        comms[rank] = GlooCommunicator(_launch(rank, store=store), timeout=timeout)

    threads = [threading.Thread(target=make, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    return comms


def test_gloo_over_a_given_store_reduces_and_abort_ends_a_wait_at_once() -> None:
    comms = _gloo_pair(timeout=30.0)
    out: list[Any] = [None, None]

    def reduce(rank: int) -> None:
        t = torch.full((4,), float(rank + 1))
        comms[rank].all_reduce(t)
        out[rank] = t

    threads = [threading.Thread(target=reduce, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert all(torch.equal(t, torch.full((4,), 3.0)) for t in out)
    # Rank 1 never joins this one: without abort() rank 0 would wait the full 30 s.
    threading.Timer(0.2, comms[0].abort).start()
    start = time.monotonic()
    with pytest.raises(RuntimeError, match=r"all_reduce #1 .* failed: the communicator was "
                                           "aborted"):
        comms[0].all_reduce(torch.ones(3))
    assert time.monotonic() - start < 2.0
    with pytest.raises(RuntimeError, match="gloo communicator was aborted"):
        comms[0].broadcast(torch.ones(3))
    comms[0].abort()  # idempotent
    closing = threading.Thread(target=comms[0].close)  # may wait for the stuck all_reduce
    closing.start()
    comms[1].close()  # its end of the pair goes: rank 0's transport is released too
    closing.join(30)
    assert not closing.is_alive()


def test_a_wait_that_ends_sooner_is_not_cut_and_a_timeout_still_raises() -> None:
    comms = _gloo_pair(timeout=0.5)
    with pytest.raises(RuntimeError, match=r"did not complete within 0\.5 s"):
        comms[0].all_reduce(torch.ones(3))  # waited in slices of 0.1 s, up to the timeout
    for c in comms:
        threading.Thread(target=c.close, daemon=True).start()


def test_a_backend_without_abort_says_so() -> None:
    comm = ThreadGroup(1).communicator(0)
    with pytest.raises(NotImplementedError, match="the threads backend cannot abort"):
        comm.abort()


class _Group:
    """A ProcessGroupNCCL stand-in: collectives that never complete, an abort counter."""

    def __init__(self) -> None:
        self.aborts = 0

    def allreduce(self, tensors: list[torch.Tensor], opts: Any) -> Any:
        class Pending:
            def is_completed(self) -> bool:
                return False

        return Pending()

    def abort(self) -> None:
        self.aborts += 1


def test_nccl_is_built_over_the_given_store_and_abort_aborts_the_group(
        monkeypatch: pytest.MonkeyPatch) -> None:
    install(monkeypatch)
    monkeypatch.setattr(dist, "is_nccl_available", lambda: True)
    monkeypatch.setattr(torch_dist, "rendezvous", lambda *a, **k: pytest.fail("rendezvous"))
    given = dist.HashStore()
    group = _Group()
    seen: list[Any] = []
    monkeypatch.setattr(nccl.NCCLCommunicator, "_make_group",
                        lambda self, store, launch, timeout: seen.append(store) or group)
    comm = nccl.NCCLCommunicator(_launch(local_world=1, store=given), timeout=30.0)
    assert seen == [given]
    threading.Timer(0.2, comm.abort).start()
    start = time.monotonic()
    with pytest.raises(RuntimeError, match="failed: the communicator was aborted"):
        comm.all_reduce(FakeDeviceTensor(torch.ones(2), "cuda:0"))
    assert time.monotonic() - start < 2.0
    assert group.aborts == 1 and comm.aborted
    with pytest.raises(RuntimeError, match="aborted"):
        comm.all_reduce(FakeDeviceTensor(torch.ones(2), "cuda:0"))


def test_cupy_nccl_takes_its_unique_id_from_the_given_store_and_abort_ends_a_wait(
        monkeypatch: pytest.MonkeyPatch) -> None:
    fake = install(monkeypatch)
    nccl_mod = install_cupy(monkeypatch, fake.log)
    monkeypatch.setattr(cupy_nccl, "create_store", lambda *a: pytest.fail("create_store"))
    given = dist.HashStore()
    comm = cupy_nccl.CupyNCCLCommunicator(_launch(local_world=1, store=given), timeout=30.0)
    assert given.check(["nccl_unique_id"])  # rank 0 put it there
    fake.events_complete = False  # a collective that never completes
    work = comm.all_reduce(FakeDeviceTensor(torch.ones(2), "cuda:0"), async_op=True)
    threading.Timer(0.2, comm.abort).start()
    start = time.monotonic()
    with pytest.raises(RuntimeError, match="cupy-nccl communicator was aborted"):
        work.wait()
    assert time.monotonic() - start < 2.0
    assert nccl_mod.comms[0].aborted
    with pytest.raises(RuntimeError, match="cupy-nccl communicator was aborted"):
        comm.all_reduce(FakeDeviceTensor(torch.ones(2), "cuda:0"))


def test_the_elastic_layer_takes_gloo_nccl_cupy_nccl_or_a_factory_and_refuses_mpi() -> None:
    assert [factory_for(b)[0] for b in ("gloo", "nccl", "CUPY_NCCL")] == [
        "gloo", "nccl", "cupy-nccl"]

    def mine(launch: LaunchInfo, timeout: float, device: torch.device | None) -> Communicator:
        raise AssertionError("not called here")

    assert factory_for(mine) == ("mine", mine)
    with pytest.raises(ValueError) as info:
        factory_for("mpi")
    assert str(info.value) == MPI_REFUSED == (
        "fault tolerance needs a group that can be re-formed at run time, which MPI's cannot (a "
        "dead rank ends the job); use gloo, nccl or cupy-nccl, workers started alone (by "
        "hand, srun), not by mpirun")
    assert len(MPI_REFUSED) <= 200
    with pytest.raises(ValueError, match="unknown gradcomm backend 'glo'"):
        factory_for("glo")
    with pytest.raises(TypeError, match="backend must be a name, a communicator factory or "
                                        "None, got int"):
        factory_for(3)  # type: ignore[arg-type]

"""The GPU paths of reduce_scatter, all_to_all and the rooted collectives, run on the CPU.

Fake CUDA, CuPy and NCCL (tests/fake_cuda.py) record what the cupy-nccl backend calls; a
fake-device communicator (tests/fake_device.py) over the thread backend runs the base class's
checks and copies on tensors that are not on the CPU, as a CUDA communicator does.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist

from gradcomm import ReduceOp
from gradcomm.comm import Launcher, LaunchInfo
from gradcomm.comm.backends import cupy_nccl
from gradcomm.comm.backends.threads import ThreadGroup

from tests._support.fake_cuda import install, install_cupy
from tests._support.fake_device import (
    FakeDeviceCommunicator,
    FakeDeviceTensor,
    fake_device,
    to_cpu,
    to_fake,
)


def _cuda(t: torch.Tensor) -> FakeDeviceTensor:
    return FakeDeviceTensor(t.clone(), "cuda:0")


def test_cupy_nccl_reduce_scatter_runs_on_the_side_stream_and_records_both_buffers(
    cupy_comm: Any,
) -> None:
    comm, fake, _ = cupy_comm
    [side] = fake.side_streams
    src, out = _cuda(torch.arange(6.0)), _cuda(torch.zeros(3))
    work = comm.reduce_scatter(out, src, async_op=True)
    calls = fake.log.calls
    assert calls[0] == ("wait_stream", "side0", "current")
    assert calls[1] == ("reduceScatter", src.data_ptr(), out.data_ptr(), 3, 7, 0,
                        side.cuda_stream)
    assert [c[1] for c in calls if c[0] == "record_stream"] == [src.data_ptr(), out.data_ptr()]
    work.wait()
    assert torch.equal(out._data, torch.arange(3.0) * 2)  # both fake peers hold rank 0's data


def test_cupy_nccl_reduce_scatter_avg_before_nccl_2_10_sums_16_bit_in_float32(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    fake = install(monkeypatch)
    install_cupy(monkeypatch, fake.log, nccl_version=2905)  # no ncclAvg
    monkeypatch.setattr(cupy_nccl, "create_store", lambda *a: dist.HashStore())
    launch = LaunchInfo(0, 2, 0, 1, Launcher.EXPLICIT)
    with cupy_nccl.CupyNCCLCommunicator(launch, timeout=5.0) as comm:
        src = _cuda(torch.tensor([40000.0, 1.0, -3.0, 5.0], dtype=torch.float16))
        out = _cuda(torch.zeros(2, dtype=torch.float16))
        comm.reduce_scatter(out, src, ReduceOp.AVG)  # 80000 would be inf in float16
        assert torch.equal(out._data, torch.tensor([40000.0, 1.0], dtype=torch.float16))
        [call] = [c for c in fake.log.calls if c[0] == "reduceScatter"]
        assert call[4:6] == (7, 0)  # float32 SUM


def _on_fake_device(comm: Any) -> list[float]:
    with fake_device():
        dev = FakeDeviceCommunicator(comm)
        with pytest.raises(ValueError, match="tensor is on cpu"):
            dev.reduce_scatter(to_fake(torch.zeros(2)), torch.zeros(2 * comm.world_size))
        src = to_fake(torch.arange(4.0 * comm.world_size).reshape(-1, 2) + comm.rank)
        out = to_fake(torch.zeros(2, 2)).t()  # non-contiguous: copied back
        dev.reduce_scatter(out, src, "avg")
        return to_cpu(out).tolist()


def test_reduce_scatter_on_a_device_communicator_takes_the_base_class_path() -> None:
    got = ThreadGroup(2).run(_on_fake_device)
    # rows r*2..r*2+1 of arange(8).reshape(4, 2), averaged over ranks (+0 and +1): + 0.5
    assert got == [[[0.5, 1.5], [2.5, 3.5]], [[4.5, 5.5], [6.5, 7.5]]]


def test_cupy_nccl_all_to_all_is_one_group_of_sends_and_receives(cupy_comm: Any) -> None:
    comm, fake, _ = cupy_comm
    [side] = fake.side_streams
    src = _cuda(torch.arange(6.0).reshape(3, 2))
    out = _cuda(torch.zeros(4, 2))
    comm.all_to_all(out, src, [1, 3], [3, 0])
    calls = [c for c in fake.log.calls if c[0] in ("groupStart", "groupEnd", "send", "recv")]
    s = side.cuda_stream
    # rank 0 sends its 3 rows to itself and none to rank 1; receives 1 row from 0, 3 from 1
    assert calls == [("groupStart",), ("send", src.data_ptr(), 24, 1, 0, s),
                     ("recv", out.data_ptr(), 8, 1, 0, s),
                     ("recv", out.data_ptr() + 8, 24, 1, 1, s), ("groupEnd",)]


def test_cupy_nccl_gather_and_scatter_are_groups_of_sends_and_receives(cupy_comm: Any) -> None:
    comm, fake, _ = cupy_comm
    s = fake.side_streams[0].cuda_stream
    src, out = _cuda(torch.ones(3)), _cuda(torch.zeros(6))
    comm.gather(out, src, 0)  # rank 0 is the root: sends to itself, receives from both
    comm.gather(None, src, 1)  # not the root: one send to rank 1
    comm.scatter(src, out, 0)
    p2p = [c[:5] for c in fake.log.calls if c[0] in ("send", "recv")]
    o, i = out.data_ptr(), src.data_ptr()
    assert p2p == [("send", i, 12, 1, 0), ("recv", o, 12, 1, 0), ("recv", o + 12, 12, 1, 1),
                   ("send", i, 12, 1, 1),
                   ("send", o, 12, 1, 0), ("recv", i, 12, 1, 0), ("send", o + 12, 12, 1, 1)]
    assert all(c[5] == s for c in fake.log.calls if c[0] in ("send", "recv"))
    comm.reduce(src, 1, ReduceOp.MAX)
    [red] = [c for c in fake.log.calls if c[0] == "reduce"]
    assert red == ("reduce", i, 3, 7, 2, 1, s)


def _rooted_on_fake_device(comm: Any) -> list[Any]:
    w, r = comm.world_size, comm.rank
    with fake_device():
        dev = FakeDeviceCommunicator(comm)
        t = to_fake(torch.full((2,), float(r + 1), dtype=torch.float16))
        dev.reduce(t, 0, "avg")
        out = to_fake(torch.zeros(w, 2)) if r == 1 else None
        dev.gather(out, to_fake(torch.full((2,), float(r))), 1)
        got = to_fake(torch.zeros(2))
        dev.scatter(got, to_fake(torch.arange(2.0 * w)) if r == 0 else None, 0)
        uneven = to_fake(torch.zeros(3))  # rank 0 has 1 row, rank 1 has 2
        dev.all_gather(uneven, to_fake(torch.full((r + 1,), float(r + 5))), [1, 2])
        emulated = dev.supports(torch.float32, collective="all_gather_v").level
        obj = dev.all_gather_object({"r": r})
        return [to_cpu(t).tolist() if r == 0 else None,
                None if out is None else to_cpu(out).tolist(), to_cpu(got).tolist(),
                to_cpu(uneven).tolist(), emulated.value, obj]


def test_rooted_uneven_and_object_collectives_on_a_device_communicator() -> None:
    r0, r1 = ThreadGroup(2).run(_rooted_on_fake_device)
    assert r0[0] == [1.5, 1.5] and r1[1] == [[0.0, 0.0], [1.0, 1.0]]
    assert r0[2] == [0.0, 1.0] and r1[2] == [2.0, 3.0]
    assert r0[3] == r1[3] == [5.0, 6.0, 6.0]
    assert r0[4] == "emulated-slow"  # the base class pads: said so by supports()
    assert r0[5] == r1[5] == [{"r": 0}, {"r": 1}]


class _DoneWork:
    def is_completed(self) -> bool:
        return True

    def wait(self, timeout: Any = None) -> bool:
        return True


class _RecordingGroup:
    """A ProcessGroupNCCL stand-in that records which of its methods each collective calls."""

    def __init__(self) -> None:
        self.calls: list[tuple[Any, ...]] = []

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)

        def call(*args: Any) -> _DoneWork:
            self.calls.append((name, *args))
            return _DoneWork()

        return call


def test_nccl_takes_the_process_groups_own_collectives(monkeypatch: pytest.MonkeyPatch) -> None:
    from gradcomm.comm.backends import nccl, torch_dist
    from gradcomm.comm.launch.rendezvous import Rendezvous

    install(monkeypatch)
    monkeypatch.setattr(dist, "is_nccl_available", lambda: True)
    monkeypatch.setattr(torch_dist, "rendezvous",
                        lambda *a, **k: Rendezvous(store=None, bind_address=None, interface=None))
    group = _RecordingGroup()
    monkeypatch.setattr(nccl.NCCLCommunicator, "_make_group", lambda self, *a: group)
    comm = nccl.NCCLCommunicator(LaunchInfo(0, 2, 0, 1, Launcher.EXPLICIT), timeout=5.0)
    x, big = _cuda(torch.ones(3)), _cuda(torch.ones(6))
    comm.reduce_scatter(x, big, "avg")  # ncclAvg: native, one call
    comm.all_to_all(big, _cuda(torch.ones(6)), [1, 5], [4, 2])
    comm.reduce(x, 1, "max")
    comm.gather(big, x, 0)
    comm.scatter(x, None, 1)
    names = [c[0] for c in group.calls]
    assert names == ["reduce_scatter", "alltoall_base", "reduce", "gather", "scatter"]
    rs = group.calls[0]
    assert rs[1][0].data_ptr() == x.data_ptr() and len(rs[2][0]) == 2
    assert rs[3].reduceOp == dist.ReduceOp.AVG
    assert group.calls[1][3:5] == ([4, 20], [16, 8])  # split sizes as bytes (float32)
    assert group.calls[4][2] == [] and group.calls[4][3].rootRank == 1  # not the root
    comm.close()

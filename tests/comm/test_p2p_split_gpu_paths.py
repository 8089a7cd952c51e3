"""The GPU paths of send/recv, batch_isend_irecv and split, run on the CPU.

Fake CUDA, CuPy and NCCL (tests/fake_cuda.py) record what the cupy-nccl backend calls; the
NCCL process-group backend's batch order is checked on its pure ordering function.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from gradcomm.comm import Launcher, LaunchInfo, P2POp
from gradcomm.comm.backends import cupy_nccl
from gradcomm.comm.backends.nccl import post_in_pair_order
from gradcomm.comm.communicator import P2PKind, Transfer
from gradcomm.comm.work import CompletedWork, Description, Work

from tests._support.fake_cuda import install, install_cupy


def _cuda(t: torch.Tensor) -> Any:
    from tests._support.fake_device import FakeDeviceTensor

    return FakeDeviceTensor(t.clone(), "cuda:0")


def test_cupy_nccl_send_and_recv_move_bytes_on_the_side_stream(cupy_comm: Any) -> None:
    comm, fake, _ = cupy_comm
    [side] = fake.side_streams
    t = _cuda(torch.arange(6.0))
    comm.send(t, 1, tag=3)
    calls = fake.log.calls
    assert calls[0] == ("wait_stream", "side0", "current")
    assert calls[1] == ("send", t.data_ptr(), 24, 1, 1, side.cuda_stream)  # 24 uint8 to rank 1
    assert ("record_stream", t.data_ptr(), "side0") in calls
    with pytest.raises(ValueError, match="this rank"):
        comm.recv(t, 0)


def test_cupy_nccl_batch_is_one_group_with_events_recorded_after_it(cupy_comm: Any) -> None:
    comm, fake, _ = cupy_comm
    a, b = _cuda(torch.zeros(4)), _cuda(torch.ones(4))
    works = comm.batch_isend_irecv([P2POp("recv", a, 1), P2POp("send", b, 1)])
    names = [c[0] for c in fake.log.calls]
    start, end = names.index("groupStart"), names.index("groupEnd")
    assert start < names.index("recv") < names.index("send") < end
    records = [i for i, n in enumerate(names) if n == "event.record"]
    assert len(records) == 2 and all(i > end for i in records)
    for w in works:
        w.wait()


def test_cupy_nccl_split_makes_a_new_nccl_communicator_closed_with_its_parent(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    fake = install(monkeypatch)
    nccl_mod = install_cupy(monkeypatch, fake.log)
    parent = cupy_nccl.CupyNCCLCommunicator(LaunchInfo(0, 1, 0, 1, Launcher.EXPLICIT),
                                            timeout=5.0)
    child = parent.split(7)
    assert isinstance(child, cupy_nccl.CupyNCCLCommunicator) and child is not parent
    assert (child.rank, child.world_size, child.timeout) == (0, 1, 5.0)
    assert len(nccl_mod.comms) == 2 and len(fake.side_streams) == 2  # its own NCCL and stream
    assert parent.split(None) is None
    parent.close()
    assert child.closed and nccl_mod.comms[1].destroyed


def _transfer(kind: P2PKind, peer: int, index: int) -> Transfer:
    t = torch.zeros(1)
    return Transfer(kind, t, t, peer, 0, Description(kind.value, index, 1, ""))


def test_nccl_batch_order_lower_rank_of_each_pair_sends_first() -> None:
    ops = [_transfer(P2PKind.SEND, 0, 0), _transfer(P2PKind.RECV, 0, 1),
           _transfer(P2PKind.SEND, 2, 2), _transfer(P2PKind.RECV, 2, 3),
           _transfer(P2PKind.SEND, 2, 4)]
    posted: list[tuple[str, int]] = []

    def post(p: Transfer) -> Work:
        posted.append((p.kind.value, p.peer))
        return CompletedWork(str(p.desc))

    works = post_in_pair_order(1, ops, post)
    # rank 1: with rank 0 (lower) it receives first; with rank 2 (higher) it sends first,
    # sends in their order
    assert posted == [("recv", 0), ("send", 0), ("send", 2), ("send", 2), ("recv", 2)]
    assert [w.description for w in works] == [str(o.desc) for o in ops]

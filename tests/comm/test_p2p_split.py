"""send/recv and P2POp on thread ranks: size mismatches, timeouts, the profiler's records, P2POp's
fields. Point-to-point, split and the hierarchical all-reduce against a single-process reference
on every backend are the module tier's (``tests/comm/suite_p2p_split.py``,
``suite_hierarchical.py``).
"""

from __future__ import annotations

import pytest
import torch

import gradcomm
from gradcomm.comm.backends.threads import ThreadGroup

from tests._support.p2p_split_checks import expect_error


def test_threads_size_mismatch_raises_from_wait() -> None:
    def body(comm: gradcomm.Communicator) -> None:
        if comm.rank == 0:
            comm.send(torch.zeros(3), 1)
        else:
            work = comm.recv(torch.zeros(4), 0, async_op=True)
            expect_error(RuntimeError, work.wait, "sent 3")

    ThreadGroup(2, timeout=20).run(body)


def test_recv_without_send_times_out() -> None:
    def body(comm: gradcomm.Communicator) -> None:
        if comm.rank == 1:
            expect_error(gradcomm.CollectiveTimeoutError, lambda: comm.recv(torch.zeros(2), 0),
                         "recv")

    ThreadGroup(2, timeout=0.5).run(body)


def test_profiler_records_send_and_recv_and_a_child_has_its_own() -> None:
    from gradcomm.profiler import Profiler

    def body(comm: gradcomm.Communicator) -> list[tuple[str, int]]:
        prof = Profiler(comm).attach()
        peer = 1 - comm.rank
        works = comm.batch_isend_irecv([gradcomm.comm.P2POp("send", torch.ones(8), peer),
                                        gradcomm.comm.P2POp("recv", torch.zeros(4, 2).t(), peer)])
        for w in works:
            w.wait()
        child = comm.split(0)
        assert child is not None and child.profiler is None
        return sorted((r.op, r.bytes) for r in prof.records if r.op in ("send", "recv"))

    assert ThreadGroup(2, timeout=20).run(body) == [[("recv", 32), ("send", 32)]] * 2


def test_p2pop_converts_op_and_compares_by_identity() -> None:
    import enum

    import numpy as np

    from gradcomm.comm import P2PKind, P2POp

    class Direction(str, enum.Enum):
        SEND = "send"

    t = torch.zeros(2)
    assert P2POp("recv", t, 1).op is P2PKind.RECV and P2POp("send", t, 1).tag == 0
    assert P2POp(np.str_("send"), t, 1).op is P2PKind.SEND
    assert P2POp(Direction.SEND, t, 1).op is P2PKind.SEND
    a, b = P2POp("send", t, 1), P2POp("send", t, 1)
    assert a == a and a != b and [a, b].index(b) == 1 and len({a, b}) == 2  # as torch's P2POp
    with pytest.raises(AttributeError):
        a.tag = 3  # type: ignore[misc]
    expect_error(ValueError, lambda: P2POp("put", t, 1), "op")


def test_p2pop_fields_are_read_only_and_shown() -> None:
    from gradcomm.comm import P2POp

    t = torch.zeros(2, 3)
    op = P2POp("isend", t, 1, tag=4)
    assert op.tensor is t and op.peer == 1 and op.tag == 4
    for name in ("op", "tensor", "peer", "tag"):
        with pytest.raises(AttributeError):
            setattr(op, name, None)
    assert repr(op) == "P2POp('send', Tensor [2, 3] torch.float32, peer=1, tag=4)"
    assert repr(P2POp("recv", [1], 0)) == "P2POp('recv', [1], peer=0, tag=0)"

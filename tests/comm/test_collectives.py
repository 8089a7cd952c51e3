"""The collectives beyond all_reduce, broadcast and all_gather on thread ranks: the per-collective
``supports()`` answers, the profiler's records, a clear error for mismatched object collectives.
Their values against the torch reference on every backend are the module tier's
(``tests/comm/suite_collectives.py`` with ``tests/_support/coll_cases.py``).
"""

from __future__ import annotations

import pytest
import torch

from gradcomm.comm import Collective, SupportLevel
from gradcomm.comm.backends.threads import ThreadGroup


def test_supports_answers_per_collective() -> None:
    def ask(comm):  # type: ignore[no-untyped-def]
        return (comm.supports(torch.float32, collective="reduce_scatter"),
                comm.supports(torch.complex64, collective=Collective.REDUCE_SCATTER),
                comm.supports(torch.uint16, collective="all_to_all"),
                comm.supports(torch.float32, "meta", collective="gather"))
    rs, cplx, a2a, meta = ThreadGroup(1).run(ask)[0]  # type: ignore[misc]
    assert rs.level is SupportLevel.NATIVE
    assert cplx.level is SupportLevel.UNSUPPORTED and "all_reduce" in cplx.reason
    assert a2a.level is SupportLevel.NATIVE  # moved as bytes
    assert meta.level is SupportLevel.UNSUPPORTED
    with pytest.raises(ValueError, match="unknown collective"):
        ThreadGroup(1).communicator(0).supports(torch.float32, collective="reduce_gather")


def test_profiler_records_every_new_collective_with_nccl_tests_sizes() -> None:
    from gradcomm.profiler import Profiler

    def run(comm):  # type: ignore[no-untyped-def]
        prof = Profiler(comm).attach()
        out, big = torch.zeros(4), torch.ones(8)
        comm.reduce_scatter(out, big, label="shard")
        comm.all_to_all(big.clone(), big)
        comm.reduce(out, 0)
        comm.gather(big if comm.rank == 0 else None, out, 0)
        comm.scatter(out, big if comm.rank == 0 else None, 0)
        comm.all_gather_object(comm.rank)
        return [(r.op, r.bytes) for r in prof.records], [s.op for s in prof.summary().ops]

    (records, ops), _ = ThreadGroup(2).run(run)  # type: ignore[misc]
    assert records[:5] == [("reduce_scatter", 32), ("all_to_all", 32), ("reduce", 16),
                           ("gather", 32), ("scatter", 32)]
    assert [op for op, _ in records[5:]] == ["all_gather", "all_gather"]  # sizes, then bytes
    assert {"reduce_scatter", "all_to_all", "reduce", "gather", "scatter"} <= set(ops)


def test_all_gather_object_against_another_collective_is_a_clear_error() -> None:
    """A rank whose all_gather_object meets another rank's all_gather (a caller bug, undefined
    without debug mode) gets a RuntimeError naming that rank, not an internal error."""

    def run(comm):  # type: ignore[no-untyped-def]
        if comm.rank == 0:
            out = torch.empty(2, dtype=torch.int64)
            comm.all_gather(out, torch.tensor([-5]))
            return None
        with pytest.raises(RuntimeError, match="rank 0 sent no object size; ranks called "
                                               "different collectives"):
            comm.all_gather_object("x")
        return "raised"

    assert ThreadGroup(2).run(run) == [None, "raised"]

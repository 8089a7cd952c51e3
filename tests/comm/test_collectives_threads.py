"""reduce_scatter, all_to_all, the rooted and the object collectives on the thread backend:
the base class's logic (checks, layouts, emulations) at 1-4 ranks, without processes."""

from __future__ import annotations

import pytest
import torch
from coll_cases import FLOATS, HALF, INTS, run_all

from gradcomm.comm import Collective, SupportLevel
from gradcomm.comm.backends.threads import ThreadGroup

DTYPES = FLOATS + INTS + HALF + [torch.int16, torch.bool]


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_every_collective_matches_the_reference(world_size: int) -> None:
    counts = ThreadGroup(world_size, timeout=30).run(lambda comm: run_all(comm, DTYPES))
    assert all(c == counts[0] for c in counts)
    assert counts[0]["reduce_scatter"] > 0  # type: ignore[index]


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

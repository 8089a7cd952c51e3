"""The sweep of the collectives beyond all_reduce: nccl-tests' factors, and rows whose check
values are right, on the thread backend (no raw transport there)."""

from __future__ import annotations

import pytest
import torch

from gradcomm.bench.__main__ import main
from gradcomm.bench.collectives import SWEPT, bus_factor, run_collective_sweep
from gradcomm.comm import Collective
from gradcomm.comm.backends.threads import ThreadGroup


def test_bus_factors_are_nccl_tests() -> None:
    assert bus_factor(Collective.ALL_REDUCE, 4) == 1.5
    for c in (Collective.REDUCE_SCATTER, Collective.ALL_GATHER, Collective.ALL_TO_ALL,
              Collective.GATHER, Collective.SCATTER):
        assert bus_factor(c, 4) == 0.75
    assert bus_factor(Collective.BROADCAST, 4) == bus_factor(Collective.REDUCE, 4) == 1.0
    assert bus_factor(Collective.SENDRECV, 4) == 1.0


@pytest.mark.parametrize("world_size", [2, 3])
def test_every_collective_sweeps_with_right_check_values(world_size: int) -> None:
    def sweep(comm):  # type: ignore[no-untyped-def]
        rows = []
        for c in SWEPT:
            rows += run_collective_sweep(comm, c, [96, 1024], torch.float32, iters=2, warmup=1,
                                         repeats=1)
        return rows

    per_rank = ThreadGroup(world_size).run(sweep)
    rows = per_rank[0]
    assert [r.collective for r in rows] == [c.value for c in SWEPT for _ in (96, 1024)]  # type: ignore[attr-defined]
    assert all(r.wrong == 0 for rank_rows in per_rank for r in rank_rows)  # type: ignore[attr-defined]
    for r in rows:  # type: ignore[attr-defined]
        factor = bus_factor(Collective(r.collective), world_size)
        assert r.busbw == pytest.approx(r.algbw * factor)
        assert r.size == r.count * 4 and r.raw_time_us is None
        assert r.redop == ("sum" if r.collective in ("reduce_scatter", "reduce") else "none")


def test_unknown_collective_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["--backend", "gloo", "-c", "reduce_gather"])
    assert exc.value.code == 2 and "unknown collective" in capsys.readouterr().err

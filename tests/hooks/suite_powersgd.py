"""PowerSGD through the reducer, as a rank-agnostic test (the module tier,
:mod:`tests._support.rank_suite`; run by ``tests/hooks/test_rank_suites.py`` at 2 ranks of every
backend): five steps of training leave every rank's parameters finite and bit-identical."""

from __future__ import annotations

import torch
from torch import nn

import gradcomm
from gradcomm.hooks import GradientReducer, PowerSGDState

from tests._support import rank_suite


@rank_suite.only(lambda run: run.world_size == 2)
def test_ranks_end_bit_identical(comm: gradcomm.Communicator) -> None:
    torch.manual_seed(0)  # thread ranks share this generator: the reducer's broadcast evens it
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 10))
    reducer = GradientReducer(model, comm, bucket_cap_mb=0.005, first_bucket_cap_mb=0.005)
    reducer.register_comm_hook("powersgd", state=PowerSGDState(
        comm, matrix_approximation_rank=2, start_powerSGD_iter=2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(comm.rank)
    for _ in range(5):
        opt.zero_grad()
        x, y = torch.randn(16, 32, generator=g), torch.randint(0, 10, (16,), generator=g)
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
    reducer.remove()
    mine = {n: p.detach().clone() for n, p in model.named_parameters()}
    everyone = comm.all_gather_object(mine)
    for name, value in mine.items():
        assert torch.isfinite(value).all(), name
        assert all(torch.equal(value, other[name]) for other in everyone), name  # type: ignore[index]

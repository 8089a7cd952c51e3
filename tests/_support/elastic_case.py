"""The training the fault-tolerance tests run: a small MLP, one global batch per step.

Every worker and the one-process reference build the same model from one seed and draw step
``s``'s global batch from a generator seeded with ``s``, so a worker that joins late trains on the
same batches; each rank's loss is scaled by ``world_size / len(batch)``, so the averaged gradient
is the mean over the global batch at any world size (as examples/train_digits.py does).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

__all__ = ["BATCH", "BUCKET_CAP_MB", "OPTIMIZER", "global_batch", "make_model", "make_optimizer",
           "max_rel_diff", "reference", "shard_loss"]

BATCH = 24
#: Small enough that each weight is a bucket of its own: backward has buckets in flight.
BUCKET_CAP_MB = 0.002


def make_model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(),
                         nn.Linear(32, 4))


#: SGD's options, for the plain and the sharded optimizer alike.
OPTIMIZER = {"lr": 0.1, "momentum": 0.9}


def make_optimizer(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), **OPTIMIZER)


def global_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1000 + step)
    x = torch.randn(BATCH, 16, generator=gen)
    y = torch.randint(0, 4, (BATCH,), generator=gen)
    return x, y


def shard_loss(model: nn.Module, step: int, rank: int, world_size: int,
               to: Callable[[torch.Tensor], torch.Tensor] = lambda t: t) -> torch.Tensor:
    """This rank's share of step ``step``'s loss (its gradient, averaged over the ranks, is the
    mean over the global batch); ``to`` moves the batch to the model's device."""
    x, y = global_batch(step)
    logits = model(to(x[rank::world_size]))
    loss = nn.functional.cross_entropy(logits, to(y[rank::world_size]), reduction="sum")
    return loss * (world_size / BATCH)


def reference(steps: int) -> list[torch.Tensor]:
    """The parameters after ``steps`` steps of the uninterrupted one-process run."""
    model = make_model()
    opt = make_optimizer(model)
    for step in range(steps):
        opt.zero_grad()
        shard_loss(model, step, 0, 1).backward()
        opt.step()
    return [p.detach().clone() for p in model.parameters()]


def max_rel_diff(params: list[torch.Tensor], ref: list[torch.Tensor]) -> float:
    """max over tensors of max|a - b| / max|b|."""
    return max(float((a - b).abs().max() / b.abs().max()) for a, b in zip(params, ref,
                                                                            strict=True))

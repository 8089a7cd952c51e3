"""What a worker needs to go on training, and what a joining worker receives from a live peer."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

__all__ = ["State"]


class State:
    """The training state fault tolerance keeps consistent across workers.

    Args:
        model: the module being trained; its parameters and buffers travel to joining workers.
        optimizer: its optimizer (optional); its ``state_dict()`` travels too. A
            :class:`~gradcomm.ShardedOptimizer` is made by the ``build`` function of
            :class:`~gradcomm.elastic.ElasticGroup` over each new communicator (assign it here);
            its full state is kept as a snapshot (see :attr:`snapshot`).
        **extra: your own values to carry (an epoch counter, a learning-rate scheduler...):
            picklable values, or objects with ``state_dict()`` / ``load_state_dict()`` (loaded in
            place). Read and change them in :attr:`extra`.

    Attributes:
        step: optimizer steps applied so far, the same on every worker after each step; the
            index of the next global batch.
        extra: the ``**extra`` values by name.
        snapshot: with a :class:`~gradcomm.ShardedOptimizer`, the newest full state in host
            memory (``{"step", "model", "optimizer", "extra"}``), taken every
            ``snapshot_every`` steps; after a failure every worker returns to the newest one a
            worker holds. None otherwise.
    """

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer | None = None,
                 **extra: Any) -> None:
        if not isinstance(model, nn.Module):
            raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
        if optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(f"optimizer must be a torch.optim.Optimizer or None, got "
                            f"{type(optimizer).__name__}")
        self.model = model
        self.optimizer = optimizer
        self.extra: dict[str, Any] = dict(extra)
        self.step = 0
        #: False until this worker's state was agreed with a generation (a fresh worker's state
        #: counts for nothing when another worker has one).
        self.synced = False
        self.snapshot: dict[str, Any] | None = None

    def __repr__(self) -> str:
        return (f"<State step={self.step} model={type(self.model).__name__} "
                f"optimizer={type(self.optimizer).__name__}>")

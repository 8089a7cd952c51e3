"""What a :class:`~gradcomm.comm.Communicator` tells an attached observer (e.g. the profiler)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import torch

__all__ = ["CollectiveObserver"]


class CollectiveObserver(Protocol):
    """Told of every collective a :class:`~gradcomm.comm.Communicator` issues (e.g.
    :mod:`gradcomm.profiler`).

    Attach one as ``comm.profiler``; ``None`` (the default) costs one attribute test per call.
    """

    def collective_started(
        self, op: str, tensor: torch.Tensor | None, label: str | None, async_op: bool
    ) -> Callable[[], None]:
        """Called just before the transport starts ``op`` on contiguous ``tensor`` (the output
        for ``all_gather``, None for ``barrier``); returns a function run once at completion."""
        ...

    def communicator_closed(self) -> None:
        """Called once by :meth:`Communicator.close`, after the transport is released."""
        ...

    def step(self) -> None:
        """Marks the end of a training step (the gradient reducer may call it after each
        backward's all-reduces complete); later collectives count in the next step."""
        ...

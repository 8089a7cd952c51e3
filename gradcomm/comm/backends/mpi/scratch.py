"""Reusable float32 buffers for the float16/bfloat16 upcast of the mpi backend."""

from __future__ import annotations

import threading

import torch

__all__ = ["ScratchPool"]


class ScratchPool:
    """Reusable float32 buffers, keyed by device.

    A buffer is taken for the life of one collective and given back by its completion callback,
    so overlapping async collectives never share one.

    Args:
        keep: how many buffers per device are kept for reuse (the largest).
    """

    def __init__(self, keep: int = 4) -> None:
        self._free: dict[torch.device, list[torch.Tensor]] = {}
        self._keep = keep
        self._lock = threading.Lock()

    def take(self, numel: int, device: torch.device) -> torch.Tensor:
        """A 1-D float32 buffer of at least ``numel`` elements on ``device`` (uninitialised)."""
        with self._lock:
            free = self._free.setdefault(device, [])
            fits = [i for i, b in enumerate(free) if b.numel() >= numel]
            if fits:
                best = min(fits, key=lambda i: free[i].numel())
                return free.pop(best)
        return torch.empty(numel, dtype=torch.float32, device=device)

    def give(self, buf: torch.Tensor) -> None:
        """Return a buffer from :meth:`take`; only the ``keep`` largest per device are kept."""
        with self._lock:
            free = self._free.setdefault(buf.device, [])
            free.append(buf)
            if len(free) > self._keep:
                free.sort(key=lambda b: b.numel(), reverse=True)
                del free[self._keep:]

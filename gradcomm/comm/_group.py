"""Where one process sits in a communicator's group, checked once at construction."""

from __future__ import annotations

import torch

__all__ = ["GroupMember"]


class GroupMember:
    """A process's place in a group of ``world_size`` processes, and its collectives' defaults.

    The base of :class:`~gradcomm.comm.Communicator`, whose constructor takes these arguments.

    Args:
        rank: this process's index, ``0 <= rank < world_size``.
        world_size: number of processes.
        local_rank: index among the processes on this host.
        device: device the collectives' tensors live on (``cpu`` or ``cuda:<i>``).
        timeout: seconds a collective may take before :meth:`Work.wait` raises
            :class:`~gradcomm.CollectiveTimeoutError`; ``None`` waits forever.

    Raises:
        ValueError: rank, world_size, local_rank or timeout out of range.
    """

    def __init__(
        self,
        *,
        rank: int,
        world_size: int,
        local_rank: int,
        device: torch.device | str,
        timeout: float | None,
    ) -> None:
        if world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {world_size}")
        if not 0 <= rank < world_size:
            raise ValueError(f"rank must be in [0, {world_size}), got {rank}")
        if local_rank < 0:
            raise ValueError(f"local_rank must be >= 0, got {local_rank}")
        if timeout is not None and timeout <= 0:
            raise ValueError(f"timeout must be a positive number of seconds or None, got {timeout}")
        self._rank = rank
        self._world_size = world_size
        self._local_rank = local_rank
        self._device = torch.device(device)
        self._timeout = timeout

    @property
    def rank(self) -> int:
        """Index of this process in the group, ``0 <= rank < world_size``."""
        return self._rank

    @property
    def world_size(self) -> int:
        """Number of processes in the group."""
        return self._world_size

    @property
    def local_rank(self) -> int:
        """Index of this process among those on the same host."""
        return self._local_rank

    @property
    def device(self) -> torch.device:
        """Device of the tensors this communicator reduces."""
        return self._device

    @property
    def timeout(self) -> float | None:
        """Default timeout of every collective, in seconds (``None``: wait forever)."""
        return self._timeout

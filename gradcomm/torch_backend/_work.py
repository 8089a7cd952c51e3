"""The :class:`torch.distributed.Work` a "gradcomm" process group returns.

torch reaches a work three ways, and each must see a failed operation as failed:

- ``wait(timeout)`` (Python, and C++ through the pybind trampoline) raises the operation's error;
- ``get_future()`` returns a future that completes by itself once the operation is done, with the
  list of output tensors as its value (DDP and FSDP2 chain on it, and DDP never calls wait). A
  failure must reach C++ as an error: ``Future.set_exception`` stores the exception as a value,
  which C++ reads as success, so the future handed out is ``done.then(unwrap)``, whose callback
  raises the error, and torch marks a future whose callback raised as failed;
- ``is_completed()``, ``is_success()``, ``exception()``, torch's polling calls.

The future is completed on a delivery thread (:class:`~gradcomm.torch_backend._engine.Engine`),
never on the thread that runs the operations: torch's PowerSGD hook waits for one all-reduce inside
the callback of another.
"""

from __future__ import annotations

import datetime
import threading

import torch
import torch.distributed as dist

from gradcomm.comm import CollectiveTimeoutError

__all__ = ["GradcommWork"]


class GradcommWork(dist.Work):
    """Handle of one operation of a "gradcomm" process group.

    Args:
        outputs: the tensors the operation writes (the future's value; ``[]`` for a barrier).
        description: what the operation is, for error messages (e.g. ``"allreduce of 1024
            torch.float32 on cpu"``).
    """

    def __init__(self, outputs: list[torch.Tensor], description: str) -> None:
        super().__init__()
        self._outputs = outputs
        self.description = description
        self._event = threading.Event()
        self._error: BaseException | None = None
        self._sender = -1
        self._done: torch.futures.Future[None] = torch.futures.Future()
        self._future = self._done.then(self._unwrap)

    # ------------------------------------------------------------------ set by the engine
    def complete(self, error: BaseException | None) -> None:
        """Mark the operation done (``error`` None) or failed; runs the future's callbacks on
        the calling thread (the engine's delivery thread)."""
        self._error = error
        self._event.set()
        self._done.set_result(None)

    def _unwrap(self, _: torch.futures.Future[None]) -> list[torch.Tensor]:
        if self._error is not None:
            raise self._error
        return self._outputs

    # ------------------------------------------------------------------ torch's calls
    def wait(self, timeout: datetime.timedelta | float | None = None) -> bool:
        """Block until the operation is done; True on success.

        Args:
            timeout: how long to wait: a :class:`datetime.timedelta` (what torch passes; zero:
                no limit, as torch's ``kNoTimeout``), seconds, or None (no limit). The
                operation itself ends at the group's timeout, whatever this one.

        Raises:
            CollectiveTimeoutError: not done within ``timeout`` (the operation goes on).
            Exception: the operation's error (e.g. the transport's CollectiveTimeoutError).
        """
        seconds = timeout.total_seconds() if isinstance(timeout, datetime.timedelta) else timeout
        if seconds is not None and seconds <= 0:
            seconds = None
        if not self._event.wait(seconds):
            raise CollectiveTimeoutError(f"{self.description}: wait timed out after {seconds} s "
                                         "(the operation goes on)")
        if self._error is not None:
            raise self._error
        return True

    def is_completed(self) -> bool:
        """True once the operation is done, successfully or not (never blocks)."""
        return self._event.is_set()

    def is_success(self) -> bool:
        """True once the operation is done without error."""
        return self._event.is_set() and self._error is None

    def exception(self) -> BaseException | None:
        """The operation's error, or None (also while it runs)."""
        return self._error

    def result(self) -> list[torch.Tensor]:
        """The output tensors (valid once the work is done)."""
        return self._outputs

    def get_future(self) -> torch.futures.Future[list[torch.Tensor]]:
        """A future that completes by itself when the operation does: its value is the list of
        output tensors; on failure it is in error (its ``wait()`` and ``value()`` raise)."""
        return self._future

    def _set_sender(self, rank: int | None) -> None:
        self._sender = -1 if rank is None else rank

    def source_rank(self) -> int:
        """The sender of a receive (torch's ``recv`` returns it; for a receive from any rank,
        known once the work is done); -1 for other operations."""
        return self._sender

    #: torch's name: ``dist.recv`` without ``src`` and its tests call ``work._source_rank()``.
    _source_rank = source_rank

    def __repr__(self) -> str:
        state = ("pending" if not self._event.is_set()
                 else "failed" if self._error is not None else "completed")
        return f"<GradcommWork {self.description!r} {state}>"

"""The handle of work enqueued on a CUDA stream: complete when an event recorded after it is.

Used by the cupy-nccl backend (:mod:`gradcomm.comm.backends.cupy_nccl`), which re-exports it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ..work import DescriptionLike, Work
from .nccl import poll_until_done

__all__ = ["CudaEventWork"]


class CudaEventWork(Work):
    """A collective enqueued on a CUDA stream, complete when ``event`` (recorded after it) is.

    Args:
        event: an object with ``query() -> bool`` (a :class:`torch.cuda.Event`).
        description: for error messages.
        timeout: default timeout of :meth:`wait`, seconds.
        check_error: called while polling; raises RuntimeError on an asynchronous NCCL error.
        on_timeout: called once when :meth:`wait` times out, before it raises.
        on_complete: called once when the event is found complete, before the callbacks run
            (makes the current stream wait for the event).
    """

    def __init__(
        self,
        event: Any,
        description: DescriptionLike,
        timeout: float | None,
        check_error: Callable[[], None],
        on_timeout: Callable[[], None],
        on_complete: Callable[[], None] | None = None,
    ) -> None:
        super().__init__(description, timeout)
        self._event = event
        self._check_error = check_error
        self._on_cuda_timeout = on_timeout
        self._on_complete = on_complete

    _aborted = False

    def _test(self) -> bool:
        if self._aborted:  # the event will never be reached: fail, do not stay "pending"
            raise RuntimeError(f"{self.description} timed out and NCCL was aborted; make a new "
                               "communicator")
        if bool(self._event.query()):
            if self._on_complete is not None:
                self._on_complete()
                self._on_complete = None
            return True
        self._check_error()
        return False

    def _wait(self, timeout: float | None) -> None:
        poll_until_done(self._test, timeout, self._expire,
                        f"{self.description}: CUDA event not reached")

    def _expire(self) -> None:
        self._aborted = True
        self._on_cuda_timeout()

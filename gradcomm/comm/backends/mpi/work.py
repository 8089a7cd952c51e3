"""Handles of non-blocking MPI collectives, and how waiting on them polls MPI.

MPICH (and Open MPI by default) has no asynchronous progress thread, so an outstanding
non-blocking collective advances only while this process calls into MPI. :meth:`MPIWork.wait`
polls ``Request.Test()`` -- back to back for 1 ms, then with ``sched_yield()`` between bursts
for up to 1 s, then with sleeps growing to 1 ms -- and :meth:`MPIWork.is_completed` calls
``Test()`` once, so callers that poll ``is_completed()`` on in-flight work (the gradient manager
does, from its backward hooks) drive the transfer forward.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable

from mpi4py import MPI

from ...work import DescriptionLike, Work

__all__ = ["MPIWork"]

# Polling schedule of MPIWork.wait, in bursts of _TESTS_PER_CHECK Test() calls: back to back
# for _YIELD_AFTER_S seconds (small and medium messages finish here), then separated by
# sched_yield() (a peer rank sharing this core gets to run, which with two ranks on two busy
# cores beat a pure Test() spin for large messages) until _SPIN_S, then by sleeps doubling from
# _SLEEP_START_S up to _SLEEP_CAP_S, so a rank waiting for a late or dead peer stops burning a
# core. A transfer progresses only when Test() is called, so the yielding phase is long enough
# for any usual bucket.
_TESTS_PER_CHECK = 16
_YIELD_AFTER_S = 1e-3
_SPIN_S = 1.0
_SLEEP_START_S = 1e-5
_SLEEP_CAP_S = 1e-3


class MPIWork(Work):
    """Handle of one non-blocking MPI collective.

    Args:
        request: the ``MPI.Request`` returned by ``Iallreduce``/``Ibcast``/...
        description: what the collective is, for error messages.
        timeout: default timeout of :meth:`wait`, seconds (``None``: forever).
        keepalive: objects that must outlive the request: the tensors, and the storages of the
            memory MPI reads and writes (a tensor alone is not enough: ``t.data = ...`` or
            ``t.set_(...)`` while the collective is pending would free that memory).
        inflight: the communicator's list of pending works, which holds this one until its
            request completes (it removes itself then): MPI still reads and writes its buffers,
            and the standard forbids freeing a pending collective's request, so neither may die
            with a handle the caller dropped. Later collectives test the oldest pending work,
            which also runs its callbacks.

    ``_test`` calls ``Request.Test()`` (which also drives MPI's progress engine); ``_wait`` polls
    it until the request completes or the deadline passes, then raises :class:`TimeoutError`.
    """

    #: A receive's expected size and the status that reports the size it got (None otherwise).
    _expect_bytes: int | None = None
    _status: MPI.Status | None = None
    #: The error of a request that completed wrongly (a receive of another size): raised by
    #: every later wait() and is_completed(), since MPI no longer knows the request.
    _failure: RuntimeError | None = None

    def __init__(
        self,
        request: MPI.Request,
        description: DescriptionLike,
        timeout: float | None,
        keepalive: tuple[object, ...] = (),
        inflight: list[MPIWork] | None = None,
        *,
        expect_bytes: int | None = None,
    ) -> None:
        super().__init__(description, timeout)
        self._request = request
        if expect_bytes is not None:  # a receive (the class defaults serve every collective)
            self._expect_bytes = expect_bytes
            self._status = MPI.Status()
        # None once the request completed: nothing needs to outlive it any more.
        self._keepalive: tuple[object, ...] | None = keepalive
        self._inflight = inflight
        if inflight is not None:
            inflight.append(self)

    def _release(self) -> None:
        """The request completed: drop the buffers and leave the communicator's pending list."""
        self._keepalive = None
        inflight, self._inflight = self._inflight, None
        if inflight is not None:
            inflight.remove(self)
        status = self._status
        if status is not None:  # a receive: MPI accepts a shorter message without an error
            got = status.Get_count(MPI.BYTE)
            if got != self._expect_bytes:
                self._failure = RuntimeError(f"{self.description}: received {got} bytes, the "
                                             f"buffer holds {self._expect_bytes}")
                raise self._failure

    def _failed(self, exc: MPI.Exception) -> RuntimeError:
        """The request completed with an MPI error (e.g. a message longer than the buffer):
        release it, and keep the error for every later wait."""
        # the error class's text ("Message truncated"); str(exc) adds MPICH's whole error stack
        self._failure = RuntimeError(
            f"{self.description}: {MPI.Get_error_string(exc.Get_error_class())}")
        self._status = None  # no size to check
        self._release()
        return self._failure

    def _test(self) -> bool:
        if self._failure is not None:
            raise self._failure
        try:
            done = self._request.Test(self._status)
        except MPI.Exception as exc:
            raise self._failed(exc) from exc
        if done:
            self._release()
        return done

    def _wait(self, timeout: float | None) -> None:
        if self._failure is not None:
            raise self._failure
        try:
            self._poll(timeout)
        except MPI.Exception as exc:
            raise self._failed(exc) from exc

    def _poll(self, timeout: float | None) -> None:
        """Call Test() until the request completes (see the module docstring for the schedule);
        TimeoutError after ``timeout`` seconds."""
        status, request = self._status, self._request
        if request.Test(status):  # often done by now: no clock, no polling loop
            self._release()
            return
        # A collective's poll calls Test itself: one call less per poll than a closure.
        test: Callable[[], bool] = (request.Test if status is None
                                    else lambda: request.Test(status))

        now = time.perf_counter
        start = now()
        deadline = None if timeout is None else start + timeout
        pause = 0.0
        while True:
            for _ in range(_TESTS_PER_CHECK):
                if test():
                    self._release()
                    return
            t = now()
            if deadline is not None and t >= deadline:
                raise TimeoutError(f"{self.description}: MPI request still pending")
            waited = t - start
            if waited < _SPIN_S:
                if waited >= _YIELD_AFTER_S:
                    os.sched_yield()  # let a peer rank that shares this core run
            else:
                pause = min(max(pause * 2.0, _SLEEP_START_S), _SLEEP_CAP_S)
                time.sleep(pause)

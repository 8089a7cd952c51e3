"""The threads of a "gradcomm" process group: one that runs its operations, a few that deliver.

torch calls a process group from any thread (autograd's hooks, the training loop, a future's
callback) and expects every call to return at once with a work. The engine runs the operations
on one thread, in the order they were posted -- every rank then issues the same collectives in
the same order, and the communicator is only ever used by one thread, as torch's ProcessGroupMPI
does. A collective runs to completion there -- or, on a transport whose works may be waited on
from another thread (gloo, which runs them on threads of its own), is only posted there and
waited for on a delivery thread (:class:`WaitElsewhere`), so that the next one is posted at once.
A transfer (send, recv) is only posted there, so the thread can post the matching transfer behind
it (two ranks that both send, then receive, would otherwise wait for each other), and then polled
there until done, or, on gloo, whose transfers complete only inside ``wait()``, waited for on a
delivery thread.

Works are completed on a small pool of delivery threads, not on the thread that runs the
operations: a future's callbacks run where it is completed, and a callback may wait for a later
operation (torch's PowerSGD hook does), which that thread must be free to run. The pool grows
while its threads are busy in callbacks, up to :data:`DELIVERY_THREADS`.

Every thread is joined by :meth:`Engine.shutdown`; one never shut down ends by itself once the
main thread has finished (so a script that never calls ``destroy_process_group`` still exits).
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

from gradcomm.comm import CollectiveTimeoutError, Work
from gradcomm.comm.work import timeout_error

from ._work import GradcommWork

__all__ = ["Engine", "DELIVERY_THREADS", "Posted", "WaitElsewhere"]

#: Most threads completing works at once (each may be held by a callback that waits).
DELIVERY_THREADS = 8
# Polling of posted transfers: from _POLL_MIN_S, doubling while nothing changes, up to _POLL_MAX_S.
_POLL_MIN_S = 2e-5
_POLL_MAX_S = 2e-3
# How often an idle engine checks whether the main thread has finished.
_IDLE_CHECK_S = 0.5


class WaitElsewhere:
    """Posted works to wait for, in order, on a delivery thread rather than here (see the
    module docstring): only for transports whose works may be waited on from another thread."""

    __slots__ = ("works",)

    def __init__(self, works: list[Work]) -> None:
        self.works = works


#: What an operation's body returns: None (it completed on the engine's thread), the gradcomm
#: Work of a transfer it posted, then polled until done, or works in a WaitElsewhere.
Posted = Work | WaitElsewhere | None
_Op = tuple[Callable[[], Posted], GradcommWork]


class Engine:
    """Runs operations in posting order on a thread of its own (see the module docstring).

    Args:
        name: names the threads (``gradcomm-<name>``).
        timeout: seconds a posted transfer may take before its work fails with
            :class:`~gradcomm.CollectiveTimeoutError` (None: no limit); collectives carry their
            communicator's timeout themselves.
    """

    def __init__(self, name: str, timeout: float | None) -> None:
        self._name = name
        self._timeout = timeout
        # queue.Queue, not SimpleQueue: CPython's SimpleQueue.get(timeout) can block forever
        # when the deadline passes while it holds the queue's free lock (seen with the
        # sub-millisecond timeouts of the polling below: a lost completion, a hung send).
        self._ops: queue.Queue[_Op | None] = queue.Queue()
        self._closed = False
        self._lock = threading.Lock()
        self._delivery = ThreadPoolExecutor(DELIVERY_THREADS, f"gradcomm-{name}-deliver")
        self._thread = threading.Thread(target=self._serve, name=f"gradcomm-{name}")
        self._thread.start()

    def submit(self, body: Callable[[], Posted], work: GradcommWork) -> GradcommWork:
        """Queue ``body`` to run on the engine's thread; ``work`` completes when it is done.

        Raises:
            RuntimeError: the engine was shut down.
        """
        with self._lock:
            if self._closed:
                raise RuntimeError(f"gradcomm process group {self._name} is shut down")
            self._ops.put((body, work))
        return work

    def shutdown(self, last: Callable[[], None] | None = None) -> None:
        """Run the queued operations, then ``last`` (closing the communicators), on the engine's
        thread; join every thread. Idempotent; later :meth:`submit` calls raise."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            if last is not None:
                self._ops.put((_run_last(last), GradcommWork([], "shutdown")))
            self._ops.put(None)
        if threading.current_thread() is not self._thread:
            self._thread.join()
        self._delivery.shutdown(wait=not threading.current_thread().name.startswith(
            f"gradcomm-{self._name}-deliver"))

    # ------------------------------------------------------------------ the engine's thread
    def _serve(self) -> None:
        pending: list[tuple[Work, GradcommWork, float]] = []
        poll = _POLL_MIN_S
        main = threading.main_thread()
        while True:
            try:
                item = self._ops.get(timeout=poll if pending else _IDLE_CHECK_S)
            except queue.Empty:
                if not pending and not main.is_alive():
                    return  # the script ended without shutdown: let the interpreter exit
            else:
                if item is None:
                    break
                self._run(*item, pending)
                poll = _POLL_MIN_S
            if pending:
                before = len(pending)
                pending = self._poll(pending)
                poll = _POLL_MIN_S if len(pending) < before else min(poll * 2, _POLL_MAX_S)
        for _, work, _ in pending:  # shut down with transfers unfinished
            self._deliver(work, RuntimeError(f"{work.description}: the process group was shut "
                                             "down before it completed"))

    def _run(self, body: Callable[[], Posted], work: GradcommWork,
             pending: list[tuple[Work, GradcommWork, float]]) -> None:
        """Run one operation's body; deliver its work, or add its posted transfer to
        ``pending``."""
        try:
            posted = body()
        except BaseException as exc:  # noqa: BLE001 - handed to the caller's work
            self._deliver(work, exc)
            return
        if posted is None:
            self._deliver(work, None)
        elif isinstance(posted, WaitElsewhere):
            self._wait_elsewhere(posted.works, work)
        else:
            deadline = (float("inf") if self._timeout is None
                        else time.monotonic() + self._timeout)
            pending.append((posted, work, deadline))

    def _poll(self, pending: list[tuple[Work, GradcommWork, float]]
              ) -> list[tuple[Work, GradcommWork, float]]:
        """Deliver the posted transfers that are done (or past their deadline); keep the rest."""
        still = []
        now = time.monotonic()
        for posted, work, deadline in pending:
            try:
                if posted.is_completed():
                    posted.wait()  # runs its completion steps; raises their errors
                elif now > deadline:
                    self._time_out(posted)
                else:
                    still.append((posted, work, deadline))
                    continue
            except BaseException as exc:  # noqa: BLE001 - handed to the caller's work
                self._deliver(work, exc)
            else:
                self._deliver(work, None)
        return still

    def _time_out(self, posted: Work) -> None:
        """Fail ``posted``, pending past the group's timeout, as a wait on it would (the
        communicator then refuses new operations until it completes)."""
        try:
            posted.wait(0)  # marks the stall; raises CollectiveTimeoutError "within 0.0 s"
        except CollectiveTimeoutError as exc:
            raise timeout_error(posted.description, self._timeout,
                                " (the process group's timeout)") from exc.__cause__

    def _wait_elsewhere(self, posted: list[Work], work: GradcommWork) -> None:
        # Before the next operation: the communicator must not test them while they are waited
        # for on a delivery thread (a gloo transfer waited twice blocks until gloo's timeout).
        for one in posted:
            one.hand_off()

        def wait() -> None:
            try:
                for one in posted:
                    one.wait(self._timeout)  # runs its completion steps; raises their errors
            except BaseException as exc:  # noqa: BLE001 - handed to the caller's work
                work.complete(exc)
            else:
                work.complete(None)

        try:
            self._delivery.submit(wait)
        except RuntimeError:  # the pool is gone (interpreter exit)
            wait()

    def _deliver(self, work: GradcommWork, error: BaseException | None) -> None:
        try:
            self._delivery.submit(work.complete, error)
        except RuntimeError:  # the pool is gone (interpreter exit): complete it here
            work.complete(error)


def _run_last(last: Callable[[], None]) -> Callable[[], Posted]:
    def body() -> Posted:
        last()
        return None

    return body

"""The progress thread of an MPI communicator, and the handles of the calls it runs.

Each :class:`~gradcomm.comm.backends.mpi.communicator.MPICommunicator` runs its MPI calls on one
thread of its own, in posting order, as torch's ``ProcessGroupMPI`` does with its work queue: a
collective is MPI's *blocking* call (``MPI_Allreduce``, ``MPI_Reduce_scatter_block``, ...), so it
takes the algorithms MPI tuned for blocking use (MPICH's non-blocking ones can be much slower:
see docs/performance.md), and it advances while the caller computes, since a thread sits in MPI
for it. The caller is never
in MPI for a collective: :meth:`MPIWork.wait` waits on a lock the thread releases, so the wait
keeps its timeout, answers Ctrl-C, and burns no CPU.

Point-to-point transfers must not wait for their match in posting order (a rank that sends, then
receives, would deadlock against a peer doing the same), so the thread posts them
(``MPI_Isend``/``MPI_Irecv``) and goes on with its queue; when the queue is empty it waits in
``MPI_Waitsome`` on the transfers still pending plus one generalized request
(``MPI_Grequest_start``) that :meth:`ProgressThread.submit` completes to wake it for new work.

Every call runs on this thread, so the communicator needs ``MPI_THREAD_MULTIPLE`` (mpi4py asks for
it by default): the training thread, the progress threads of other communicators and the user's
own mpi4py calls may be in MPI at the same time.

At exit, before mpi4py's ``MPI_Finalize``, every progress thread finishes what it was given; one
still in MPI by then -- in a collective that timed out, or past its communicator's timeout -- would
make ``MPI_Finalize`` run beside it (undefined: MPICH corrupts its heap), so the job is aborted
with ``MPI_Abort`` instead, naming the call (:func:`finish_at_exit`).
"""

from __future__ import annotations

import _thread
import atexit
import queue
import threading
import weakref
from collections.abc import Callable

import torch
from mpi4py import MPI

from ...errors import brief
from ...work import DescriptionLike, Work

__all__ = ["MPIWork", "ProgressThread", "finish_at_exit", "mpi_error"]

#: What the thread runs for one work: a blocking MPI call (returns None once done), or the post
#: of a transfer (returns its pending request).
Call = Callable[[], "MPI.Request | None"]


def mpi_error(description: DescriptionLike, exc: MPI.Exception) -> RuntimeError:
    """The error a work raises for an MPI error: the error class's text ("Message truncated");
    ``str(exc)`` would add MPICH's whole error stack."""
    return RuntimeError(f"{description}: {MPI.Get_error_string(exc.Get_error_class())}")


class MPIWork(Work):
    """Handle of one MPI call that a :class:`ProgressThread` runs.

    Args:
        description: what the call is, for error messages.
        timeout: default timeout of :meth:`wait`, seconds (``None``: forever).
        keepalive: what must outlive the call: the tensors, and the storages of the memory MPI
            reads and writes (a tensor alone is not enough: ``t.set_(...)`` while the call is
            pending would free that memory). Dropped once MPI is done.
        expect_bytes: a receive's buffer size: a message of another size fails the work (MPI
            accepts a shorter one without an error).
    """

    # Class-level defaults, set on an instance only when they differ: fewer stores per call.
    _mpi_done = False
    _failure: BaseException | None = None
    #: A receive's buffer size in bytes (None: not a receive).
    expect_bytes: int | None = None
    #: The thread and call to post at bind (see post_on).
    _post: tuple[ProgressThread, Call] | None = None
    #: True once a wait on it timed out (the call may never end: see finish_at_exit).
    timed_out = False

    def __init__(self, description: DescriptionLike, timeout: float | None,
                 keepalive: tuple[object, ...] = (), *, expect_bytes: int | None = None) -> None:
        super().__init__(description, timeout)
        # Held until the thread is done with the call; a waiter blocks on it (no polling).
        self._ready = _thread.allocate_lock()
        self._ready.acquire()
        self._keepalive: tuple[object, ...] | None = keepalive
        if expect_bytes is not None:
            self.expect_bytes = expect_bytes

    def post_on(self, thread: ProgressThread, call: Call) -> None:
        """Have ``thread`` run ``call`` for this work when the communicator binds it (the last
        step before the caller waits or gets the work back): the thread then finds the caller
        already waiting, with the interpreter free, instead of waiting for it. The communicator
        binds every work it returns, in the order it made them."""
        self._post = (thread, call)

    def bind(self, target: torch.Tensor | None, on_timeout: Callable[[Work], None]) -> None:
        super().bind(target, on_timeout)
        post = self._post
        if post is not None:
            self._post = None
            post[0].submit(self, post[1])

    def finished(self, failure: BaseException | None = None) -> None:
        """Called by the progress thread once MPI is done with the call (``failure``: why it
        failed); wakes every waiter."""
        self._failure = failure
        self._keepalive = None
        self._mpi_done = True
        self._ready.release()

    def _wait(self, timeout: float | None) -> None:
        if not self._mpi_done:
            limit = -1.0 if timeout is None else min(timeout, threading.TIMEOUT_MAX)
            if not self._ready.acquire(True, limit):
                self.timed_out = True
                raise TimeoutError(f"{self.description}: the MPI call is still running")
            self._ready.release()  # for other waiters
        if self._failure is not None:
            raise self._failure

    def _test(self) -> bool:
        if not self._mpi_done:
            return False
        if self._failure is not None:
            raise self._failure
        return True


class ProgressThread:
    """Runs one communicator's MPI calls in posting order (see the module docstring).

    Args:
        name: the thread's name (e.g. ``"gradcomm-mpi-rank0"``).
    """

    def __init__(self, name: str, timeout: float | None) -> None:
        self.timeout = timeout  # the communicator's: how long a call may take
        #: The work whose call the thread is in (None: waiting for work).
        self.current: MPIWork | None = None
        self._queue: queue.SimpleQueue[tuple[MPIWork, Call] | None] = queue.SimpleQueue()
        self._transfers: list[tuple[MPI.Request, MPIWork]] = []
        # The request the thread waits on in MPI beside its transfers (None: not waiting there,
        # or already completed); the lock makes one caller complete it.
        self._lock = threading.Lock()
        self._wakeup: MPI.Grequest | None = None
        self._thread = threading.Thread(target=self._serve, name=name, daemon=True)
        self._thread.start()
        _live.add(self)

    def submit(self, work: MPIWork, call: Call) -> None:
        """Queue ``call`` behind every call submitted before; ``work`` completes with it."""
        self._queue.put((work, call))
        if self._wakeup is not None:  # the thread waits in MPI for transfers: wake it
            self._wake()

    def stop(self, wait_s: float) -> bool:
        """End the thread after the calls queued so far; wait up to ``wait_s`` seconds for it.

        Returns:
            True when the thread ended; False when it is still busy (e.g. in a collective whose
            peer died): it is a daemon thread and ends with the process.
        """
        self._queue.put(None)
        self._wake()
        self._thread.join(wait_s)
        if self._thread.is_alive():
            return False
        _live.discard(self)
        return True

    def _wake(self) -> None:
        with self._lock:
            wakeup, self._wakeup = self._wakeup, None
        if wakeup is not None:
            wakeup.Complete()

    # ------------------------------------------------------------------ the thread
    def _serve(self) -> None:
        while (task := self._next()) is not None:
            self._run(*task)

    def _next(self) -> tuple[MPIWork, Call] | None:
        """The next queued call (None: stop); while transfers are pending and nothing is queued,
        the thread waits in MPI for either."""
        while self._transfers:
            wakeup = MPI.Grequest.Start()
            with self._lock:
                self._wakeup = wakeup
            # A submit that read _wakeup before it was set put its call in the queue before:
            # seen here. One that reads it after completes it.
            if self._queue.empty():
                self._wait_for_transfers(wakeup)
            else:
                self._wake()
                wakeup.Wait()  # frees it
                return self._queue.get()
        return self._queue.get()

    def _run(self, work: MPIWork, call: Call) -> None:
        self.current = work
        try:
            request = call()
        except MPI.Exception as exc:
            work.finished(mpi_error(work.description, exc))
        except BaseException as exc:  # noqa: BLE001 - the caller's wait() raises it
            work.finished(exc)
        else:
            if request is None:
                work.finished()
            else:
                self._transfers.append((request, work))
        finally:
            self.current = None

    def _wait_for_transfers(self, wakeup: MPI.Grequest) -> None:
        """Block in MPI until a pending transfer completes or :meth:`submit` wakes the thread."""
        requests = [request for request, _ in self._transfers]
        statuses: list[MPI.Status] = []  # one per completed request, in the order of indices
        try:
            indices = MPI.Request.Waitsome([*requests, wakeup], statuses)
            failed = False
        except MPI.Exception:  # MPI_ERR_IN_STATUS: the statuses say which failed, and why
            failed = True
            # the completed requests are the ones MPI freed, in index order
            indices = [i for i, r in enumerate(requests) if r == MPI.REQUEST_NULL]
        self._wake()  # completes the wakeup request unless submit did
        wakeup.Wait()  # frees it (nothing to do when Waitsome completed it)
        completed = dict(zip(indices or (), statuses, strict=False))
        pending = []
        for i, (request, work) in enumerate(self._transfers):
            status = completed.get(i)
            if status is None:
                pending.append((request, work))
            elif failed and (code := status.Get_error()) != MPI.SUCCESS:
                text = MPI.Get_error_string(MPI.Get_error_class(code))
                work.finished(RuntimeError(f"{work.description}: {text}"))
            elif work.expect_bytes is not None and (
                    got := status.Get_count(MPI.BYTE)) != work.expect_bytes:
                work.finished(RuntimeError(f"{work.description}: received {got} bytes, the "
                                           f"buffer holds {work.expect_bytes}"))
            else:
                if work.expect_bytes is not None:  # a receive: its sender (src=None: any)
                    work.source = status.Get_source()
                work.finished()
        self._transfers = pending


#: Every progress thread not stopped yet (see finish_at_exit).
_live: weakref.WeakSet[ProgressThread] = weakref.WeakSet()


def finish_at_exit() -> None:
    """Stop every progress thread before ``MPI_Finalize`` (registered with :mod:`atexit` when
    this module is imported, after mpi4py's, so it runs first).

    A thread whose call timed out for its waiter gets no more time; the others get their
    communicator's timeout to finish what they were given. If one is still in MPI then, the job
    is aborted (``MPI_Abort``), naming the call: ``MPI_Finalize`` beside it is undefined.
    """
    from .abort import abort_job

    for thread in list(_live):
        current = thread.current
        wait = 0.0 if current is not None and current.timed_out else thread.timeout
        if not thread.stop(wait if wait is not None else threading.TIMEOUT_MAX):
            what = "transfers" if current is None else brief(current.description, 70)
            abort_job(f"rank {MPI.COMM_WORLD.Get_rank()} exits while MPI still runs {what}, "
                      "which timed out or never completed; aborting the MPI job (MPI_Finalize "
                      "cannot run beside it)")


atexit.register(finish_at_exit)

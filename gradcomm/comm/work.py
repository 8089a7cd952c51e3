"""Handles of asynchronous collectives.

Every collective returns a :class:`Work`, even a synchronous one (then already completed), so
callers never branch on sync versus async. Backends subclass :class:`Work` and implement ``_wait``
and ``_test``; the base class adds the timeout, the error message naming the operation, and
completion callbacks (copy-back of a non-contiguous tensor, the division of an emulated ``AVG``),
which run exactly once, in the order they were added, on the thread that observes completion.
"""

from __future__ import annotations

import abc
import contextlib
import math
import numbers
from collections.abc import Callable
from typing import Any

import torch

from .errors import MESSAGE_LIMIT, CollectiveTimeoutError, brief

__all__ = ["Work", "CompletedWork", "Description", "DescriptionLike", "StallGuard",
           "timeout_error", "writing_into"]

_INF = math.inf


class Description:
    """What a collective is, for error messages and ``repr``; the text is built only when read.

    ``str(d)`` is e.g. ``"all_reduce #3 SUM bucket 0 of 1024 torch.float32 on cpu (mpi, rank
    0/2)"``: the operation, this communicator's sequence number, ``extra`` (a
    :class:`~gradcomm.ReduceOp` is shown by name), ``label``, the element count and ``tail`` (dtype,
    device and group, from the communicator's cache). The text is almost never read, so
    collectives keep the parts and :class:`Work` formats them on demand (see docs/performance.md
    on the cost of each step of a call). The parts are also what
    :mod:`~gradcomm.comm.consistency` compares across ranks: a collective with a root or split
    sizes passes them as ``root`` and ``splits`` (shown in the text through ``extra``, e.g.
    ``"src=0"``).
    """

    __slots__ = ("_extra", "_label", "_numel", "_opname", "_seq", "_tail", "_text", "root",
                 "splits")

    def __init__(
        self,
        opname: str,
        seq: int,
        numel: int,
        tail: str,
        extra: object = "",
        label: str | None = None,
        root: int | None = None,
        splits: tuple[int, ...] | None = None,
    ) -> None:
        self._opname = opname
        self._seq = seq
        self._numel = numel
        self._tail = tail
        self._extra = extra
        self._label = label
        self._text: str | None = None
        #: The rank a rooted collective sends from or collects at (None: no root).
        self.root = root
        #: Split sizes in elements, per rank (None: none); equal on every rank.
        self.splits = splits

    @property
    def seq(self) -> int:
        """This communicator's sequence number of the call."""
        return self._seq

    @property
    def numel(self) -> int:
        """Element count (of the input, for all_gather)."""
        return self._numel

    @property
    def extra(self) -> object:
        """The reduce op, or other text (``"src=0"``)."""
        return self._extra

    @property
    def label(self) -> str | None:
        """The caller's label, or None."""
        return self._label

    def __str__(self) -> str:
        if self._text is None:
            words = [getattr(self._extra, "name", self._extra), self._label]
            detail = "".join(f" {w}" for w in words if w)
            count = f" of {self._numel}" if self._numel else ""  # a barrier carries no data
            self._text = f"{self._opname} #{self._seq}{detail}{count}{self._tail}"
        return self._text

    def __repr__(self) -> str:
        return repr(str(self))


#: What the backend hooks (``Communicator._all_reduce`` ...) receive and :class:`Work` accepts.
DescriptionLike = str | Description


def writing_into(tensor: torch.Tensor) -> contextlib.AbstractContextManager[Any]:
    """Context for writing a result into the caller's ``tensor`` in place: ``torch.no_grad()``
    (a leaf that requires grad accepts it there), or ``torch.inference_mode()`` for an inference
    tensor (which accepts in-place updates nowhere else)."""
    return torch.inference_mode() if tensor.is_inference() else torch.no_grad()


class Work(abc.ABC):
    """Handle of one collective in flight.

    Args:
        description: what the collective is, for error messages (e.g. ``"all_reduce #3 SUM of
            1024 torch.float32 on cpu (mpi, rank 0/2)"``): a string or a :class:`Description`,
            read back as a string by :attr:`description`.
        timeout: default timeout of :meth:`wait` in seconds; ``None`` waits forever.
    """

    # Class-level defaults, set on an instance only when they change: fewer stores per
    # collective (each costs more between large collectives, whose traffic leaves caches cold).
    #: The first exception a callback raised: wait() raises it again every time.
    _error: Exception | None = None
    #: The caller's tensor that callbacks write results into (see bind): they run in
    #: writing_into(it), else under torch.no_grad().
    _target: torch.Tensor | None = None
    #: Told when a wait times out (see bind; the communicator then refuses new collectives
    #: while this one is still pending).
    _on_timeout: Callable[[Work], None] | None = None
    #: True while the callbacks run (a callback that adds one queues it behind the others).
    _running = False
    #: True once the transport is done and the callbacks ran.
    _done = False
    #: The callbacks not run yet, oldest first (a list once one is added).
    _callbacks: list[Callable[[], object]] | tuple[()] = ()
    #: True once handed to a waiter of its own (see hand_off): its communicator leaves it alone.
    _handed_off = False
    #: The rank a receive's data came from: ``src`` of :meth:`Communicator.recv`, or, for a
    #: receive from any rank (``src=None``), the sender once the work is complete (None before,
    #: and for every other operation).
    source: int | None = None

    def __init__(self, description: DescriptionLike, timeout: float | None) -> None:
        self._description = description
        self.timeout = timeout

    @property
    def description(self) -> str:
        """What the collective is, e.g. ``"all_reduce #3 SUM of 1024 torch.float32 on cpu (mpi,
        rank 0/2)"`` (formatted on first read)."""
        return str(self._description)

    @property
    def callback_error(self) -> Exception | None:
        """The first error a callback raised (:meth:`wait` raises it), or None."""
        return self._error

    def bind(self, target: torch.Tensor | None, on_timeout: Callable[[Work], None]) -> None:
        """Called by the communicator that returns this work, before returning it.

        Args:
            target: the caller's tensor that callbacks write results into (they run in
                :func:`writing_into` it; None: under :func:`torch.no_grad`), also for callbacks
                the caller adds later.
            on_timeout: told of this work when a wait on it times out.
        """
        if target is not None:
            self._target = target
        self._on_timeout = on_timeout

    def _limit(self, requested: float | None) -> float | None:
        """The timeout that will really apply to a wait of ``requested`` seconds (None: none);
        a transport that enforces its own, shorter limit says so here."""
        return requested

    # Backends implement these two.
    @abc.abstractmethod
    def _wait(self, timeout: float | None) -> None:
        """Block until the transport is done; raise :class:`TimeoutError` after ``timeout`` s."""

    @abc.abstractmethod
    def _test(self) -> bool:
        """Return True when the transport is done, without blocking."""

    def hand_off(self) -> None:
        """Promise that :meth:`wait` will be called on this work, perhaps on another thread,
        while its communicator goes on with later operations: the communicator then leaves it
        alone. (A pending work is otherwise finished by the communicator's next operation once
        complete, so that a dropped work's completion steps still run.)

        A work is not thread-safe: an operation testing it while another thread waits on it
        runs its completion steps on both threads at once, and on gloo calls a send's or
        receive's torch ``wait()`` a second time, which blocks until gloo's timeout. Call it on
        the thread that uses the communicator, before that thread's next operation.
        """
        self._handed_off = True

    def add_callback(self, fn: Callable[[], object]) -> None:
        """Run ``fn()`` once, after the transport completes and before :meth:`wait` returns.

        Its return value is ignored (so ``lambda: tensor.div_(n)`` is fine). It runs under
        :func:`torch.no_grad` (:func:`torch.inference_mode` when the collective's tensor is an
        inference tensor), so it may update tensors in place that autograd would refuse. On a
        work that has already completed -- one that issued no collective (world_size 1, an
        empty tensor), or one its communicator finished at a later operation --
        ``fn`` runs at once, as a callback added to a completed ``torch.futures.Future`` does.
        Either way, an error ``fn`` raises is not raised here: the callbacks after it still run,
        and :meth:`wait` raises the first error any callback raised (every time it is called).

        Raises:
            TypeError: ``fn`` is not callable.
        """
        if not callable(fn):
            raise TypeError(f"add_callback takes a callable, got {type(fn).__name__} {fn!r}")
        if self._callbacks:
            self._callbacks.append(fn)
        else:
            self._callbacks = [fn]
        if self._done:
            with contextlib.suppress(Exception):  # kept in self._error: wait() raises it
                self._run_callbacks()

    def wait(self, timeout: float | None = None) -> None:
        """Block until the collective is complete and its result is in the tensor.

        Args:
            timeout: seconds to wait (``math.inf``: forever); ``None`` uses the communicator's
                timeout. On gloo and nccl the process group ends a collective at the
                communicator's timeout whatever the wait, so a longer wait is cut to it (and the
                error says so).

        Raises:
            TypeError: ``timeout`` is not a real number (or is a bool).
            ValueError: ``timeout`` is negative or NaN.
            CollectiveTimeoutError: not complete within the timeout (a RuntimeError subclass).
            RuntimeError: the transport failed (e.g. a peer closed its connection).
            Exception: whatever a callback added with :meth:`add_callback` raised.
        """
        if self._done:
            self._check_timeout(timeout)
            if self._error is not None:
                raise self._error
            return
        limit = self.timeout if timeout is None else self._check_timeout(timeout)
        applied = self._limit(limit)
        try:
            self._wait(applied)
        except TimeoutError as exc:
            if self._on_timeout is not None:
                self._on_timeout(self)
            cut = "" if applied == limit else (
                f" (the communicator's; the wait asked for "
                f"{'no limit' if limit is None else f'{limit} s'})"
            )
            raise timeout_error(self.description, applied, cut) from exc
        self._finish()

    @staticmethod
    def _check_timeout(timeout: object) -> float | None:
        """``timeout`` as seconds (None: forever, as ``math.inf``).

        Raises:
            TypeError: not a real number (or a bool). ValueError: negative or NaN.
        """
        if timeout is None:
            return None
        if isinstance(timeout, bool) or not isinstance(timeout, numbers.Real):
            raise TypeError(f"timeout must be a number of seconds or None, got "
                            f"{type(timeout).__name__} {timeout!r}")
        limit = float(timeout)
        if not 0.0 <= limit < _INF:  # negative, NaN or +inf
            if limit != _INF:
                raise ValueError(f"timeout must be >= 0 seconds, got {limit}")
            return None  # wait forever
        return limit

    def is_completed(self) -> bool:
        """Return True when :meth:`wait` would return at once (never blocks).

        Raises:
            RuntimeError: the transport reports that the collective failed (e.g. a peer closed
                its connection); :meth:`wait` raises it too. Never True for a failed collective.
        """
        if self._done:
            return True
        if self._test():
            self._finish()
            return True
        return False

    def _finish(self) -> None:
        self._done = True
        if self._callbacks:
            self._run_callbacks()

    def _run_callbacks(self) -> None:
        """Run and drop the pending callbacks, oldest first; raise the first error any callback
        ever raised. A callback added by a running one joins the end of the queue (it runs after
        the callbacks added before it, as documented)."""
        if self._running:
            return  # the loop below, further up the stack, runs it in turn
        self._running = True
        try:
            target = self._target
            with torch.no_grad() if target is None else writing_into(target):
                while self._callbacks:
                    fn = self._callbacks.pop(0)
                    try:
                        fn()
                    except Exception as exc:  # noqa: BLE001 - re-raised after the later ones ran
                        if self._error is None:
                            self._error = exc
        finally:
            self._running = False
        if self._error is not None:
            raise self._error

    def __repr__(self) -> str:
        state = "completed" if self._done else "pending"
        return f"<{type(self).__name__} {self.description!r} {state}>"


def timeout_error(description: str, seconds: float | None,
                  note: str = "") -> CollectiveTimeoutError:
    """The error of an operation not complete within ``seconds`` (``note``: after the figure,
    e.g. whose timeout it was), ``description`` shortened to keep within MESSAGE_LIMIT."""
    rest = f" did not complete within {seconds} s{note}; a rank may have died or stalled"
    return CollectiveTimeoutError(brief(description, MESSAGE_LIMIT - len(rest)) + rest)


class CompletedWork(Work):
    """A :class:`Work` that is complete from the start (synchronous ops, world_size 1)."""

    _description = "completed collective"
    timeout = None
    _done = True

    def __init__(
        self, description: str = "completed collective", *, target: torch.Tensor | None = None
    ) -> None:
        """``target``: the caller's tensor, which callbacks added later write into (they then run
        under :func:`torch.inference_mode` for an inference tensor, as on other works)."""
        super().__init__(description, None)
        self._done = True
        if target is not None:
            self._target = target

    def _wait(self, timeout: float | None) -> None:
        return None

    def _test(self) -> bool:
        return True


# ----------------------------------------------------------------------------- stalls
# No transport can cancel a started collective, and one issued behind a stalled one would wait for
# it, so a communicator refuses every new collective while a timed-out one is pending. A late peer
# that catches up completes it and makes the communicator usable again; a stalled collective that
# then fails leaves it unusable for good.
class StallGuard:
    """The timed-out collective of one communicator, if any.

    Args:
        backend: the communicator's backend name, for error messages.

    A communicator hands :meth:`note` to each :class:`~gradcomm.comm.Work` it returns (see
    :meth:`Work.bind`) and calls :meth:`check` before each new collective while :attr:`stalled`
    is set.
    """

    __slots__ = ("_backend", "stalled")

    def __init__(self, backend: str) -> None:
        self._backend = backend
        #: The first collective whose wait timed out and that has not completed since (or None).
        self.stalled: Work | None = None

    def note(self, work: Work) -> None:
        """Called by ``work`` when a wait on it times out."""
        if self.stalled is None:
            self.stalled = work

    def check(self) -> None:
        """Forget the stalled collective once it has completed (running its callbacks).

        Raises:
            RuntimeError: it is still pending, or it failed after timing out.
        """
        stalled = self.stalled
        if stalled is None:
            return
        try:
            done = stalled.is_completed()
        except RuntimeError as exc:
            raise RuntimeError(
                f"{self._backend} communicator is unusable: {stalled.description}, which timed "
                f"out, then failed: {exc}"
            ) from exc
        if not done:
            raise RuntimeError(
                f"{self._backend} communicator is unusable while "
                f"{brief(str(stalled.description), 70)}, which timed out, is still pending; "
                "wait() on its Work again"
            )
        self.stalled = None

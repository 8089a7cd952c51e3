"""This worker's current generation, and the forming of the next one.

:class:`Formation` owns what a generation gives a worker -- its number and members, the
communicator, what ``build`` made over it -- and replaces them when the generation ends: it
retires the old ones (the communicator aborted and released in the background), takes part in
the round (:mod:`~gradcomm.elastic._membership`), builds the communicator over the generation's
prefix of the coordinator's store, agrees the state (:mod:`~gradcomm.elastic._sync`) and calls
``build``. It also tells a failure of the group from an error of the script.
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from collections.abc import Callable

import torch
import torch.distributed as dist

from ..comm import CollectiveTimeoutError, Communicator, Launcher, LaunchInfo, Work
from ..hooks import GradientReducer, ShardedOptimizer
from ._membership import Generation, Membership
from ._monitor import Monitor
from ._sync import (
    agree_on_source,
    load_snapshot,
    send_extra,
    send_model,
    send_optimizer,
    send_snapshot,
    take_snapshot,
)
from ._transports import CommunicatorFactory
from .errors import ElasticError
from .state import State

__all__ = ["Build", "Formation", "brief"]

log = logging.getLogger("gradcomm.elastic")

#: ``build(comm, state) -> GradientReducer | None``: see :class:`~gradcomm.elastic.ElasticGroup`.
Build = Callable[[Communicator, State], "GradientReducer | None"]

# The code objects of the waits every collective ends in: an exception raised inside one is a
# failure of the transport (a peer died, the communicator was aborted), not of the script.
_WAITS = frozenset({Work.wait.__code__, Work.is_completed.__code__})


def raised_in_collective(exc: BaseException) -> bool:
    """Whether ``exc``, or an exception it chains, was raised waiting for a collective."""
    seen: set[int] = set()
    todo: list[BaseException | None] = [exc]
    while todo:
        e = todo.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        if isinstance(e, CollectiveTimeoutError):
            return True
        tb = e.__traceback__
        while tb is not None:
            if tb.tb_frame.f_code in _WAITS:
                return True
            tb = tb.tb_next
        todo += [e.__cause__, e.__context__]
    return False


def brief(exc: BaseException, limit: int = 90) -> str:
    """``"Type: message"`` on one line, cut to ``limit`` characters."""
    text = f"{type(exc).__name__}: {exc}".replace("\n", " ")
    return text if len(text) <= limit else text[:limit - 3] + "..."


class Formation:
    """The generation this worker trains in (see the module docstring).

    Args:
        membership: this worker's side of the agreement.
        monitor: its heartbeat thread, which watches the generation's end.
        store: the coordinator's store under the job's prefix.
        factory: builds the communicator (see :mod:`~gradcomm.elastic._transports`).
        device: the communicator's device (None: the backend's).
        timeout: the communicator's timeout, seconds.
        state: the training state.
        build: what to build over each communicator (None: nothing).
        coordinator: the coordinator's address, for messages.
    """

    def __init__(self, membership: Membership, monitor: Monitor, store: dist.Store,
                 factory: CommunicatorFactory, device: torch.device | None, timeout: float,
                 state: State, build: Build | None, coordinator: str) -> None:
        self.membership, self.monitor, self.store = membership, monitor, store
        self.factory, self.device, self.timeout = factory, device, timeout
        self.state, self.build, self.coordinator = state, build, coordinator
        self.worker = membership.worker
        self.generation: Generation | None = None
        self.comm: Communicator | None = None
        self.reducer: GradientReducer | None = None
        #: Set by the monitor (or this worker) when the generation ends.
        self.ended = threading.Event()
        #: Why the next formation happens (the end key's value this worker sets).
        self.reason = f"worker {self.worker} joins"
        #: Seconds the last formation took, or None before the first.
        self.last_formation_s: float | None = None
        self._reapers: list[threading.Thread] = []

    @property
    def number(self) -> int:
        """The current generation's number (0 before the first)."""
        return 0 if self.generation is None else self.generation.number

    def coordinator_lost(self, exc: BaseException) -> ElasticError:
        """The error every worker raises once the coordinator stopped answering."""
        return ElasticError(f"the elastic coordinator at {self.coordinator} stopped answering "
                            f"({brief(exc, 60)}); the job cannot re-form without it")

    def is_failure(self, exc: BaseException, number: int) -> bool:
        """Whether ``exc`` comes from the group (generation ``number`` ended, a collective
        failed) rather than from the script.

        Raises:
            ElasticError: the coordinator stopped answering (chained to ``exc``).
        """
        if self.monitor.error is not None:
            raise self.coordinator_lost(self.monitor.error) from exc
        if self.ended.is_set() or raised_in_collective(exc):
            return True
        try:
            return self.membership.ended(number)
        except (RuntimeError, dist.DistError) as lost:
            raise self.coordinator_lost(lost) from exc

    def fail(self, reason: str) -> None:
        """End the current generation because of this worker's failure (``reason``)."""
        log.warning("elastic: %s", reason)
        self.reason = reason
        self.ended.set()
        if self.comm is not None:
            self.comm.abort()
        try:
            self.membership.end(self.number, reason)
        except (RuntimeError, dist.DistError) as lost:
            raise self.coordinator_lost(lost) from lost

    def discard(self) -> None:
        """Drop this worker's gradients of a step that did not complete."""
        for p in self.state.model.parameters():
            p.grad = None
        if self.state.optimizer is not None:
            self.state.optimizer.zero_grad(set_to_none=True)

    # ------------------------------------------------------------------ forming
    def ensure(self) -> None:
        """Form the next generation if there is none yet or the current one ended.

        Raises:
            ElasticError: too few workers, the coordinator is gone, or the job finished.
            Exception: what ``build`` raised that is not a failure of the group.
        """
        if self.monitor.error is not None:
            raise self.coordinator_lost(self.monitor.error)
        if self.generation is not None and not self.ended.is_set():
            return
        reason = self.reason
        while True:
            started = time.monotonic()
            self.retire()
            try:
                generation = self.membership.join(reason)
            except (RuntimeError, dist.DistError) as exc:
                if isinstance(exc, ElasticError):
                    self._back_to_snapshot()
                    self.leave(str(exc))
                    raise
                raise self.coordinator_lost(exc) from exc
            ended = threading.Event()
            self.ended, self.generation = ended, generation
            try:
                self._form(generation, ended)
            except Exception as exc:
                if not self.is_failure(exc, generation.number):
                    self.leave(f"raised {brief(exc, 60)}")
                    raise
                reason = (f"worker {self.worker} failed while generation {generation.number} "
                          f"formed: {brief(exc)}")
                log.warning("elastic: %s", reason)
                ended.set()
                self.membership.end(generation.number, reason)
                continue
            self.last_formation_s = time.monotonic() - started
            log.warning("elastic: generation %d formed with %d worker(s), rank %d, at step %d, "
                        "in %.2f s", generation.number, generation.world_size,
                        generation.rank(self.worker), self.state.step, self.last_formation_s)
            return

    def _form(self, generation: Generation, ended: threading.Event) -> None:
        rank = generation.rank(self.worker)
        local_rank, local_size = generation.local(self.worker)
        launch = LaunchInfo(rank, generation.world_size, local_rank, local_size,
                            Launcher.EXPLICIT,
                            store=dist.PrefixStore(f"g{generation.number}/pg", self.store))
        comm = self.factory(launch, self.timeout, self.device)
        self.comm = comm
        self.monitor.watch(generation.number, functools.partial(self._on_end, ended, comm))
        state = self.state
        source = agree_on_source(comm, state)
        if source.snapshot:  # a sharded optimizer: back to the newest snapshot, on every member
            send_snapshot(comm, state, source.rank)
        elif source.needed:
            send_model(comm, state.model, source.rank)
            send_extra(comm, state.extra, source.rank)
            state.step = source.step
        if self.build is not None:
            self.reducer = self.build(comm, state)
        sharded = isinstance(state.optimizer, ShardedOptimizer)
        if source.snapshot:
            load_snapshot(state)
        elif source.needed and not sharded:  # (sharded, and no snapshot: the first formation)
            send_optimizer(comm, state.optimizer, source.rank)
        if sharded and state.snapshot is None:
            state.snapshot = take_snapshot(state)  # the first: every member at once
        state.synced = True

    def snapshot(self) -> None:
        """Take a snapshot of a sharded optimizer's full state (a collective), or end the
        generation when it fails."""
        try:
            self.state.snapshot = take_snapshot(self.state)
        except Exception as exc:
            if not self.is_failure(exc, self.number):
                raise
            self.fail(f"worker {self.worker} failed in the snapshot at step {self.state.step}: "
                      f"{brief(exc)}")

    def _back_to_snapshot(self) -> None:
        """Before raising ElasticError: a sharded optimizer's step may have stopped halfway
        (parameters partly gathered), so the model returns to the snapshot, whose full
        optimizer state stays in ``state.snapshot`` for a checkpoint."""
        snapshot = self.state.snapshot
        if snapshot is not None:
            self.state.model.load_state_dict(snapshot["model"])
            self.state.step = int(snapshot["step"])

    @staticmethod
    def _on_end(ended: threading.Event, comm: Communicator) -> None:
        comm.abort()  # first: whoever sees the flag finds the communicator aborted
        ended.set()

    def retire(self) -> None:
        """Leave the current generation: remove its reducer, abort and release its
        communicator (in a thread of its own: gloo's close waits for the collectives still
        running in the transport), drop the gradients."""
        reducer, self.reducer = self.reducer, None
        if reducer is not None:
            reducer.remove()
        comm, self.comm = self.comm, None
        if comm is not None:
            comm.abort()
            reaper = threading.Thread(target=comm.close, name="gradcomm-elastic-close",
                                      daemon=True)
            reaper.start()
            self._reapers.append(reaper)
        self.discard()

    def leave(self, reason: str) -> None:
        """Tell the others that this worker leaves on its own (they stop waiting for it)."""
        try:
            self.membership.leave(reason)
            if self.generation is not None:
                self.membership.end(self.generation.number,
                                    f"worker {self.worker} left: {reason}")
        except (RuntimeError, dist.DistError):
            pass  # the coordinator is gone: nobody is waiting for this worker's word

    def close(self) -> None:
        """Release the reducer and the communicators; wait up to ``timeout`` seconds for those
        of earlier generations, whose transport may still be ending a collective."""
        reducer, self.reducer = self.reducer, None
        if reducer is not None:
            reducer.remove()
        comm, self.comm = self.comm, None
        if comm is not None:
            comm.close()
        deadline = time.monotonic() + self.timeout
        for reaper in self._reapers:
            reaper.join(max(0.0, deadline - time.monotonic()))

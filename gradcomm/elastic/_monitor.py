"""The monitor thread: heartbeats for this worker, and the abort of a generation that ended.

A worker blocked in a collective cannot look at the store itself, so a thread of its own does:
every ``interval`` seconds it adds 1 to the worker's heartbeat counter and checks whether the
generation it watches has ended; then it calls the watcher's callback once (the communicator's
``abort()``), which makes the blocked collective raise within a tenth of a second. It talks to
the coordinator over a connection of its own, so it never waits behind the training thread's
store calls.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

import torch.distributed as dist

__all__ = ["Monitor"]

log = logging.getLogger("gradcomm.elastic")


class Monitor:
    """Heartbeat and end-of-generation watch of one worker (see the module docstring).

    Args:
        store: a connection to the coordinator (under the job's prefix) used by this thread only.
        heartbeat_key: the key whose counter this worker's heartbeat increments.
        interval: seconds between two heartbeats (and two looks at the watched generation).
    """

    def __init__(self, store: dist.Store, heartbeat_key: str, interval: float) -> None:
        self._store = store
        self._key = heartbeat_key
        self._interval = interval
        self._lock = threading.Lock()
        self._watched: tuple[int, Callable[[], None]] | None = None
        self._stop = threading.Event()
        #: The error that cut this worker off the coordinator (None while it answers).
        self.error: Exception | None = None
        self._store.add(self._key, 1)  # the key exists before anyone looks at it
        self._thread = threading.Thread(target=self._run, name="gradcomm-elastic-monitor",
                                        daemon=True)
        self._thread.start()

    def watch(self, number: int, on_end: Callable[[], None]) -> None:
        """Call ``on_end()`` once, from this thread, when generation ``number`` ends or the
        coordinator stops answering (replaces the previous watch)."""
        with self._lock:
            self._watched = (number, on_end)
        if self.error is not None:
            self._fire()

    def _fire(self) -> None:
        with self._lock:
            watched, self._watched = self._watched, None
        if watched is not None:
            log.debug("elastic monitor: generation %d ended", watched[0])
            try:
                watched[1]()
            except Exception:  # the thread must go on heartbeating
                log.exception("elastic monitor: ending generation %d failed", watched[0])

    def _run(self) -> None:
        while not self._stop.wait(self._interval):
            try:
                self._store.add(self._key, 1)
                with self._lock:
                    watched = self._watched
                if watched is not None and self._store.check([f"g{watched[0]}/end"]):
                    self._fire()
            except Exception as exc:  # noqa: BLE001 - the coordinator is gone: tell the worker
                self.error = exc
                log.error("elastic monitor: the coordinator stopped answering: %s", exc)
                self._fire()
                return

    def close(self) -> None:
        """Stop heartbeating (rounds then count this worker dead after the timeout, unless it
        left) and end the thread."""
        self._stop.set()
        self._thread.join(timeout=5.0)

"""Who is in the job: generations of members agreed through the coordinator's store.

A *generation* is a numbered list of workers, in rank order, that trains together over one
communicator. It ends when any worker sets its end key (a collective failed or timed out, a
worker joins, a member stopped heartbeating); every member's monitor thread then aborts the
communicator (:mod:`gradcomm.elastic._monitor`) and the live workers meet in a *round* that
forms the next generation. The round closes when every member of the ended generation has
arrived, left, or stopped heartbeating for ``heartbeat_timeout`` seconds (or has not arrived
within ``timeout`` while still heartbeating: stalled), and at least ``min_world_size`` workers
arrived; the first worker to see that writes the decision with ``compare_set`` (the first writer
wins, so every worker reads the same list). Survivors keep their order; newcomers follow in
order of arrival. The first generation waits for ``world_size`` workers, or for
``join_timeout`` seconds and then takes at least ``min_world_size``.

This is torchrun's c10d rendezvous reduced to what a step boundary needs (no restarts, one
round per change), over the same kind of store. Keys, under ``gradcomm-elastic/<job_id>/``:

=====================  ======================================================================
``gen``                a hint: the newest generation number (readers probe past it)
``g<n>/arrivals``      the workers that arrived at the round forming generation ``n`` (append)
``g<n>/info/<id>``     an arriving worker's host (for local ranks)
``g<n>/members``       the decision: ``{"members": [[id, host], ...]}`` or ``{"error": ...}``
``g<n>/end``           set once generation ``n`` is over; the value says why
``g<n>/done``          how many members finished training in generation ``n``
``g<n>/outcome``       the final agreement's decision: ``finished`` or ``re-form``
``g<n>/pg/...``        the communicator's rendezvous
``hb/<id>``            the worker's heartbeat counter (its monitor thread adds 1 regularly)
``left/<id>``          set when the worker left on its own (finished, or raised)
``finished``           set when every member of a generation finished: later joiners raise
=====================  ======================================================================
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch.distributed as dist

from .errors import ElasticError

__all__ = ["Generation", "Liveness", "Membership"]

log = logging.getLogger("gradcomm.elastic")

#: Seconds between two looks at the store while waiting for a round or the final agreement.
POLL_S = 0.02


@dataclass(frozen=True)
class Generation:
    """One agreed membership.

    Attributes:
        number: 1 for the first generation, then one more per re-formation.
        members: worker ids in rank order.
        hosts: each member's host name, in the same order.
    """

    number: int
    members: tuple[str, ...]
    hosts: tuple[str, ...]

    @property
    def world_size(self) -> int:
        """Number of members."""
        return len(self.members)

    def rank(self, worker: str) -> int:
        """``worker``'s rank. Raises ValueError when it is not a member."""
        return self.members.index(worker)

    def local(self, worker: str) -> tuple[int, int]:
        """``(local_rank, local_world_size)`` of ``worker`` among the members on its host."""
        host = self.hosts[self.rank(worker)]
        same = [w for w, h in zip(self.members, self.hosts, strict=True) if h == host]
        return same.index(worker), len(same)


class Liveness:
    """Which workers stopped heartbeating, as this process sees it.

    A worker is dead once its heartbeat counter (``hb/<id>``) has not changed for
    ``heartbeat_timeout`` seconds of this process's clock, counted from the first look: no clocks
    are compared across hosts.
    """

    def __init__(self, store: dist.Store, heartbeat_timeout: float,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._store = store
        self._timeout = heartbeat_timeout
        self._clock = clock
        self._seen: dict[str, tuple[bytes, float]] = {}

    def dead(self, workers: Sequence[str]) -> list[str]:
        """The workers of ``workers`` whose heartbeat has stood still for the timeout."""
        if not workers:
            return []
        now = self._clock()
        values = self._store.multi_get([f"hb/{w}" for w in workers])
        out = []
        for worker, value in zip(workers, values, strict=True):
            last = self._seen.get(worker)
            if last is None or last[0] != value:
                self._seen[worker] = (value, now)
            elif now - last[1] > self._timeout:
                out.append(worker)
        return out


def _text(raw: bytes) -> str:
    return raw.decode("utf-8", "replace")


class Membership:
    """This worker's side of the agreement on generations (see the module docstring).

    Args:
        store: the coordinator's store, under this job's prefix.
        worker: this worker's id (unique in the job).
        host: this worker's host name (workers on one host share local ranks).
        min_world_size: fewest workers a generation may have.
        world_size: workers the first generation waits for.
        timeout: seconds a round waits for a member that still heartbeats but does not arrive.
        heartbeat_timeout: seconds without a heartbeat after which a worker counts as dead.
        join_timeout: seconds a round with fewer than ``min_world_size`` workers (or the first,
            with fewer than ``world_size``) waits for more.
    """

    def __init__(self, store: dist.Store, worker: str, host: str, *, min_world_size: int,
                 world_size: int, timeout: float, heartbeat_timeout: float,
                 join_timeout: float) -> None:
        self.store = store
        self.worker = worker
        self.host = host
        self.min_world_size = min_world_size
        self.world_size = world_size
        self.timeout = timeout
        self.heartbeat_timeout = heartbeat_timeout
        self.join_timeout = join_timeout
        self.heartbeat_key = f"hb/{worker}"

    # ------------------------------------------------------------------ keys
    def _get(self, key: str) -> bytes | None:
        return self.store.get(key) if self.store.check([key]) else None

    def current(self) -> int:
        """The newest generation whose members are decided (0: none yet)."""
        raw = self._get("gen")
        number = int(raw) if raw else 0
        while self.store.check([f"g{number + 1}/members"]):  # the hint may lag
            number += 1
        return number

    def members_of(self, number: int) -> Generation:
        """Generation ``number``'s decided members.

        Raises:
            ElasticError: its round ended in an error (fewer than ``min_world_size`` workers).
        """
        decision = json.loads(self.store.get(f"g{number}/members"))
        if "error" in decision:
            raise ElasticError(decision["error"])
        members = decision["members"]
        return Generation(number, tuple(m[0] for m in members), tuple(m[1] for m in members))

    def ended(self, number: int) -> bool:
        """Whether generation ``number`` is over."""
        return bool(self.store.check([f"g{number}/end"]))

    def end_reason(self, number: int) -> str | None:
        """Why generation ``number`` ended (None: it has not)."""
        raw = self._get(f"g{number}/end")
        return None if raw is None else _text(raw)

    def end(self, number: int, reason: str) -> None:
        """End generation ``number`` (the first reason given is kept)."""
        if number >= 1:
            self.store.compare_set(f"g{number}/end", "", reason)

    def leave(self, reason: str) -> None:
        """Say that this worker leaves on its own: rounds stop waiting for it."""
        self.store.set(f"left/{self.worker}", reason)

    def finished(self) -> int | None:
        """The step at which the job finished, or None."""
        raw = self._get("finished")
        return None if raw is None else int(raw)

    def _raise_if_finished(self) -> None:
        done = self.finished()
        if done is not None:
            raise ElasticError(f"the job finished at step {done}; this worker came too late to "
                               "take part")

    # ------------------------------------------------------------------ rounds
    def join(self, reason: str) -> Generation:
        """Take part in the next round and return the generation it forms with this worker.

        Ends the current generation first (with ``reason``), so its members come to the round.
        A worker the round left out (it arrived after the decision) joins the one after.

        Raises:
            ElasticError: the round could not gather ``min_world_size`` workers within
                ``join_timeout`` (the same error on every worker that arrived), or the job has
                finished.
        """
        while True:
            self._raise_if_finished()
            current = self.current()
            target = current + 1
            self.store.set(f"g{target}/info/{self.worker}", self.host)
            # append: one atomic operation per arrival (torch >= 2.2; not in its type stubs)
            self.store.append(f"g{target}/arrivals",  # type: ignore[attr-defined]
                              f"{self.worker}\n")
            self.end(current, reason)
            generation = self._await(target)
            if self.worker in generation.members:
                return generation
            log.warning("worker %s arrived after generation %d was formed; joining the next",
                        self.worker, target)

    def _arrivals(self, number: int) -> list[str]:
        raw = self._get(f"g{number}/arrivals")
        seen: dict[str, None] = {}
        for worker in _text(raw or b"").split():
            seen.setdefault(worker)
        return list(seen)

    def _await(self, number: int) -> Generation:
        """Wait for the decision of round ``number``, taking it when this worker may."""
        prev = () if number == 1 else self.members_of(number - 1).members
        liveness = Liveness(self.store, self.heartbeat_timeout)
        started = time.monotonic()
        resolved_at: list[float] = []  # when every member of the ended generation was accounted
        key = f"g{number}/members"
        while not self.store.check([key]):
            self._raise_if_finished()
            decision = self._decide(number, prev, liveness, started, resolved_at)
            if decision is not None:
                self.store.compare_set(key, "", json.dumps(decision))
                if "members" in decision:
                    self.store.set("gen", str(number))
                break
            time.sleep(POLL_S)
        return self.members_of(number)

    def _decide(self, number: int, prev: Sequence[str], liveness: Liveness, started: float,
                resolved_at: list[float]) -> dict[str, object] | None:
        """The decision of round ``number`` if it may be taken now, else None."""
        now = time.monotonic()
        arrivals = self._arrivals(number)
        missing = [w for w in prev if w not in arrivals]
        if missing:
            gone = {w for w in missing if self.store.check([f"left/{w}"])}
            gone.update(liveness.dead([w for w in missing if w not in gone]))
            if len(gone) < len(missing) and now - started <= self.timeout:
                return None  # a live member is still on its way
        if not resolved_at:
            resolved_at.append(now)
        kept = [w for w in prev if w in arrivals] + [w for w in arrivals if w not in prev]
        waited = now - resolved_at[0]
        want = self.world_size if number == 1 else self.min_world_size
        if len(kept) < want and waited <= self.join_timeout:
            return None  # wait for more workers to join
        if len(kept) < self.min_world_size:
            after = "at the start" if number == 1 else f"after generation {number - 1} ended"
            return {"error": f"{len(kept)} worker(s) alive {after}, fewer than min_world_size="
                             f"{self.min_world_size}; none joined within {self.join_timeout:g} s"}
        hosts = self.store.multi_get([f"g{number}/info/{w}" for w in kept])
        return {"members": [[w, _text(h)] for w, h in zip(kept, hosts, strict=True)]}

    # ------------------------------------------------------------------ the end
    def finish(self, generation: Generation) -> bool:
        """Agree that every member of ``generation`` finished training: True once all said so;
        False when the generation ended first (re-form and look again; this worker ends it
        itself when a member stops heartbeating, or has not finished within ``timeout``). Every
        member gets the same answer: the first to see either outcome writes it
        (``compare_set``), and the others read it."""
        number = generation.number
        done_key, outcome_key = f"g{number}/done", f"g{number}/outcome"
        self.store.add(done_key, 1)
        others = [w for w in generation.members if w != self.worker]
        liveness = Liveness(self.store, self.heartbeat_timeout)
        started = time.monotonic()
        while not self.store.check([outcome_key]):
            outcome = None
            if int(self.store.add(done_key, 0)) >= generation.world_size:
                outcome = "finished"
            elif self.ended(number):
                outcome = "re-form"
            else:
                dead = liveness.dead(others)
                if dead or time.monotonic() - started > self.timeout:
                    who = f"worker {dead[0]} stopped heartbeating" if dead else (
                        f"a member did not finish within {self.timeout:g} s")
                    self.end(number, f"{who} before the end of training")
                    outcome = "re-form"
            if outcome is not None:
                self.store.compare_set(outcome_key, "", outcome)
                break
            time.sleep(POLL_S)
        return self.store.get(outcome_key) == b"finished"

    def mark_finished(self, step: int) -> None:
        """Tell later joiners that the job finished at ``step``."""
        self.store.compare_set("finished", "", str(step))

"""The agreement on generations (gradcomm.elastic._membership), with workers as threads of this
process over a coordinator it serves: formation, survivors' order, joiners, members that leave or
stop heartbeating, too few workers, and the final agreement."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch.distributed as dist

from gradcomm.elastic import ElasticError
from gradcomm.elastic._membership import Generation, Liveness, Membership
from gradcomm.elastic._monitor import Monitor
from gradcomm.elastic.coordinator import connect, serve

HEARTBEAT_TIMEOUT = 0.5


@pytest.fixture
def coordinator() -> Iterator[str]:
    store = serve("127.0.0.1", 0)
    yield f"127.0.0.1:{store.port}"


class Worker:
    """A Membership with a heartbeating monitor, as ElasticGroup sets them up."""

    def __init__(self, address: str, name: str, host: str = "h0", **options: Any) -> None:
        opts = {"min_world_size": 1, "world_size": 1, "timeout": 10.0,
                "heartbeat_timeout": HEARTBEAT_TIMEOUT, "join_timeout": 10.0, **options}
        client = connect(address, 10.0)
        self.membership = Membership(dist.PrefixStore("job", client), name, host, **opts)
        self.monitor = Monitor(dist.PrefixStore("job", client.clone()),
                               self.membership.heartbeat_key, 0.05)

    def stop(self) -> None:
        self.monitor.close()


def run(*calls: Callable[[], Any]) -> list[Any]:
    """Call each in a thread of its own; results (or the exception raised) in order."""
    out: list[Any] = [None] * len(calls)

    def target(i: int) -> None:
        try:
            out[i] = calls[i]()
        except Exception as exc:  # noqa: BLE001 - returned to the test
            out[i] = exc

    threads = [threading.Thread(target=target, args=(i,)) for i in range(len(calls))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    return out


def form(address: str, names: list[str], **options: Any) -> tuple[list[Worker], Generation]:
    workers = [Worker(address, n, **{"world_size": len(names), **options}) for n in names]
    gens = run(*[lambda w=w: w.membership.join("start") for w in workers])
    assert all(g == gens[0] for g in gens), gens
    return workers, gens[0]


def test_the_first_generation_waits_for_world_size_workers(coordinator: str) -> None:
    workers, gen = form(coordinator, ["a", "b", "c"])
    assert gen.number == 1 and sorted(gen.members) == ["a", "b", "c"]
    assert [gen.local(w) for w in gen.members] == [(0, 3), (1, 3), (2, 3)]  # one host
    assert workers[0].membership.current() == 1
    for w in workers:
        w.stop()


def test_local_ranks_count_the_members_on_each_host() -> None:
    gen = Generation(1, ("a", "b", "c", "d"), ("h0", "h1", "h0", "h1"))
    assert [gen.local(w) for w in gen.members] == [(0, 2), (0, 2), (1, 2), (1, 2)]
    assert gen.rank("c") == 2 and gen.world_size == 4


def test_survivors_keep_their_order_and_a_member_that_left_is_not_waited_for(
        coordinator: str) -> None:
    workers, gen = form(coordinator, ["a", "b", "c"])
    by_name = dict(zip(["a", "b", "c"], workers, strict=True))
    leaving = gen.members[1]
    by_name[leaving].membership.leave("done")
    stay = [by_name[n] for n in gen.members if n != leaving]
    start = time.monotonic()
    gens = run(*[lambda w=w: w.membership.join("failure") for w in stay])
    assert time.monotonic() - start < HEARTBEAT_TIMEOUT  # not waited for
    assert gens[0] == gens[1]
    assert gens[0].number == 2
    assert gens[0].members == tuple(n for n in gen.members if n != leaving)
    assert stay[0].membership.end_reason(1) == "failure"
    for w in workers:
        w.stop()


def test_a_member_that_stops_heartbeating_is_left_out_after_the_heartbeat_timeout(
        coordinator: str) -> None:
    workers, _ = form(coordinator, ["a", "b", "c"])
    dead, alive = workers[2], workers[:2]
    dead.stop()  # as a killed process: no heartbeat, no word
    start = time.monotonic()
    gens = run(*[lambda w=w: w.membership.join("a collective failed") for w in alive])
    took = time.monotonic() - start
    assert HEARTBEAT_TIMEOUT <= took < HEARTBEAT_TIMEOUT + 2.0
    assert gens[0] == gens[1] and gens[0].world_size == 2 and "c" not in gens[0].members
    for w in alive:
        w.stop()


def test_a_joiner_is_admitted_at_the_next_round(coordinator: str) -> None:
    workers, gen = form(coordinator, ["a", "b"])
    joiner = Worker(coordinator, "d")

    def members_come() -> list[Generation]:
        while not workers[0].membership.ended(1):  # the joiner ended generation 1
            time.sleep(0.01)
        return run(*[lambda w=w: w.membership.join("joined") for w in workers])

    got = run(lambda: joiner.membership.join("d joins"), members_come)
    new, (ga, gb) = got[0], got[1]
    assert new == ga == gb and new.number == 2
    assert new.members == (*gen.members, "d")
    assert workers[0].membership.end_reason(1) == "d joins"
    for w in [*workers, joiner]:
        w.stop()


def test_too_few_workers_raise_the_same_error_on_every_survivor(coordinator: str) -> None:
    workers, _ = form(coordinator, ["a", "b", "c"], min_world_size=3, join_timeout=0.3)
    workers[2].membership.leave("crashed")
    errors = run(*[lambda w=w: w.membership.join("failure") for w in workers[:2]])
    assert all(isinstance(e, ElasticError) for e in errors), errors
    assert {str(e) for e in errors} == {
        "2 worker(s) alive after generation 1 ended, fewer than min_world_size=3; none joined "
        "within 0.3 s"}
    for w in workers:
        w.stop()


def test_the_final_agreement_gives_every_member_the_same_answer(coordinator: str) -> None:
    workers, gen = form(coordinator, ["a", "b"])
    assert run(*[lambda w=w: w.membership.finish(gen) for w in workers]) == [True, True]
    workers[0].membership.mark_finished(7)
    late = Worker(coordinator, "z")
    with pytest.raises(ElasticError, match="the job finished at step 7; this worker came too"):
        late.membership.join("z joins")
    for w in [*workers, late]:
        w.stop()


def test_the_final_agreement_re_forms_when_the_generation_ends_first(coordinator: str) -> None:
    workers, gen = form(coordinator, ["a", "b"])
    first = run(lambda: workers[0].membership.finish(gen),
                lambda: (time.sleep(0.2), workers[1].membership.end(1, "a joiner"))[0])
    second = workers[1].membership.finish(gen)  # both are done now, but the outcome stands
    assert first[0] is False and second is False
    for w in workers:
        w.stop()


def test_liveness_counts_from_the_first_look_with_its_own_clock() -> None:
    store = dist.HashStore()
    store.add("hb/a", 1)
    store.add("hb/b", 1)
    now = [100.0]
    live = Liveness(store, 2.0, clock=lambda: now[0])
    assert live.dead(["a", "b"]) == []  # first look: nothing is known to be stale
    now[0] = 101.5
    store.add("hb/a", 1)
    assert live.dead(["a", "b"]) == []
    now[0] = 102.5  # b unchanged for 2.5 s, a changed 1 s ago
    assert live.dead(["a", "b"]) == ["b"]
    assert live.dead([]) == []

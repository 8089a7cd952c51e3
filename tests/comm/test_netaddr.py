"""Address choice and the reachability check, on one host (loopback, threads, a HashStore)."""

from __future__ import annotations

import itertools
import socket
import sys
import threading
import time
from typing import Any

import pytest
import torch.distributed as dist

from gradcomm.comm.launch.launcher import Launcher, LaunchInfo
from gradcomm.comm.launch.netaddr import (
    InterfaceAddress,
    interface_addresses,
    interface_of,
    matches_ifname,
    publish_candidates,
    route_source,
)
from gradcomm.comm.launch.reachability import bind_address, check_reachable, first_answering
from gradcomm.comm.launch.rendezvous import rendezvous

pytestmark = pytest.mark.timeout(60)

_IFACES = [
    InterfaceAddress("lo", "127.0.0.1"),
    InterfaceAddress("docker0", "172.17.0.1"),
    InterfaceAddress("eth0", "10.231.9.5"),
    InterfaceAddress("ib0", "10.231.10.5"),
]


@pytest.mark.parametrize(("spec", "nccl", "selected"), [
    ("eth0", False, {"eth0"}),
    ("eth0,ib0", False, {"eth0", "ib0"}),
    ("eth", False, set()),  # gloo wants exact names
    ("eth", True, {"eth0"}),  # NCCL: prefixes
    ("^docker,lo", True, {"eth0", "ib0"}),  # NCCL: exclusions
    ("=eth0", True, {"eth0"}),
    ("=eth", True, set()),
    ("^=lo", True, {"docker0", "eth0", "ib0"}),
])
def test_interface_variables_follow_gloo_and_nccl_rules(spec: str, nccl: bool,
                                                        selected: set[str]) -> None:
    got = {i.name for i in _IFACES if matches_ifname(i.name, spec, nccl_style=nccl)}
    assert got == selected


def test_candidates_never_loopback_across_hosts_and_bridges_last() -> None:
    assert publish_candidates(True, {}, _IFACES) == (["127.0.0.1"], None)
    assert publish_candidates(False, {}, _IFACES) == (
        ["10.231.9.5", "10.231.10.5", "172.17.0.1"], None)
    assert publish_candidates(False, {"GLOO_SOCKET_IFNAME": "ib0"}, _IFACES) == (
        ["10.231.10.5"], "GLOO_SOCKET_IFNAME")
    assert publish_candidates(False, {"NCCL_SOCKET_IFNAME": "^docker"}, _IFACES) == (
        ["10.231.9.5", "10.231.10.5"], "NCCL_SOCKET_IFNAME")
    # GLOO_SOCKET_IFNAME wins over NCCL_SOCKET_IFNAME; lo alone leaves nothing to publish.
    assert publish_candidates(
        False, {"GLOO_SOCKET_IFNAME": "lo", "NCCL_SOCKET_IFNAME": "eth"}, _IFACES
    ) == ([], "GLOO_SOCKET_IFNAME")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="interface ioctls are Linux's")
def test_this_host_has_loopback_and_routes_to_itself() -> None:
    assert InterfaceAddress("lo", "127.0.0.1") in interface_addresses()
    assert interface_of("127.0.0.1") == "lo"
    assert interface_of("192.0.2.254") is None  # TEST-NET: not on this host
    assert route_source("127.0.0.1") == "127.0.0.1"


def test_first_answering_skips_what_refuses() -> None:
    with socket.create_server(("127.0.0.1", 0)) as server:
        port = server.getsockname()[1]
        deadline = time.monotonic() + 10
        # The server is bound to 127.0.0.1 only, so 127.0.0.2 (also loopback) refuses.
        assert first_answering(["127.0.0.2", "127.0.0.1"], port, deadline) == ("127.0.0.1", "")
    chosen, why = first_answering(["127.0.0.1"], port, time.monotonic() + 10, rounds=2)
    assert chosen is None
    assert why == "127.0.0.1 (Connection refused)"


def _ranks(world: int, fn: Any, *args: Any) -> list[Any]:
    """Run ``fn(rank, *args)`` on ``world`` threads; each result or the exception raised."""
    out: list[Any] = [None] * world

    def body(rank: int) -> None:
        try:
            out[rank] = fn(rank, *args)
        except Exception as exc:  # noqa: BLE001 - the test reads it
            out[rank] = exc

    threads = [threading.Thread(target=body, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    return out


def _check(rank: int, store: dist.Store, world: int, addresses: list[str | None],
           problems: list[str], seconds: float) -> str:
    check_reachable(store, rank, world, addresses[rank], problems[rank],
                    time.monotonic() + seconds, "set THE_VARIABLE")
    return "ok"


def test_reachable_ranks_pass() -> None:
    store = dist.HashStore()
    assert _ranks(3, _check, store, 3, ["127.0.0.1"] * 3, [""] * 3, 10) == ["ok"] * 3


def test_more_peers_than_the_listen_backlog_pass(monkeypatch: pytest.MonkeyPatch) -> None:
    # A backlog of 1 stands in for net.core.somaxconn on a large job: the probes must be accepted
    # as they arrive, or the later connects time out and the check fails on every rank.
    real = socket.create_server

    def tiny_backlog(address: Any, *, backlog: int | None = None, **kw: Any) -> socket.socket:
        return real(address, backlog=1, **kw)

    monkeypatch.setattr("gradcomm.comm.launch.reachability.socket.create_server", tiny_backlog)
    store = dist.HashStore()
    assert _ranks(6, _check, store, 6, ["127.0.0.1"] * 6, [""] * 6, 20) == ["ok"] * 6


def test_one_rank_problem_raises_on_every_rank() -> None:
    store = dist.HashStore()
    out = _ranks(3, _check, store, 3, ["127.0.0.1", None, "127.0.0.1"],
                 ["", "rank 1: no address", ""], 10)
    for result in out:
        assert isinstance(result, RuntimeError)
        assert str(result) == "network check failed: rank 1: no address; set THE_VARIABLE"


def test_address_not_of_this_host_raises_on_every_rank() -> None:
    store = dist.HashStore()
    out = _ranks(2, _check, store, 2, ["127.0.0.1", "192.0.2.254"], ["", ""], 10)
    for result in out:
        assert isinstance(result, RuntimeError)
        assert str(result).startswith("network check failed: rank 1 cannot listen on "
                                      "192.0.2.254 (")


def test_a_missing_rank_ends_the_check_at_the_deadline() -> None:
    store = dist.HashStore()
    start = time.monotonic()
    out = _ranks(2, _check, store, 3, ["127.0.0.1"] * 3, [""] * 3, 1.5)  # rank 2 never comes
    assert time.monotonic() - start < 10
    for result in out:
        assert isinstance(result, RuntimeError)
        assert "rank 2 did not reach the network check in time" in str(result)


def test_user_interface_variable_wins() -> None:
    store = dist.HashStore()
    deadline = time.monotonic() + 5
    env = {"GLOO_SOCKET_IFNAME": "lo"}
    assert bind_address(store, 0, 2, "10.231.9.9", deadline, env, "GLOO_SOCKET_IFNAME") == (
        "127.0.0.1", "")
    address, problem = bind_address(store, 1, 2, "10.231.9.9", deadline,
                                    {"GLOO_SOCKET_IFNAME": "nosuch0"}, "GLOO_SOCKET_IFNAME")
    assert address is None
    assert problem == "rank 1: GLOO_SOCKET_IFNAME=nosuch0 names no interface with an IPv4 address"


@pytest.mark.parametrize("addr", ["127.0.0.1", "localhost"])
def test_loopback_master_addr_means_one_host_even_with_two_agents(
    addr: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # torchrun --nnodes 2 started twice on one machine: local_world_size 2 of 4, but only ranks
    # on rank 0's host reach a loopback store, so they meet as one host and bind nothing.
    # Threads share the per-process store counter that separate ranks each count alike.
    monkeypatch.setattr("gradcomm.comm.launch.rendezvous._store_ids", itertools.repeat(0))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    found: dict[int, Any] = {}

    def rank(r: int) -> None:
        try:
            found[r] = rendezvous(LaunchInfo(r, 4, r % 2, 2, Launcher.TORCHRUN, addr, port),
                                  20.0, "gloo")
        except Exception as exc:  # noqa: BLE001 - reported below
            found[r] = exc

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert sorted(found) == [0, 1, 2, 3]
    for r in range(4):
        assert not isinstance(found[r], Exception), found[r]
        assert found[r].bind_address is None and found[r].interface is None

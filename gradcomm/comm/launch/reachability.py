"""The address each rank binds its transport to, and a check that the ranks reach each other.

gloo and NCCL open connections between every pair of ranks after the rendezvous. When a rank
binds an address the others cannot reach (127.0.1.1 from a Debian ``/etc/hosts``, an interface
that leads nowhere), the rank that connects first fails while its peer keeps waiting. So before
the transport starts, each rank listens briefly on the address it will bind, every rank connects
to every other rank's listener, and the outcome is shared through the store: a failure raises
the same RuntimeError on every rank, within the timeout, naming the address and the variable
that would fix it.
"""

from __future__ import annotations

import datetime
import socket
import threading
import time
from collections.abc import Mapping, Sequence

import torch.distributed as dist

from .netaddr import (
    interface_addresses,
    is_loopback,
    matches_ifname,
    route_source,
)

__all__ = ["bind_address", "check_reachable", "first_answering"]

#: Seconds one TCP connect may take: a SYN to a routed address that drops it would otherwise
#: block for the kernel's retry schedule (minutes).
_CONNECT_S = 3.0
POLL_S = 0.01


def _reason(exc: OSError) -> str:
    if isinstance(exc, TimeoutError):
        return "timed out"
    return exc.strerror or type(exc).__name__


def first_answering(
    candidates: Sequence[str], port: int, deadline: float, rounds: int = 3
) -> tuple[str | None, str]:
    """The first of ``candidates`` that accepts a TCP connection on ``port``.

    Tries them in order, up to ``rounds`` times, until ``deadline`` (:func:`time.monotonic`).

    Returns:
        ``(address, "")``, or ``(None, why)`` where ``why`` lists each address with the last
        error it gave (e.g. ``"127.0.1.1 (Connection refused)"``).
    """
    errors: dict[str, str] = {}
    for attempt in range(rounds):
        for address in candidates:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            try:
                with socket.create_connection((address, port), timeout=min(left, _CONNECT_S)):
                    return address, ""
            except OSError as exc:
                errors[address] = _reason(exc)
        if attempt + 1 < rounds:
            time.sleep(max(0.0, min(0.5, deadline - time.monotonic())))
    why = ", ".join(f"{a} ({r})" for a, r in errors.items()) or "no time left"
    return None, why


def _user_interface_address(env: Mapping[str, str], variable: str | None) -> tuple[str, str] | None:
    """``(value, address)`` when ``variable`` is set: the address of the first interface it
    names (``""`` when it names none here)."""
    if variable is None or not env.get(variable, "").strip():
        return None
    spec = env[variable].strip()
    nccl_style = variable.startswith("NCCL")
    for iface in interface_addresses():
        if matches_ifname(iface.name, spec, nccl_style=nccl_style):
            return spec, iface.address
    return spec, ""


def _key_wait(store: dist.Store, key: str, deadline: float) -> bool:
    left = deadline - time.monotonic()
    if left <= 0:
        return False
    try:
        store.wait([key], datetime.timedelta(seconds=left))
    except (RuntimeError, dist.DistError):  # DistStoreError on timeout
        return False
    return True


def bind_address(
    store: dist.Store, rank: int, world_size: int, store_ip: str, deadline: float,
    env: Mapping[str, str], variable: str | None,
) -> tuple[str | None, str]:
    """The address this rank's transport should bind, on a job whose ranks span hosts.

    The user's ``variable`` (GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME) wins: its interface's
    address. Else the address this rank reaches the store from (``store_ip``: the address the
    rank connected to). That is loopback on the store's own host when the store was reached
    through a loopback address (e.g. MASTER_ADDR is a hostname that maps to 127.0.1.1 there);
    such a rank takes the address that routes to a rank elsewhere, read from the store, where
    every rank publishes the address it found.

    Returns:
        ``(address, "")``, or ``(None, problem)`` with a sentence saying why there is none;
        :func:`check_reachable` raises the problem on every rank.
    """
    chosen = _user_interface_address(env, variable)
    if chosen is not None:
        spec, address = chosen
        store.set(f"addr/{rank}", address)
        if not address:
            return None, f"rank {rank}: {variable}={spec} names no interface with an IPv4 address"
        return address, ""
    mine = route_source(store_ip) or ""
    store.set(f"addr/{rank}", "" if is_loopback(mine) else mine)
    if mine and not is_loopback(mine):
        return mine, ""
    local = {i.address for i in interface_addresses()}
    # Ranks are usually numbered host by host, so a rank on another host is likelier at the end.
    for peer in reversed(range(world_size)):
        if peer == rank or not _key_wait(store, f"addr/{peer}", deadline):
            continue
        address = store.get(f"addr/{peer}").decode()
        if address and address not in local:
            source = route_source(address)
            if source is not None and not is_loopback(source):
                return source, ""
    return None, (f"rank {rank} found no non-loopback address that routes to another host "
                  f"(store at {store_ip})")


def check_reachable(
    store: dist.Store, rank: int, world_size: int, address: str | None, problem: str,
    deadline: float, hint: str,
) -> None:
    """Check, on every rank at once, that every rank can connect to every other's ``address``.

    Each rank listens on ``address`` (port picked by the OS) and publishes it; each rank then
    connects to every other rank's listener (as many connections as gloo's full mesh). A rank
    with a ``problem`` (or no ``address``) records it instead. Every rank waits until all have
    finished.

    Args:
        store: a store of these ranks (a key prefix of its own).
        hint: what would fix a failure, e.g. ``"set GLOO_SOCKET_IFNAME to an interface every
            host reaches"``.

    Raises:
        RuntimeError: on every rank, when any rank cannot listen on or reach an address
            (naming it), or when not every rank finished the check by ``deadline``.
    """
    listener = None
    drain = None
    if address is not None and not problem:
        try:
            listener = socket.create_server((address, 0), backlog=min(world_size, 4096))
        except OSError as exc:
            problem = f"rank {rank} cannot listen on {address} ({_reason(exc)})"
        else:
            # Accept (and drop) the peers' probes as they come: an unaccepted backlog fills at
            # net.core.somaxconn and later connects would time out, failing large jobs falsely.
            listener.settimeout(POLL_S)
            drain = threading.Thread(target=_drain, args=(listener,), daemon=True,
                                     name="gradcomm-network-check")
            drain.start()
    try:
        port = listener.getsockname()[1] if listener is not None else 0
        store.set(f"probe/{rank}", f"{address}:{port}" if listener is not None else "")
        if not problem:
            problem = _probe_peers(store, rank, world_size, address, deadline)
        if problem:
            store.compare_set("error", "", f"{problem}; {hint}")
        done = int(store.add("done", 1))
        while done < world_size and time.monotonic() < deadline:
            time.sleep(POLL_S)
            done = int(store.add("done", 0))
    finally:
        if listener is not None:
            listener.close()  # ends _drain at its next accept
        if drain is not None:
            drain.join(5 * POLL_S + 1.0)
    if store.check(["error"]):
        raise RuntimeError(f"network check failed: {store.get('error').decode()}")
    if done < world_size:
        raise RuntimeError(f"network check: only {done} of {world_size} ranks finished it "
                           f"in time; a rank may have died or be stuck before it; {hint}")


def _drain(listener: socket.socket) -> None:
    """Accept and close connections on ``listener`` until it is closed."""
    while listener.fileno() != -1:
        try:
            conn, _ = listener.accept()
        except TimeoutError:
            continue
        except OSError:  # closed under us
            return
        conn.close()


def _probe_peers(
    store: dist.Store, rank: int, world_size: int, address: str | None, deadline: float
) -> str:
    # Every peer, not one per distinct address: hosts may share an address (a docker0 bridge on
    # each), and a connection to it would then succeed on this host's own interface.
    for offset in range(1, world_size):
        peer = (rank + offset) % world_size
        if not _key_wait(store, f"probe/{peer}", deadline):
            return f"rank {peer} did not reach the network check in time (seen from rank {rank})"
        published = store.get(f"probe/{peer}").decode()
        if not published:
            continue  # that rank records its own problem
        host, port = published.rsplit(":", 1)
        left = deadline - time.monotonic()
        try:
            with socket.create_connection((host, int(port)), timeout=max(0.1, min(left,
                                                                                  _CONNECT_S))):
                pass
        except OSError as exc:
            return (f"rank {rank} ({address}) cannot reach rank {peer} at {host}:{port} "
                    f"({_reason(exc)})")
    return ""

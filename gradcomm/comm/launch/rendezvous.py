"""Rendezvous for the torch.distributed backends: a store every rank reaches, and the address
each rank's transport binds.

Store, in order of preference:

1. ``MASTER_ADDR`` and ``MASTER_PORT`` set (torchrun sets them; users may): a
   :class:`torch.distributed.TCPStore` there. Under torchrun's agent store rank 0 joins as a client.
2. Started by an MPI launcher with neither set (also with an explicit rank and world size, which
   must then match MPI's): rank 0 opens a TCPStore on a free port (the OS picks it, so there is
   no race) and broadcasts the port and its candidate addresses with mpi4py: 127.0.0.1 when all
   ranks share its host, else every non-loopback address of its interfaces (only those
   GLOO_SOCKET_IFNAME or NCCL_SOCKET_IFNAME name, when set). Each rank connects to the first
   that answers; if one rank reaches none, every rank raises, listing what was tried.
3. world_size 1: an in-memory :class:`torch.distributed.HashStore` (no collective is ever issued).

Bind address (ranks on several hosts only; see :mod:`gradcomm.comm._reachability`): the address
the rank reached the store from, unless the backend's interface variable is set; then every rank
checks that it reaches every other rank's address, so a bad address is an error on every rank
instead of a wait. The hostname is never trusted alone: Debian maps it to 127.0.1.1.

Each communicator gets its own key prefix, so it never collides with a user's default process
group that uses the same store.
"""

from __future__ import annotations

import datetime
import itertools
import os
import time
from collections.abc import Mapping
from dataclasses import dataclass

import torch.distributed as dist

from ..backends.mpi.abort import abort_on_error_enabled, install_abort_hook
from .launcher import Launcher, LaunchInfo, check_launch_matches_mpi, started_by_mpi_launcher
from .netaddr import interface_of, is_loopback, publish_candidates, resolve_ipv4
from .reachability import POLL_S, bind_address, check_reachable, first_answering

__all__ = ["Rendezvous", "create_store", "rendezvous"]

_store_ids = itertools.count()


@dataclass(frozen=True)
class Rendezvous:
    """What :func:`rendezvous` found.

    Attributes:
        store: a store of every rank, under a key prefix of this communicator's own.
        bind_address: the IPv4 address this rank's transport should bind; None when every rank
            runs on this host (loopback then works, and the transport's default is kept) or
            world_size is 1.
        interface: the name of the interface carrying ``bind_address`` (None if unknown).
    """

    store: dist.Store
    bind_address: str | None = None
    interface: str | None = None


def _timedelta(timeout: float | None) -> datetime.timedelta:
    # torch stores need a finite timeout; "forever" is a day.
    return datetime.timedelta(seconds=86400 if timeout is None else timeout)


def _unreachable_hint(variable: str | None) -> str:
    return f"set {variable or 'GLOO_SOCKET_IFNAME'} (an interface all hosts reach) or MASTER_ADDR"


def _store_via_mpi(
    launch: LaunchInfo, timeout: datetime.timedelta, env: Mapping[str, str],
    variable: str | None,
) -> tuple[dist.Store, str, bool]:
    """``(store, address this rank connected to, all ranks on one host)`` through MPI."""
    try:
        from mpi4py import MPI
    except ImportError as exc:
        raise ImportError(
            "started by an MPI launcher without MASTER_ADDR/MASTER_PORT: the rendezvous through "
            "MPI needs mpi4py (pip install mpi4py), or set MASTER_ADDR and MASTER_PORT"
        ) from exc
    if abort_on_error_enabled():
        install_abort_hook()  # MPI is initialised now: a dead rank must not hang MPI_Finalize
    comm = MPI.COMM_WORLD
    check_launch_matches_mpi(comm, launch)  # on every rank alike, before the broadcast below
    # MPI knows which ranks share a host even where the launcher's variables do not say.
    node = comm.Split_type(MPI.COMM_TYPE_SHARED)
    single_host = node.Get_size() == comm.Get_size()
    node.Free()
    deadline = time.monotonic() + timeout.total_seconds()
    store: dist.Store | None = None
    offer: tuple[list[str], int] | None = None
    error: str | None = None
    if launch.rank == 0:
        candidates, setting = publish_candidates(single_host, env)
        if not candidates:
            where = f" on {setting}={env[setting].strip()}" if setting else ""
            error = (f"rank 0 has no non-loopback IPv4 address{where} for the other hosts; "
                     f"{_unreachable_hint(variable)}")
        else:
            try:
                server = dist.TCPStore(candidates[0], 0, launch.world_size, True, timeout=timeout,
                                       wait_for_workers=False)
                store, offer = server, (candidates, server.port)
            except Exception as exc:  # noqa: BLE001 - every rank must learn of the failure
                error = f"rank 0 could not open a TCPStore: {exc}"
    offer, error = comm.bcast((offer, error), root=0)
    if error is not None or offer is None:
        raise RuntimeError(error or "rendezvous through MPI failed")
    candidates, port = offer
    if launch.rank == 0:
        chosen, why = candidates[0], ""
    else:
        chosen, why = first_answering(candidates, port, deadline)
    outcomes = comm.allgather(why if chosen is None else None)
    failed = [(r, w) for r, w in enumerate(outcomes) if w is not None]
    if failed:  # raised on every rank, so that none waits for the others
        r, w = failed[0]
        tried = w if len(w) <= 48 else w[:45] + "..."  # the message stays within 200 chars
        raise RuntimeError(f"{len(failed)} rank(s) reached no address of rank 0's store (port "
                           f"{port}); rank {r} tried {tried}; {_unreachable_hint(variable)}")
    if store is None:
        store = dist.TCPStore(chosen, port, launch.world_size, False, timeout=timeout)
    return store, str(chosen), single_host


def _store_at_master(launch: LaunchInfo, timeout: datetime.timedelta) -> tuple[dist.Store, str]:
    """``(store, address connected to)`` at MASTER_ADDR:MASTER_PORT."""
    addr, port = str(launch.master_addr), int(launch.master_port or 0)
    try:
        store = dist.TCPStore(addr, port, launch.world_size,
                              launch.rank == 0 and not launch.agent_store, timeout=timeout)
    except (RuntimeError, dist.DistError) as exc:  # DistStoreError / DistNetworkError
        raise RuntimeError(
            f"rank {launch.rank} could not reach the store at MASTER_ADDR={addr} "
            f"MASTER_PORT={port} within {timeout.total_seconds():g} s: is it rank 0's address, "
            "reachable from this host?"
        ) from exc
    resolved = resolve_ipv4(addr)
    return store, resolved[0] if resolved else addr


def rendezvous(
    launch: LaunchInfo,
    timeout: float | None,
    backend: str,
    *,
    interface_variable: str | None = None,
    env: Mapping[str, str] | None = None,
    bind: bool = True,
) -> Rendezvous:
    """Meet the other ranks of ``launch``: a shared store, and the address to bind.

    Args:
        launch: this process's place in the job and the rendezvous address its environment gave
            (``launch.master_addr``/``master_port``, read by :func:`detect_launch`).
        timeout: seconds to wait for the other ranks, per phase (``None``: a day).
        backend: backend name, part of the key prefix.
        interface_variable: the variable that names the backend's interface
            (``"GLOO_SOCKET_IFNAME"``, ``"NCCL_SOCKET_IFNAME"``); when set in ``env`` it wins.
        env: read for those variables (default :data:`os.environ`).
        bind: choose and check a bind address (False: only the store, for a transport that
            picks its own interface).

    A loopback MASTER_ADDR means every rank is on rank 0's host (no other host reaches it): the
    transport's default address is kept.

    Raises:
        RuntimeError: world_size > 1, no MASTER_ADDR/MASTER_PORT and no MPI launcher to
            rendezvous through; the store could not be reached within the timeout; or (on
            every rank) no address was found that every rank reaches, naming the addresses
            tried and the variable that would fix it.
        ImportError: an MPI launcher without MASTER_ADDR/MASTER_PORT and no mpi4py.
    """
    env = os.environ if env is None else env
    td = _timedelta(timeout)
    prefix = f"gradcomm/{backend}/{next(_store_ids)}"
    if launch.world_size == 1:
        return Rendezvous(dist.PrefixStore(prefix, dist.HashStore()))
    if launch.master_addr is not None and launch.master_port is not None:
        store, store_ip = _store_at_master(launch, td)
        single_host = launch.local_world_size == launch.world_size
    elif launch.launcher.is_mpi or (
        launch.launcher is Launcher.EXPLICIT and started_by_mpi_launcher()
    ):  # explicit rank/world_size under mpirun: checked against MPI's in _store_via_mpi
        store, store_ip, single_host = _store_via_mpi(launch, td, env, interface_variable)
    else:
        raise RuntimeError(
            f"{launch.world_size} ranks started by {launch.launcher.value} need a rendezvous: set "
            "MASTER_ADDR and MASTER_PORT, or launch with torchrun or mpirun"
        )
    shared = dist.PrefixStore(prefix, store)
    deadline = time.monotonic() + td.total_seconds()
    if not single_host and bind and launch.master_addr is not None:
        # Only ranks on rank 0's host reach a loopback store: when every rank did, the job runs
        # on one host, even with several launcher agents (torchrun --nnodes 2 twice on a machine).
        single_host = _all_over_loopback(dist.PrefixStore("loopback", shared), launch.world_size,
                                         is_loopback(store_ip), deadline)
    if single_host or not bind:
        return Rendezvous(shared)
    net = dist.PrefixStore("net", shared)
    address, problem = bind_address(net, launch.rank, launch.world_size, store_ip, deadline,
                                    env, interface_variable)
    check_reachable(net, launch.rank, launch.world_size, address, problem, deadline,
                    _unreachable_hint(interface_variable))
    return Rendezvous(shared, address, None if address is None else interface_of(address))


def _all_over_loopback(store: dist.Store, world_size: int, loopback: bool,
                       deadline: float) -> bool:
    """Whether every rank reached the store over loopback (one counter, one arrival count).

    Raises:
        RuntimeError: not every rank arrived by ``deadline``.
    """
    store.add("loopback", int(loopback))
    arrived = int(store.add("arrived", 1))
    while arrived < world_size:
        if time.monotonic() > deadline:
            raise RuntimeError(f"only {arrived} of {world_size} ranks reached the store in time")
        time.sleep(POLL_S)
        arrived = int(store.add("arrived", 0))
    return int(store.add("loopback", 0)) == world_size


def create_store(launch: LaunchInfo, timeout: float | None, backend: str) -> dist.Store:
    """Return a store shared by all ranks of ``launch``, under a key prefix of its own
    (:func:`rendezvous`'s store without a bind address; the same arguments and errors)."""
    return rendezvous(launch, timeout, backend, bind=False).store

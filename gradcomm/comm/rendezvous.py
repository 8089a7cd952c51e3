"""Rendezvous for the torch.distributed backends: a key-value store every rank can reach.

Order of preference:

1. ``MASTER_ADDR`` and ``MASTER_PORT`` set (torchrun sets them; users may): a
   :class:`torch.distributed.TCPStore` there. Under torchrun's agent store rank 0 joins as a client.
2. Started by an MPI launcher with neither set (also with an explicit rank and world size, which
   must then match MPI's): rank 0 opens a TCPStore on a free port (the OS picks it, so there is
   no race) and broadcasts ``(address, port)`` to the other ranks with mpi4py.
3. world_size 1: an in-memory :class:`torch.distributed.HashStore` (no collective is ever issued).

Each communicator gets its own key prefix, so it never collides with a user's default process
group that uses the same store.
"""

from __future__ import annotations

import datetime
import itertools
import socket

import torch.distributed as dist

from .launcher import Launcher, LaunchInfo, check_launch_matches_mpi, started_by_mpi_launcher
from .mpi_abort import abort_on_error_enabled, install_abort_hook

__all__ = ["create_store"]

_store_ids = itertools.count()


def _timedelta(timeout: float | None) -> datetime.timedelta:
    # torch stores need a finite timeout; "forever" is a day.
    return datetime.timedelta(seconds=86400 if timeout is None else timeout)


def _host_address(launch: LaunchInfo) -> str:
    if launch.local_world_size == launch.world_size:
        return "127.0.0.1"  # every rank is on this host
    return socket.gethostbyname(socket.getfqdn())


def _store_via_mpi(launch: LaunchInfo, timeout: datetime.timedelta) -> dist.Store:
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
    store: dist.Store | None = None
    address: tuple[str, int] | None = None
    error: str | None = None
    if launch.rank == 0:
        try:
            host = _host_address(launch)
            server = dist.TCPStore(
                host, 0, launch.world_size, True, timeout=timeout, wait_for_workers=False
            )
            store, address = server, (host, server.port)
        except Exception as exc:  # noqa: BLE001 - every rank must learn of the failure
            error = f"rank 0 could not open a TCPStore: {exc}"
    address, error = comm.bcast((address, error), root=0)
    if error is not None or address is None:
        raise RuntimeError(error or "rendezvous through MPI failed")
    if store is None:
        store = dist.TCPStore(address[0], address[1], launch.world_size, False, timeout=timeout)
    return store


def create_store(launch: LaunchInfo, timeout: float | None, backend: str) -> dist.Store:
    """Return a store shared by all ranks of ``launch``, under a key prefix of its own.

    Args:
        launch: this process's place in the job and the rendezvous address its environment gave
            (``launch.master_addr``/``master_port``, read by :func:`detect_launch`).
        timeout: seconds to wait for the other ranks to connect (``None``: a day).
        backend: backend name, part of the key prefix.

    Raises:
        RuntimeError: world_size > 1, no MASTER_ADDR/MASTER_PORT and no MPI launcher to
            rendezvous through; or the TCPStore could not be reached within the timeout.
        ImportError: an MPI launcher without MASTER_ADDR/MASTER_PORT and no mpi4py.
    """
    td = _timedelta(timeout)
    prefix = f"gradcomm/{backend}/{next(_store_ids)}"
    if launch.world_size == 1:
        return dist.PrefixStore(prefix, dist.HashStore())
    if launch.master_addr is not None and launch.master_port is not None:
        store: dist.Store = dist.TCPStore(
            launch.master_addr, launch.master_port, launch.world_size,
            launch.rank == 0 and not launch.agent_store, timeout=td,
        )
    elif launch.launcher.is_mpi or (
        launch.launcher is Launcher.EXPLICIT and started_by_mpi_launcher()
    ):  # explicit rank/world_size under mpirun: checked against MPI's in _store_via_mpi
        store = _store_via_mpi(launch, td)
    else:
        raise RuntimeError(
            f"{launch.world_size} ranks started by {launch.launcher.value} need a rendezvous: set "
            "MASTER_ADDR and MASTER_PORT, or launch with torchrun or mpirun"
        )
    return dist.PrefixStore(prefix, store)

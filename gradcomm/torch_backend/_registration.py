"""Registration of "gradcomm" with torch.distributed, and the group creator torch calls.

``register()`` (run by ``import gradcomm``) calls torch's public ``Backend.register_backend``
with ``extended_api=True``: torch then calls :func:`create_process_group` with the group's store,
rank, size, timeout, name and global ranks, and the ``pg_options`` given to
``init_process_group`` or ``new_group``. Nothing here imports a transport: the communicators are
built when the first group is.

The default group's communicators come from :func:`gradcomm.init` over torch's store (one per
device type: CPU always, CUDA where a device is usable), so gradcomm's settings check under an
MPI launcher, ``GRADCOMM_DEBUG`` and ``GRADCOMM_PROFILE`` apply. A group made by ``new_group`` is
built by its members alone (torch calls the creator on members only) with
:meth:`gradcomm.Communicator.subgroup` of the default group's communicators, on the default
group's engine thread (the only thread that uses them).
"""

from __future__ import annotations

import datetime
import itertools
import os
import threading
from typing import Any

import torch
import torch.distributed as dist

from gradcomm.comm import Communicator, detect_launch, init

from ._launch import install_env_rendezvous
from ._options import Options, transport_for
from ._process_group import ProcessGroupGradcomm
from ._work import GradcommWork

__all__ = ["BACKEND_NAME", "register", "create_process_group"]

#: The name to pass to ``init_process_group``.
BACKEND_NAME = "gradcomm"
_registered = False
_lock = threading.Lock()
_names = itertools.count()


def register() -> None:
    """Make "gradcomm" a torch.distributed backend for CPU and CUDA tensors. Idempotent.

    Also lets ``env://`` (``init_process_group``'s default) meet through gradcomm's rendezvous
    under an MPI launcher or srun when ``MASTER_ADDR``/``RANK`` are unset
    (:func:`~gradcomm.torch_backend._launch.install_env_rendezvous`).
    """
    global _registered
    with _lock:
        if _registered:
            return
        dist.Backend.register_backend(BACKEND_NAME, create_process_group, extended_api=True,
                                      devices=["cpu", "cuda"])
        install_env_rendezvous()
        _registered = True


def _seconds(timeout: datetime.timedelta | None) -> float | None:
    """The group's timeout in seconds: torch's, unless torch passed its default and
    ``GRADCOMM_TIMEOUT`` is set (None: :func:`gradcomm.init` then reads it)."""
    default = dist.constants.default_pg_timeout
    if os.environ.get("GRADCOMM_TIMEOUT", "").strip() and timeout in (None, default):
        return None
    return (timeout or default).total_seconds()


def _device_types() -> list[str]:
    return ["cpu", "cuda"] if torch.cuda.is_available() else ["cpu"]


def create_process_group(opts: Any, pg_options: Any = None) -> ProcessGroupGradcomm:
    """torch's creator of a "gradcomm" group (``extended_api``): ``opts`` has ``store``,
    ``group_rank``, ``group_size``, ``timeout``, ``group_id`` and ``global_ranks_in_group``
    (empty for the default group).

    Raises:
        TypeError: ``pg_options`` is not a :class:`~gradcomm.torch_backend.Options`.
        ValueError: a sub-group without a default "gradcomm" group, or options naming other
            transports than the default group's.
        What :func:`gradcomm.init` raises for the default group's communicators.
    """
    if pg_options is not None and not isinstance(pg_options, Options):
        raise TypeError(f"pg_options of the gradcomm backend must be "
                        f"gradcomm.torch_backend.Options, got {type(pg_options).__name__}")
    seconds = _seconds(opts.timeout)
    rank, size = opts.group_rank, opts.group_size
    name = f"pg{next(_names)}"
    ranks = list(opts.global_ranks_in_group)
    if not ranks:
        comms = _world_comms(opts.store, rank, size, seconds, pg_options)
        return ProcessGroupGradcomm(rank, size, comms, name, seconds or comms["cpu"].timeout)
    world = dist.group.WORLD  # torch's default group: the parent of every new_group
    if not isinstance(world, ProcessGroupGradcomm):
        raise ValueError("new_group(backend='gradcomm') needs a default group made by "
                         "init_process_group('gradcomm')")
    if pg_options is not None and pg_options.transport is not None and any(
            transport_for(k, pg_options) != c.backend for k, c in world.communicators.items()):
        raise ValueError("a gradcomm sub-group uses the default group's transports; its "
                         "Options may only repeat them")
    return _subgroup(world, ranks, rank, size, name, seconds)


def _world_comms(store: dist.Store, rank: int, size: int, seconds: float | None,
                 options: Options | None) -> dict[str, Communicator]:
    launch = detect_launch()
    local_rank = launch.local_rank if (launch.rank, launch.world_size) == (rank, size) else rank
    comms: dict[str, Communicator] = {}
    try:
        for kind in _device_types():
            transport = transport_for(kind, options)
            device = "cpu" if kind == "cpu" else None  # None: the transport's cuda:local_rank
            if transport == "mpi" and kind == "cuda":
                device = "cuda"
            comms[kind] = init(transport, rank=rank, world_size=size, local_rank=local_rank,
                               timeout=seconds, device=device,
                               store=dist.PrefixStore(f"gradcomm/{kind}/", store))
    except BaseException:
        for comm in comms.values():
            comm.close()
        raise
    return comms


def _subgroup(world: ProcessGroupGradcomm, ranks: list[int], rank: int, size: int, name: str,
              seconds: float | None) -> ProcessGroupGradcomm:
    """A group of ``ranks`` (the default group's), built by its members on the default group's
    engine thread."""
    built: dict[str, Communicator] = {}

    def body() -> None:
        for kind, comm in world.communicators.items():
            built[kind] = comm.subgroup(ranks)

    work = world._engine.submit(body, GradcommWork([], f"new_group {ranks}"))
    work.wait()
    if any(c.rank != rank or c.world_size != size for c in built.values()):  # pragma: no cover
        raise RuntimeError(f"gradcomm sub-group {ranks}: rank {rank} of {size} expected")
    return ProcessGroupGradcomm(rank, size, built, name, seconds or built["cpu"].timeout)

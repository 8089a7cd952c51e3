"""``init_process_group``'s default ``env://`` under mpiexec or srun, without torchrun's variables.

torch's ``env://`` needs ``MASTER_ADDR``, ``MASTER_PORT``, ``RANK`` and ``WORLD_SIZE``; mpiexec and
srun set none of them. :func:`install_env_rendezvous` puts a handler in front of torch's: when
all four are set (torchrun, or the user) torch's own runs, unchanged; when some are missing and
gradcomm's launcher detection finds an MPI launcher or SLURM, rank and world size come from it
and the store from gradcomm's rendezvous (a TCPStore at ``MASTER_ADDR``/``MASTER_PORT`` when
set, else one that rank 0 opens and announces over MPI, which needs mpi4py); otherwise torch's
handler runs and raises its usual error. It serves every backend named in ``init_process_group``,
gloo included.

torch has no public way to change the handler of an existing scheme (``register_rendezvous_handler``
refuses one that is registered), so this module replaces the entry in
``torch.distributed.rendezvous._rendezvous_handlers`` (torch's private name, used here and
nowhere else in the package). The store comes from
:func:`gradcomm.comm.launch.rendezvous.create_store`, the rendezvous :func:`gradcomm.init` runs.
"""

from __future__ import annotations

import datetime
import importlib
import os
from collections.abc import Iterator
from typing import Any
from urllib.parse import urlparse

import torch.distributed as dist

from gradcomm.comm import Launcher, detect_launch
from gradcomm.comm.launch.rendezvous import create_store

__all__ = ["install_env_rendezvous", "env_rendezvous"]

_TORCHRUN_VARIABLES = ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE")
_torch_env_handler: Any = None


def install_env_rendezvous() -> None:
    """Put :func:`env_rendezvous` in front of torch's ``env://`` handler. Idempotent."""
    global _torch_env_handler
    # the module: torch.distributed.rendezvous, the attribute, is its function of that name
    handlers = importlib.import_module("torch.distributed.rendezvous")._rendezvous_handlers
    if handlers.get("env") is env_rendezvous:
        return
    _torch_env_handler = handlers["env"]
    handlers["env"] = env_rendezvous


def env_rendezvous(url: str, timeout: datetime.timedelta = dist.constants.default_pg_timeout,
                   **kwargs: Any) -> Iterator[tuple[dist.Store, int, int]]:
    """torch's ``env://`` handler, or gradcomm's rendezvous where the launcher set no torchrun
    variables (see the module docstring). Yields ``(store, rank, world_size)`` once.

    Raises:
        ValueError: torch's, when no launcher gradcomm knows gives rank and world size.
        RuntimeError, ImportError: gradcomm's rendezvous failed (no address reaches rank 0, no
            mpi4py under an MPI launcher without ``MASTER_ADDR``, ...).
    """
    query = dict(p.split("=", 1) for p in urlparse(url).query.split("&") if "=" in p)
    explicit = "rank" in query and "world_size" in query  # init_process_group's arguments
    if (all(os.environ.get(v, "").strip() for v in _TORCHRUN_VARIABLES)
            or ("rank" in query) != ("world_size" in query)):
        yield from _torch_env_handler(url, timeout=timeout, **kwargs)
        return
    launch = detect_launch(rank=int(query["rank"]) if explicit else None,
                           world_size=int(query["world_size"]) if explicit else None)
    from_launcher = launch.launcher.is_mpi or launch.launcher is Launcher.SLURM or (
        launch.launcher is Launcher.EXPLICIT and _under_mpi_or_slurm())
    if not from_launcher or (launch.world_size == 1 and launch.launcher is Launcher.EXPLICIT):
        yield from _torch_env_handler(url, timeout=timeout, **kwargs)
        return
    store = create_store(launch, timeout.total_seconds(), "torch-env")
    yield store, launch.rank, launch.world_size
    raise RuntimeError("gradcomm's env:// rendezvous cannot run again in this process")


def _under_mpi_or_slurm() -> bool:
    found = detect_launch()
    return found.launcher.is_mpi or found.launcher is Launcher.SLURM

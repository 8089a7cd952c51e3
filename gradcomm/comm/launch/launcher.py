"""Launcher detection: rank, world size and local rank from the environment a launcher set.

No MPI library is imported here (importing mpi4py initialises MPI), so detection is cheap and safe
in any process. Precedence, first match wins: explicit arguments > torchrun > MPI launchers
(Open MPI, MPICH/Hydra and Intel MPI, PMIx, MVAPICH2) > SLURM > a single process.
"""

from __future__ import annotations

import enum
import numbers
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

__all__ = [
    "Launcher",
    "LaunchInfo",
    "check_launch_matches_mpi",
    "cpus_per_local_process",
    "detect_launch",
    "launch_mismatch",
    "started_by_mpi_launcher",
]


class Launcher(enum.Enum):
    """Who started this process (and so which variables gave its rank)."""

    EXPLICIT = "explicit"
    TORCHRUN = "torchrun"
    OPEN_MPI = "open-mpi"
    MPICH = "mpich"  # MPICH's Hydra and Intel MPI (PMI_RANK / PMI_SIZE)
    PMIX = "pmix"
    MVAPICH2 = "mvapich2"
    SLURM = "slurm"
    SINGLE = "single"

    @property
    def is_mpi(self) -> bool:
        """True for mpirun/mpiexec launchers, whose ranks can rendezvous through MPI itself."""
        return self in (Launcher.OPEN_MPI, Launcher.MPICH, Launcher.PMIX, Launcher.MVAPICH2)


@dataclass(frozen=True)
class LaunchInfo:
    """Where this process sits in the job.

    Attributes:
        rank: global index, ``0 <= rank < world_size``.
        world_size: number of processes in the job.
        local_rank: index among the processes on this host.
        local_world_size: number of processes on this host.
        launcher: which launcher's variables these came from.
        master_addr, master_port: where the torch.distributed backends' rendezvous store
            listens (``MASTER_ADDR``/``MASTER_PORT``); None when not both are set, in which case
            an MPI launcher's ranks rendezvous through MPI
            (:func:`gradcomm.comm._rendezvous.create_store`).
        agent_store: torchrun's agent already serves that store
            (``TORCHELASTIC_USE_AGENT_STORE=True``), so rank 0 joins it as a client.
        store: a ``torch.distributed.Store`` every rank already shares, given by the caller
            (:func:`gradcomm.init`'s ``store=``, the one ``init_process_group`` made, or a
            fault-tolerance coordinator's under a prefix of the group's own). gloo and nccl
            build their process group over it as it is, cupy-nccl passes its unique id over it:
            no rendezvous, no MPI, no bind-address choice (the transport's interface variable
            applies, as for torch's own groups). mpi ignores it.
    """

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    launcher: Launcher
    master_addr: str | None = None
    master_port: int | None = None
    agent_store: bool = False
    store: Any = field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        for name in ("rank", "world_size", "local_rank", "local_world_size"):
            value = getattr(self, name)
            # numpy integers are fine; bool, float ("1.0", 0.0) and str are not
            if isinstance(value, bool) or not isinstance(value, numbers.Integral):
                raise TypeError(f"{name} must be an int, got {type(value).__name__} {value!r}")
            object.__setattr__(self, name, int(value))
        if self.world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {self.world_size}")
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank must be in [0, {self.world_size}), got {self.rank}")
        if self.local_world_size < 1:
            raise ValueError(f"local_world_size must be >= 1, got {self.local_world_size}")
        if not 0 <= self.local_rank < self.local_world_size:
            raise ValueError(
                f"local_rank must be in [0, {self.local_world_size}), got {self.local_rank}"
            )


# (launcher, rank var, size var, local rank vars, local size vars), in precedence order.
_LauncherVars = tuple[Launcher, str, tuple[str, ...], tuple[str, ...], tuple[str, ...]]
_LAUNCHER_VARS: tuple[_LauncherVars, ...] = (
    (Launcher.TORCHRUN, "RANK", ("WORLD_SIZE",), ("LOCAL_RANK",), ("LOCAL_WORLD_SIZE",)),
    (
        Launcher.OPEN_MPI,
        "OMPI_COMM_WORLD_RANK",
        ("OMPI_COMM_WORLD_SIZE",),
        ("OMPI_COMM_WORLD_LOCAL_RANK",),
        ("OMPI_COMM_WORLD_LOCAL_SIZE",),
    ),
    (Launcher.MPICH, "PMI_RANK", ("PMI_SIZE",), ("MPI_LOCALRANKID",), ("MPI_LOCALNRANKS",)),
    (
        Launcher.PMIX,
        "PMIX_RANK",
        ("PMIX_SIZE", "OMPI_COMM_WORLD_SIZE", "SLURM_NTASKS"),
        ("PMIX_LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_RANK", "SLURM_LOCALID"),
        ("PMIX_LOCAL_SIZE", "OMPI_COMM_WORLD_LOCAL_SIZE", "SLURM_NTASKS_PER_NODE"),
    ),
    (
        Launcher.MVAPICH2,
        "MV2_COMM_WORLD_RANK",
        ("MV2_COMM_WORLD_SIZE",),
        ("MV2_COMM_WORLD_LOCAL_RANK",),
        ("MV2_COMM_WORLD_LOCAL_SIZE",),
    ),
    (
        Launcher.SLURM,
        "SLURM_PROCID",
        ("SLURM_NTASKS",),
        ("SLURM_LOCALID",),
        ("SLURM_NTASKS_PER_NODE", "SLURM_TASKS_PER_NODE"),
    ),
)


def _int_var(env: Mapping[str, str], name: str) -> int:
    raw = env[name]
    head = raw.strip()
    if name == "SLURM_TASKS_PER_NODE":
        # Looks like "2(x3),1": the first field is this job's usual count.
        head = head.split(",")[0].split("(")[0].strip()
    try:
        return int(head)
    except ValueError:
        raise ValueError(f"environment variable {name}={raw!r} is not an integer") from None


def _first(env: Mapping[str, str], names: tuple[str, ...]) -> int | None:
    for name in names:
        if env.get(name, "").strip():
            return _int_var(env, name)
    return None


def detect_launch(
    env: Mapping[str, str] | None = None,
    *,
    rank: int | None = None,
    world_size: int | None = None,
    local_rank: int | None = None,
    local_world_size: int | None = None,
) -> LaunchInfo:
    """Read rank, world size, local rank and the rendezvous address from the launcher's
    environment variables.

    Args:
        env: the environment to read (default: :data:`os.environ`).
        rank: explicit rank; given with ``world_size`` it wins over every variable.
        world_size: explicit number of ranks.
        local_rank: explicit rank on this host (default: from the launcher, else ``rank``, i.e.
            all processes on one host).
        local_world_size: explicit ranks on this host (default: from the launcher, else
            ``world_size``).

    Returns:
        A :class:`LaunchInfo`. A launcher that gives no local rank is read as all ranks on one host;
        one that gives a local rank but no local size gets ``local_world_size = world_size``.

    Raises:
        TypeError: an explicit ``rank``, ``world_size``, ``local_rank`` or ``local_world_size``
            that is not an int (bool and float refused; numpy integers accepted).
        ValueError: only one of ``rank``/``world_size`` given, a variable that is not an integer
            (``MASTER_PORT`` included), or values out of range (e.g. ``RANK`` >= ``WORLD_SIZE``).
    """
    env = os.environ if env is None else env
    if (rank is None) != (world_size is None):
        raise ValueError("give rank and world_size together, or neither")
    store = _store_address(env)
    if rank is not None and world_size is not None:
        lr = rank if local_rank is None else local_rank
        lws = (world_size if local_world_size is None else local_world_size)
        return LaunchInfo(rank, world_size, lr, lws, Launcher.EXPLICIT, *store)

    for launcher, rank_var, size_vars, local_vars, local_size_vars in _LAUNCHER_VARS:
        if not env.get(rank_var, "").strip():
            continue
        found_rank = _int_var(env, rank_var)
        size = _first(env, size_vars)
        if size is None:
            raise ValueError(
                f"{rank_var} is set but none of {', '.join(size_vars)} is; "
                "cannot tell the world size"
            )
        found_lr = _first(env, local_vars) if local_rank is None else local_rank
        found_lws = _first(env, local_size_vars) if local_world_size is None else local_world_size
        if found_lr is None:  # no local rank: read as all ranks on one host
            found_lr = found_rank
            found_lws = size if local_world_size is None else local_world_size
        elif found_lws is None:  # a local rank (e.g. MPI_LOCALRANKID alone): keep it
            found_lws = size
        return LaunchInfo(found_rank, size, found_lr, found_lws, launcher, *store)

    return LaunchInfo(
        0, 1, 0 if local_rank is None else local_rank,
        1 if local_world_size is None else local_world_size, Launcher.SINGLE, *store,
    )


def started_by_mpi_launcher(env: Mapping[str, str] | None = None) -> bool:
    """Whether the launcher :func:`detect_launch` reads this process's rank from is an MPI
    launcher (mpirun/mpiexec of Open MPI, MPICH/Hydra, Intel MPI, PMIx, MVAPICH2).

    The first launcher, in :func:`detect_launch`'s precedence, whose rank variable is set in
    ``env`` (default :data:`os.environ`) decides: torchrun started by mpirun is torchrun. Reads
    the variables only (no MPI import, no parsing), so it answers even where
    :func:`detect_launch` would raise on a malformed value.
    """
    env = os.environ if env is None else env
    for launcher, rank_var, *_ in _LAUNCHER_VARS:
        if env.get(rank_var, "").strip():
            return launcher.is_mpi
    return False


def _store_address(env: Mapping[str, str]) -> tuple[str | None, int | None, bool]:
    """``(MASTER_ADDR, MASTER_PORT, agent store)`` from ``env``; (None, None) unless both set."""
    addr, port = env.get("MASTER_ADDR", "").strip(), env.get("MASTER_PORT", "").strip()
    agent = env.get("TORCHELASTIC_USE_AGENT_STORE", "").strip().lower() == "true"
    if not (addr and port):
        return None, None, agent
    try:
        port_num = int(port)
    except ValueError:
        raise ValueError(f"MASTER_PORT must be an integer, got {port!r}") from None
    if not 0 <= port_num <= 65535:
        raise ValueError(f"MASTER_PORT must be in [0, 65535], got {port_num}")
    return addr, port_num, agent


def cpus_per_local_process(local_world_size: int) -> float:
    """CPU cores this process may run on, divided by the number of processes on this host.

    The cores are those of the process's affinity mask (``os.sched_getaffinity``; a launcher that
    binds each rank to one core makes this 1 / local_world_size), or ``os.cpu_count()`` where the
    platform has no affinity call. Backends use it to tell whether a transport thread has a core of
    its own to run on while the training thread computes.

    Raises:
        ValueError: ``local_world_size < 1``.
    """
    if local_world_size < 1:
        raise ValueError(f"local_world_size must be >= 1, got {local_world_size}")
    getaffinity = getattr(os, "sched_getaffinity", None)
    cores = len(getaffinity(0)) if getaffinity is not None else (os.cpu_count() or 1)
    return cores / local_world_size


def check_launch_matches_mpi(world: Any, launch: LaunchInfo) -> None:
    """Raise RuntimeError, on every rank of ``world``, when any rank's ``launch`` (explicit
    arguments or a launcher's environment) disagrees with MPI's own rank and size.

    ``world`` is ``mpi4py.MPI.COMM_WORLD`` (passed in: this module imports no MPI). The ranks
    agree first (one blocking all-gather, as the collectives that follow are): a rank whose
    settings happen to match MPI's would otherwise go on into the next collective and wait
    forever for the rank that raised (e.g. ``rank=0, world_size=2`` passed on every rank).
    Ranks that MPI sees alone (each a job of one process, as under torchrun) learn that MPI
    needs an MPI launcher.
    """
    mine = (world.Get_rank(), world.Get_size(), launch.rank, launch.world_size)
    if mine[1] == 1 and launch.world_size > 1 and not launch.launcher.is_mpi:
        # e.g. torchrun's ranks: each process is an MPI job of its own, so MPI cannot connect them
        starter = launch.launcher
        if starter is Launcher.EXPLICIT:  # whose variables gave the arguments (torch's backend
            starter = detect_launch().launcher  # passes torchrun's rank and world size)
        said = (f"{starter.value} started" if starter not in (Launcher.EXPLICIT, Launcher.SINGLE)
                else "rank and world_size ask for")
        raise RuntimeError(
            f"MPI sees this process alone, but {said} {launch.world_size} ranks: start the job "
            f"with mpiexec -n {launch.world_size} (srun: --mpi=pmix) for MPI, or use the gloo "
            "backend under this launcher")
    views = [mine] if mine[1] == 1 else world.allgather(mine)
    mismatch = launch_mismatch(views, launch.launcher.value)
    if mismatch is not None:
        raise mismatch


def launch_mismatch(
    views: list[tuple[int, int, int, int]], source: str
) -> RuntimeError | None:
    """The error for ranks whose settings disagree with MPI, or None when all agree.

    Args:
        views: one ``(MPI rank, MPI size, rank, world_size)`` per rank, as all-gathered.
        source: what gave the settings (a :class:`Launcher` value, e.g. ``"explicit"``).
    """
    wrong = [v for v in views if (v[0], v[1]) != (v[2], v[3])]
    if not wrong:
        return None
    m, n, r, w = wrong[0]
    more = f" (and {len(wrong) - 1} more)" if len(wrong) > 1 else ""
    return RuntimeError(
        f"the launch settings disagree with MPI on {len(wrong)} of {len(views)} ranks: MPI rank "
        f"{m} of {n}: {source} settings say rank {r} of {w}{more}; let gradcomm take rank and "
        "world_size from MPI"
    )

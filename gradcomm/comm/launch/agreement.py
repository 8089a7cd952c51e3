"""``gradcomm.init``'s settings check across the ranks of an MPI job.

Each rank checks its own arguments and ``GRADCOMM_*`` values; under an MPI launcher the ranks then
all-gather the outcome (and the backend and store address each chose) on ``MPI.COMM_WORLD``, so
that a value bad on one rank only raises on every rank instead of leaving the others waiting in
the backend's first MPI collective. The all-gather is non-blocking and polled, so a rank that
never arrives (it died, did not call ``init``, or built a process-local communicator) turns into
:class:`~gradcomm.CollectiveTimeoutError` after the communicator's timeout, not a hang.
"""

from __future__ import annotations

import itertools
import json
import numbers
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch

from ..backends.mpi.abort import ABORT_ENV_VAR, install_abort_hook
from ..consistency import DebugLevel
from ..errors import BackendUnavailableError, CollectiveTimeoutError, brief
from .env import env_flag
from .launcher import launch_mismatch, started_by_mpi_launcher

if TYPE_CHECKING:
    from ..communicator import Communicator

__all__ = ["agree_on_debug", "agree_on_settings", "joins_agreement"]

#: Exception types another rank's init error is raised as here (by name); others: RuntimeError.
_RAISED_AS: dict[str, type[Exception]] = {
    "TypeError": TypeError, "ValueError": ValueError, "OverflowError": ValueError,
    "ImportError": ImportError, "ModuleNotFoundError": ImportError,
    "BackendUnavailableError": BackendUnavailableError,
}
_POLL_S = 0.0005
#: Requests (and their buffers) of a settings check that timed out on this process: MPI cannot
#: cancel a collective, so they stay pending and are kept alive here (MPI may still write into
#: the buffers), and COMM_WORLD cannot carry another check.
_abandoned: list[Any] = []


def joins_agreement(env: Mapping[str, str], world_size: object) -> bool:
    """Whether :func:`gradcomm.init` with these arguments takes part in the settings check.

    Yes when the launcher ``env`` names (init passes its valid ``env`` argument, else os.environ,
    so a malformed ``env`` is still checked with the others) is an MPI launcher that wins the
    launcher precedence (torchrun started by mpirun is torchrun), unless ``world_size=1`` asks
    for a process-local communicator, which one rank may build alone.
    """
    if not started_by_mpi_launcher(env):
        return False
    if isinstance(world_size, bool) or not isinstance(world_size, numbers.Integral):
        return True  # None (from the launcher), or a bad value the check must report
    return int(world_size) != 1  # numpy integers too


def _wait(request: Any, keep: tuple[Any, ...], deadline: float, timeout: float, rank: int,
          size: int) -> None:
    while not request.Test():
        if time.monotonic() > deadline:
            _abandoned.append((request, keep))
            raise CollectiveTimeoutError(
                f"gradcomm.init: not every rank reached the settings check within {timeout:g} s "
                f"(MPI rank {rank} of {size}); its MPI request stays pending, so end the job: "
                "init cannot be retried in this process"
            )
        time.sleep(_POLL_S)


def _allgather_bytes(world: Any, payload: bytes, timeout: float) -> list[bytes]:
    """Every rank's ``payload``, in rank order; CollectiveTimeoutError after ``timeout`` s."""
    import numpy as np
    from mpi4py import MPI

    rank, size = world.Get_rank(), world.Get_size()
    deadline = time.monotonic() + timeout
    sizes = np.zeros(size, dtype=np.int64)
    length = np.array([len(payload)], dtype=np.int64)
    _wait(world.Iallgather(length, sizes), (length, sizes), deadline, timeout, rank, size)
    counts = [int(n) for n in sizes]
    displs = [sum(counts[:r]) for r in range(size)]
    data = np.empty(sum(counts), dtype=np.uint8)
    mine = np.frombuffer(payload, dtype=np.uint8)
    _wait(world.Iallgatherv(mine, [data, counts, displs, MPI.BYTE]), (mine, data), deadline,
          timeout, rank, size)
    return [data[d:d + n].tobytes() for d, n in zip(displs, counts, strict=True)]


def agree_on_settings(
    problem: Exception | None, mine: tuple[object, ...] | None, timeout: float
) -> None:
    """Make a setting that is bad on any rank raise on every rank (call where
    :func:`joins_agreement` says so, on every rank, with or without a ``problem``).

    ``mine`` is (backend name, store address, store port, rank, world_size, debug level); None
    with a ``problem``. Skipped --
    ``problem``, if any, is raised on this rank only -- without mpi4py, with one MPI rank, or
    after MPI_Finalize. Initialises MPI (also where mpi4py was imported with
    ``mpi4py.rc.initialize = False``) and installs the abort hook unless
    ``GRADCOMM_MPI_ABORT_ON_ERROR`` is off.

    Raises:
        Exception: ``problem`` on this rank; on the others the same kind (TypeError, ValueError,
            ImportError, BackendUnavailableError; RuntimeError for anything else), naming the
            rank(s) and their messages.
        ValueError: the ranks chose different backends or debug levels, or
            (torch.distributed backends) different store addresses.
        RuntimeError: a rank's rank/world_size (explicit arguments) is not MPI's, or an earlier
            check in this process timed out (its request is still pending).
        CollectiveTimeoutError: not every rank arrived within ``timeout`` seconds, counted once
            every rank has started MPI (MPI_Init itself waits for all ranks, without a timeout).
    """
    world = None
    try:
        from mpi4py import MPI
    except ImportError:
        pass
    else:
        if not MPI.Is_finalized():
            if not MPI.Is_initialized():
                MPI.Init_thread()
            world = MPI.COMM_WORLD if MPI.COMM_WORLD.Get_size() > 1 else None
    if world is None:
        if problem is not None:
            raise problem
        return
    if _abandoned:
        raise RuntimeError("gradcomm.init: an earlier settings check in this process timed out "
                           "and its MPI request is still pending on COMM_WORLD, so another "
                           "check would pair with it; end the job and start it again")
    try:
        abort = env_flag(ABORT_ENV_VAR, True)
    except ValueError:
        abort = True  # the bad value itself is `problem`: raise it on every rank, then abort
    if abort:
        install_abort_hook()
    error = None if problem is None else [type(problem).__name__, str(problem)]
    payload = json.dumps([error, None if mine is None else list(mine)]).encode()
    views = [json.loads(raw) for raw in _allgather_bytes(world, payload, timeout)]
    failed = [(r, e) for r, (e, _) in enumerate(views) if e is not None]
    if failed:
        if problem is not None:
            raise problem
        kind = _RAISED_AS.get(failed[0][1][0], RuntimeError)
        rank, (name, msg) = failed[0]  # the first failed rank's error; its own traceback has all
        more = f" and {len(failed) - 1} more" if len(failed) > 1 else ""
        raise kind(f"gradcomm.init failed on {len(failed)} of {len(views)} ranks (rank {rank}"
                   f"{more}: {name}: {brief(msg, 100)}); raised "
                   "on every rank so that none waits")
    chosen = [tuple(m) for _, m in views]
    backends = [c[0] for c in chosen]
    if len(set(backends)) > 1:
        listed = "; ".join(f"rank {r}: {b}" for r, b in enumerate(backends[:8]))
        raise ValueError(f"the ranks chose different backends ({listed}); pass the same backend "
                         "or set the same GRADCOMM_BACKEND on every rank")
    _check_debug_levels([c[5] for c in chosen])
    mismatch = launch_mismatch(  # an explicit rank=/world_size= that is not MPI's
        [(r, len(views), c[3], c[4]) for r, c in enumerate(chosen)], "explicit")
    if mismatch is not None:
        raise mismatch
    stores = [c[1:3] for c in chosen]
    if backends[0] != "mpi" and len(set(stores)) > 1:  # the mpi backend uses no store
        listed = "; ".join(f"rank {r}: {s}" for r, s in enumerate(stores[:8]))
        raise ValueError(f"the ranks chose different store addresses (MASTER_ADDR, MASTER_PORT; "
                         f"None: through MPI) ({listed}); set MASTER_ADDR and MASTER_PORT alike "
                         "on every rank, or on none")


def _check_debug_levels(levels: list[str]) -> None:
    if len(set(levels)) > 1:  # a check on some ranks only would pair with real collectives
        listed = "; ".join(f"rank {r}: {v}" for r, v in enumerate(levels[:8]))
        raise ValueError(f"the ranks chose different debug levels ({listed}); pass the same "
                         "debug or set the same GRADCOMM_DEBUG on every rank")


def agree_on_debug(comm: Communicator, level: DebugLevel) -> None:
    """Compare the ranks' debug levels with one small all-gather on ``comm`` (a launch that
    :func:`joins_agreement` compared them before the communicator existed). Call it on every
    rank before ``comm.debug`` is set.

    Raises:
        ValueError: the levels differ (on every rank; ``comm`` is closed first).
    """
    members = list(DebugLevel)
    mine = torch.tensor([members.index(level)], dtype=torch.int64, device=comm.device)
    every = torch.empty(comm.world_size, dtype=torch.int64, device=comm.device)
    comm.all_gather(every, mine)
    comm._seq = itertools.count()  # the user's first collective is still #1 in messages
    levels = [members[i].value for i in every.tolist()]
    if len(set(levels)) > 1:
        comm.close()
        _check_debug_levels(levels)

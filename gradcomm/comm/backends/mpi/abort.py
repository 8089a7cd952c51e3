"""Abort the whole MPI job when one rank dies of an uncaught exception.

Used by the mpi backend and by the torch.distributed backends' rendezvous through MPI (both
initialise MPI). Without it, an uncaught error on one rank leaves the others spinning in a
collective, or, once MPI is initialised, hanging in ``MPI_Finalize`` at exit while a peer is stuck.
Set ``GRADCOMM_MPI_ABORT_ON_ERROR=0`` to opt out.
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Mapping
from types import TracebackType

from ...launch.env import env_flag

__all__ = ["ABORT_ENV_VAR", "abort_job", "abort_on_error_enabled", "install_abort_hook"]

ABORT_ENV_VAR = "GRADCOMM_MPI_ABORT_ON_ERROR"
_ABORT_GRACE_S = 0.5
_hook_lock = threading.Lock()
_hook_installed = False


def abort_on_error_enabled(env: Mapping[str, str] | None = None) -> bool:
    """Whether ``GRADCOMM_MPI_ABORT_ON_ERROR`` allows the abort hook (default: yes).

    ``0``, ``false``, ``no`` and ``off`` (any case) turn it off; unset, empty, ``1``, ``true``,
    ``yes`` and ``on`` leave it on.

    Raises:
        ValueError: any other value (a typo must not silently leave a job to hang).
    """
    return env_flag(ABORT_ENV_VAR, True, env)


def install_abort_hook() -> bool:
    """Make an uncaught exception abort the whole MPI job, as ``python -m mpi4py`` does.

    Installs, once per process, a :data:`sys.excepthook` that calls the previous hook (which prints
    the traceback), flushes the standard streams, then calls ``MPI.COMM_WORLD.Abort(1)`` while MPI
    is initialised and not finalised. Without it, the other ranks would wait in their next
    collective until its timeout (or forever), spinning at 100% CPU.

    Returns:
        True when this call installed the hook, False when it was already installed.
    """
    global _hook_installed
    with _hook_lock:
        if _hook_installed:
            return False
        previous = sys.excepthook

        def _abort_hook(
            exc_type: type[BaseException], exc: BaseException, tb: TracebackType | None
        ) -> None:
            try:
                previous(exc_type, exc, tb)
            finally:
                from mpi4py import MPI

                if MPI.Is_initialized() and not MPI.Is_finalized():
                    _release_capture()
                    abort_job(f"uncaught {exc_type.__name__} on rank "
                              f"{MPI.COMM_WORLD.Get_rank()}: aborting the MPI job (MPI_Abort; "
                              f"{ABORT_ENV_VAR}=0 turns this off)")

        sys.excepthook = _abort_hook
        _hook_installed = True
        return True


def abort_job(why: str) -> None:
    """Say ``gradcomm: <why>`` on stderr, flush, and end the whole MPI job (``MPI_Abort``).

    The line is ours, said before a short grace period: the launcher's own MPI_Abort line can be
    lost when it tears the job down, and mpiexec can drop output still in its pipes."""
    from mpi4py import MPI

    _say(f"gradcomm: {why}")
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:  # noqa: BLE001 - a closed stream must not stop the abort
            pass
    time.sleep(_ABORT_GRACE_S)
    MPI.COMM_WORLD.Abort(1)


def _release_capture() -> None:
    """Write out what an outer excepthook captured, and point ``sys.stderr`` back at the real
    stream for what the abort prints.

    torch.distributed's hook (``init_process_group``) runs the hooks below it with
    ``sys.stderr`` swapped for a buffer and prints the buffer, with ``[rankN]:`` prefixes, only
    after they return: the abort would lose the traceback."""
    captured = sys.stderr
    if captured is sys.__stderr__ or sys.__stderr__ is None:
        return
    getvalue = getattr(captured, "getvalue", None)
    if getvalue is None:  # a stream of the user's (a log file): theirs to keep
        return
    try:
        sys.__stderr__.write(getvalue())
        captured.seek(0)  # written: the outer hook, should it still run, prints nothing twice
        captured.truncate()
    except Exception:  # noqa: BLE001 - the abort must still happen
        pass
    sys.stderr = sys.__stderr__


def _say(line: str) -> None:
    """Write ``line`` to stderr, ignoring a closed stream (the abort must still happen)."""
    try:
        print(line, file=sys.stderr, flush=True)
    except Exception:  # noqa: BLE001
        pass

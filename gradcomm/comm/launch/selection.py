"""``gradcomm.init``: choose a backend and build this process's communicator.

Backend choice, first match wins: the ``backend`` argument > ``GRADCOMM_BACKEND`` > auto. The auto
rule: ``nccl`` when CUDA is available and registered as usable, else ``gloo``. Timeout: the
``timeout`` argument > ``GRADCOMM_TIMEOUT`` (seconds) > 300 s.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import numbers
import os
from collections.abc import Mapping
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..backends.mpi.abort import ABORT_ENV_VAR
from ..communicator import Communicator
from ..consistency import DebugLevel, debug_level_from_env
from ..errors import brief
from .agreement import agree_on_debug, agree_on_settings, joins_agreement
from .env import env_flag
from .launcher import LaunchInfo, detect_launch
from .registry import (
    available_backends,
    check_backend,
    create_communicator,
    known_backends,
    normalize_backend_name,
)

__all__ = [
    "init", "select_backend", "resolve_timeout", "BackendChoice", "DEFAULT_TIMEOUT", "MAX_TIMEOUT",
]

logger = logging.getLogger(__name__)

#: Default collective timeout in seconds.
DEFAULT_TIMEOUT = 300.0
#: Largest timeout accepted, in seconds (about 31.7 years): gloo refuses timeouts from about 1e13 s
#: and Python's timedelta overflows at about 8.6e13 s, so "practically forever" has one limit for
#: every backend.
MAX_TIMEOUT = 1e9
#: Process-wide on/off switches read from os.environ by what they configure (checked by init).
_PROCESS_SWITCHES = (ABORT_ENV_VAR, "GRADCOMM_MPI_CUDA_AWARE")


@dataclass(frozen=True)
class BackendChoice:
    """The backend :func:`init` will use, and why (for ``gradcomm info`` and error messages)."""

    name: str
    reason: str


def select_backend(
    backend: str | None = None, env: Mapping[str, str] | None = None
) -> BackendChoice:
    """Apply the selection rule without building anything.

    Raises:
        TypeError: ``backend`` is not a string or None.
        ValueError: the name (argument or ``GRADCOMM_BACKEND``) is empty or not registered.
    """
    env = os.environ if env is None else env
    if backend is not None:
        return _known(backend, "the backend argument")
    from_env = env.get("GRADCOMM_BACKEND", "").strip()
    if from_env:
        return _known(from_env, "GRADCOMM_BACKEND")
    status = available_backends()
    if "nccl" in status and status["nccl"].available:
        return BackendChoice("nccl", "auto: CUDA is available")
    return BackendChoice("gloo", "auto: no usable CUDA device, so gloo on the CPU")


def _known(name: str, source: str) -> BackendChoice:
    key = normalize_backend_name(name)
    if key not in known_backends():
        raise ValueError(f"unknown gradcomm backend {name!r} (from {source}); known backends: "
                         f"{', '.join(known_backends())}")
    return BackendChoice(key, source)


def resolve_timeout(timeout: float | None = None, env: Mapping[str, str] | None = None) -> float:
    """Return the collective timeout in seconds from the argument, ``GRADCOMM_TIMEOUT``, or 300.

    Raises:
        ValueError: not a positive finite number of at most :data:`MAX_TIMEOUT` seconds
            (``GRADCOMM_TIMEOUT`` included).
        TypeError: ``timeout`` is not a number.
    """
    env = os.environ if env is None else env
    source = "timeout"
    value: object = timeout
    if timeout is None:
        raw = env.get("GRADCOMM_TIMEOUT", "").strip()
        if not raw:
            return DEFAULT_TIMEOUT
        source = "GRADCOMM_TIMEOUT"
        try:
            value = float(raw)
        except ValueError:
            raise ValueError(f"GRADCOMM_TIMEOUT must be a number of seconds, got {raw!r}") from None
    if isinstance(value, bool) or not isinstance(value, numbers.Real):  # numpy scalars are fine
        raise TypeError(f"timeout must be a number of seconds, got {type(value).__name__}")
    try:
        seconds = float(value)
    except OverflowError:  # an int beyond float's range
        seconds = math.inf
    if not math.isfinite(seconds) or seconds <= 0:
        raise ValueError(f"{source} must be a positive, finite number of seconds, got {value!r}")
    if seconds > MAX_TIMEOUT:
        raise ValueError(f"{source} must be at most {MAX_TIMEOUT:g} seconds (about 31 years), "
                         f"got {value!r}")
    return seconds


def timeout_or_default(timeout: object, env: Mapping[str, str]) -> float:
    """:func:`resolve_timeout`'s answer, or :data:`DEFAULT_TIMEOUT` where it would raise (for
    waits that must end even when this rank's timeout setting is the bad one)."""
    try:
        return resolve_timeout(timeout, env)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return DEFAULT_TIMEOUT


def _checked_device(device: object) -> torch.device | None:
    """``init``'s ``device`` argument as a torch.device (None stays None), checked at the edge.

    Raises:
        TypeError: not a str or torch.device. ValueError: a string torch does not know.
    """
    if device is None:
        return None
    if not isinstance(device, (str, torch.device)):
        raise TypeError(f"device must be a str or torch.device, got {type(device).__name__}")
    try:
        return torch.device(device)
    except RuntimeError as exc:  # torch's message lists the device types it knows
        raise ValueError(f"device {brief(repr(device), 40)} is not a torch device: "
                         f"{brief(str(exc), 110)}") from None


def init(
    backend: str | None = None,
    *,
    timeout: float | None = None,
    rank: int | None = None,
    world_size: int | None = None,
    local_rank: int | None = None,
    device: torch.device | str | None = None,
    env: Mapping[str, str] | None = None,
    debug: DebugLevel | str | None = None,
    store: dist.Store | None = None,
) -> Communicator:
    """Build this process's communicator; call it once on every rank.

    Args:
        backend: ``"gloo"``, ``"mpi"``, ``"nccl"``, ``"cupy-nccl"`` or a registered name; default
            ``GRADCOMM_BACKEND``, else nccl with CUDA, else gloo.
        timeout: seconds every collective may take before raising CollectiveTimeoutError; default
            ``GRADCOMM_TIMEOUT``, else 300.
        rank: explicit rank; default read from the launcher's environment (torchrun,
            mpirun/mpiexec, srun), else a single process.
        world_size: explicit number of ranks (same default).
        local_rank: explicit rank on this host (same default).
        device: device of the tensors to reduce; default the backend's (cpu for gloo and mpi,
            ``cuda:local_rank`` for nccl and cupy-nccl). ``"cuda"`` with mpi passes GPU buffers.
        debug: ``"detail"`` (or :class:`~gradcomm.comm.DebugLevel`) checks every
            collective's arguments across ranks first and raises RuntimeError on every rank
            when they differ (one small all-gather each; docs/failures.md); ``"off"``; default
            ``GRADCOMM_DEBUG``, else off. Pass the same on every rank.
        store: a ``torch.distributed.Store`` every rank already shares (e.g. the one
            ``torch.distributed.init_process_group`` made), used as it is; needs ``rank`` and
            ``world_size``. gloo and nccl build their process group over it, cupy-nccl passes
            its unique id over it (no ``MASTER_ADDR`` or MPI rendezvous, no bind-address choice:
            ``GLOO_SOCKET_IFNAME`` applies as for torch's gloo); mpi ignores it.
        env: environment to read (default os.environ): the launcher's variables (rank, world
            size, ``MASTER_ADDR``/``MASTER_PORT``), ``GRADCOMM_BACKEND``, ``GRADCOMM_TIMEOUT``,
            ``GRADCOMM_DEBUG`` and ``GRADCOMM_PROFILE``. ``GRADCOMM_PROFILE=1`` attaches a
            :mod:`gradcomm.profiler` that writes a Chrome trace per rank when the communicator is
            closed (or at exit) into ``GRADCOMM_PROFILE_DIR`` (default: the working directory).
            Process-wide settings are read from os.environ by what they configure:
            ``GRADCOMM_MPI_ABORT_ON_ERROR`` (a :data:`sys.excepthook`),
            ``GRADCOMM_MPI_CUDA_AWARE`` and the transports' own variables (``NCCL_*``, MPI's).

    Returns:
        A :class:`~gradcomm.comm.Communicator`; use it as a context manager or call ``close()``.

    Raises:
        TypeError: ``env`` is not a mapping of strings to strings; ``rank``, ``world_size`` or
            ``local_rank`` not an int (bool and float refused); ``device`` not a str or
            ``torch.device``; ``debug`` not a str or DebugLevel; ``store`` not a
            ``torch.distributed.Store``.
        ValueError: unknown backend name (the message lists the known ones), bad timeout
            (not positive, not finite, or over :data:`MAX_TIMEOUT`), ranks out of range, a
            device string torch does not know, a ``debug`` or ``GRADCOMM_DEBUG`` naming no
            level, a ``GRADCOMM_PROFILE``, ``GRADCOMM_MPI_ABORT_ON_ERROR`` or
            ``GRADCOMM_MPI_CUDA_AWARE`` value that is neither on nor off, a
            ``GRADCOMM_PROFILE_DIR`` that is (or lies below) a file or cannot be made, a device
            type the backend does not take, or ranks that chose different backends, debug
            levels or store addresses, a ``store`` without ``rank`` and ``world_size``.
        ImportError: the backend's package is missing (the message gives the pip command).
        BackendUnavailableError: the backend needs a CUDA device or library this machine lacks.
        RuntimeError: the rendezvous failed, an explicit ``rank``/``world_size`` is not MPI's,
            or a settings check timed out earlier in this process.
        CollectiveTimeoutError: under an MPI launcher, not every rank reached the settings
            check within ``timeout`` (counted once every rank has started MPI).

    Under an MPI launcher (mpirun/mpiexec; torchrun started by mpirun is torchrun) with more
    than one rank and mpi4py installed, the ranks first all-gather whether their settings were
    valid, which backend they chose and their store address (:mod:`gradcomm.comm._agreement`),
    so an error caused by one rank's arguments or environment is raised on every rank (the
    others raise the same kind, naming the rank; MPI is initialised by then, and the
    ``GRADCOMM_MPI_ABORT_ON_ERROR`` hook installed), and a rank that started MPI but never
    arrives is a :class:`CollectiveTimeoutError` after ``timeout`` (MPI_Init itself waits for
    every rank without one). ``world_size=1`` or an ``env`` without the launcher's variables (a
    process-local communicator) skips it. Elsewhere an error is raised on the rank that has it;
    torchrun ends such a job, a store rendezvous times out.
    """
    from ...profiler import attach_from_env, profile_requested, trace_dir_from_env  # lazy

    # Each rank checks its own settings; under an MPI launcher the ranks then agree, so that a
    # value that is bad on one rank only raises on all of them (not: raise here, hang there).
    launch_env: Mapping[str, str] = os.environ
    try:
        if env is not None:
            if not isinstance(env, Mapping) or not all(
                isinstance(k, str) and isinstance(v, str) for k, v in env.items()
            ):
                raise TypeError(
                    f"env must be a mapping of str to str (like os.environ), got {env!r}"
                )
            launch_env = env
        device = _checked_device(device)
        choice = select_backend(backend, launch_env)
        seconds = resolve_timeout(timeout, launch_env)
        level = (debug_level_from_env(launch_env) if debug is None
                 else DebugLevel.coerce(debug, "debug"))
        launch: LaunchInfo = detect_launch(
            launch_env, rank=rank, world_size=world_size, local_rank=local_rank
        )
        if store is not None:
            if not isinstance(store, dist.Store):
                raise TypeError(f"store must be a torch.distributed.Store, got "
                                f"{type(store).__name__}")
            if rank is None or world_size is None:
                raise ValueError("a store needs rank and world_size as well")
            launch = dataclasses.replace(launch, store=store)
        profiling = profile_requested(launch_env)
        if profiling:
            trace_dir_from_env(launch_env, create=True)
        for name in _PROCESS_SWITCHES:  # read later, where they apply; a typo raises now
            env_flag(name, None)
        check_backend(choice.name, device)  # a missing package or GPU, a wrong device type
    except Exception as exc:
        if joins_agreement(launch_env, world_size):
            agree_on_settings(exc, None, timeout_or_default(timeout, launch_env))  # raises
        raise
    if joins_agreement(launch_env, world_size):
        agree_on_settings(None, (choice.name, launch.master_addr, launch.master_port,
                                 launch.rank, launch.world_size, level.value), seconds)
    logger.debug(
        "init: backend %s (%s), rank %d/%d, local_rank %d, launcher %s, timeout %.1f s",
        choice.name, choice.reason, launch.rank, launch.world_size, launch.local_rank,
        launch.launcher.value, seconds,
    )
    comm = create_communicator(choice.name, launch, seconds, device)
    if launch.world_size > 1 and not joins_agreement(launch_env, world_size):
        agree_on_debug(comm, level)  # a debug check on some ranks only would pair with data
    comm.debug = level
    logger.debug("init: created %r", comm)
    if profiling:
        attach_from_env(comm, launch_env)
    return comm

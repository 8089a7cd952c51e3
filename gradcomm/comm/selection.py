"""``gradcomm.init``: choose a backend and build this process's communicator.

Backend choice, first match wins: the ``backend`` argument > ``GRADCOMM_BACKEND`` > auto. The auto
rule: ``nccl`` when CUDA is available and registered as usable, else ``gloo``. Timeout: the
``timeout`` argument > ``GRADCOMM_TIMEOUT`` (seconds) > 300 s.
"""

from __future__ import annotations

import logging
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass

import torch

from .communicator import Communicator
from .launcher import LaunchInfo, detect_launch
from .registry import available_backends, create_communicator, normalize_backend_name

__all__ = ["init", "select_backend", "resolve_timeout", "BackendChoice", "DEFAULT_TIMEOUT"]

logger = logging.getLogger(__name__)

#: Default collective timeout in seconds.
DEFAULT_TIMEOUT = 300.0


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
    """
    env = os.environ if env is None else env
    if backend is not None:
        return BackendChoice(normalize_backend_name(backend), "the backend argument")
    from_env = env.get("GRADCOMM_BACKEND", "").strip()
    if from_env:
        return BackendChoice(normalize_backend_name(from_env), "GRADCOMM_BACKEND")
    status = available_backends()
    if "nccl" in status and status["nccl"].available:
        return BackendChoice("nccl", "auto: CUDA is available")
    return BackendChoice("gloo", "auto: no usable CUDA device, so gloo on the CPU")


def resolve_timeout(timeout: float | None = None, env: Mapping[str, str] | None = None) -> float:
    """Return the collective timeout in seconds from the argument, ``GRADCOMM_TIMEOUT``, or 300.

    Raises:
        ValueError: not a positive finite number (``GRADCOMM_TIMEOUT`` included).
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
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"timeout must be a number of seconds, got {type(value).__name__}")
    seconds = float(value)
    if not math.isfinite(seconds) or seconds <= 0:
        raise ValueError(f"{source} must be a positive, finite number of seconds, got {value!r}")
    return seconds


def init(
    backend: str | None = None,
    *,
    timeout: float | None = None,
    rank: int | None = None,
    world_size: int | None = None,
    local_rank: int | None = None,
    device: torch.device | str | None = None,
    env: Mapping[str, str] | None = None,
) -> Communicator:
    """Build this process's communicator; call it once on every rank.

    Args:
        backend: ``"gloo"``, ``"mpi"``, ``"nccl"``, ``"cupy-nccl"`` or a registered name; default
            ``GRADCOMM_BACKEND``, else nccl with CUDA, else gloo.
        timeout: seconds every collective may take before raising CollectiveTimeoutError; default
            ``GRADCOMM_TIMEOUT``, else 300.
        rank, world_size, local_rank: explicit placement; default read from the launcher's
            environment (torchrun, mpirun/mpiexec, srun), else a single process.
        device: device of the tensors to reduce; default the backend's (cpu for gloo and mpi,
            ``cuda:local_rank`` for nccl and cupy-nccl). ``"cuda"`` with mpi passes GPU buffers.
        env: environment to read (default os.environ): the launcher's variables (rank, world
            size, ``MASTER_ADDR``/``MASTER_PORT``), ``GRADCOMM_BACKEND``, ``GRADCOMM_TIMEOUT``
            and ``GRADCOMM_PROFILE``. ``GRADCOMM_PROFILE=1`` attaches a
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
            ``torch.device``.
        ValueError: unknown backend name (the message lists the known ones), bad timeout,
            ranks out of range, a device string torch does not know, or a ``GRADCOMM_PROFILE``
            value that is neither on nor off.
        ImportError: the backend's package is missing (the message gives the pip command).
        BackendUnavailableError: the backend needs a CUDA device or library this machine lacks.
        RuntimeError: the rendezvous failed.
    """
    if env is None:
        env = os.environ
    elif not isinstance(env, Mapping) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in env.items()
    ):
        raise TypeError(f"env must be a mapping of str to str (like os.environ), got {env!r}")
    if device is not None:  # checked at the edge, before any rendezvous
        if not isinstance(device, (str, torch.device)):
            raise TypeError(f"device must be a str or torch.device, got {type(device).__name__}")
        try:
            device = torch.device(device)
        except RuntimeError as exc:  # torch's message lists the device types it knows
            raise ValueError(f"device {device!r} is not a torch device: {exc}") from None
    choice = select_backend(backend, env)
    seconds = resolve_timeout(timeout, env)
    launch: LaunchInfo = detect_launch(env, rank=rank, world_size=world_size, local_rank=local_rank)
    from ..profiler import attach_from_env, profile_requested  # lazy: comm does not need it

    profiling = profile_requested(env)  # a bad value raises before any rendezvous
    logger.debug(
        "init: backend %s (%s), rank %d/%d, local_rank %d, launcher %s, timeout %.1f s",
        choice.name, choice.reason, launch.rank, launch.world_size, launch.local_rank,
        launch.launcher.value, seconds,
    )
    comm = create_communicator(choice.name, launch, seconds, device)
    logger.debug("init: created %r", comm)
    if profiling:
        attach_from_env(comm, env)
    return comm

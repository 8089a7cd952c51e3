"""Backend registry: names to factories, with lazy imports and availability checks.

A backend is registered with a factory ``factory(launch, timeout, device) -> Communicator``
(``device`` None means the backend's default: cpu for gloo and mpi, ``cuda:local_rank`` for nccl)
and a check ``check() -> Exception | None`` that says, without side effects, why the backend cannot
run here (the exception :func:`create_communicator` will raise) or ``None`` when it can. The
built-in backends' factories import their modules only when called, so a missing mpi4py or cupy
never breaks ``import gradcomm`` (ChainerMN's factory does the same).

Raised by :func:`create_communicator`: ``ValueError`` for an unknown name (listing the known ones),
``ImportError`` naming the pip command when a package is missing, and
:class:`~gradcomm.BackendUnavailableError` (a RuntimeError) when the machine lacks what the backend
needs (a CUDA device, the NCCL library).
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from dataclasses import dataclass

import torch

from ..communicator import Communicator
from ..errors import BackendUnavailableError
from .launcher import LaunchInfo

__all__ = [
    "BackendFactory",
    "BackendCheck",
    "BackendStatus",
    "register_backend",
    "available_backends",
    "create_communicator",
    "normalize_backend_name",
]

BackendFactory = Callable[[LaunchInfo, "float | None", "torch.device | None"], Communicator]
BackendCheck = Callable[[], "Exception | None"]


@dataclass(frozen=True)
class BackendStatus:
    """Whether a registered backend can run on this machine, and if not, why."""

    name: str
    available: bool
    reason: str


@dataclass(frozen=True)
class _Entry:
    factory: BackendFactory
    check: BackendCheck
    #: Device types the backend's collectives take (None: not declared, e.g. a registered one).
    device_types: frozenset[str] | None = None


def normalize_backend_name(name: str) -> str:
    """Lower-case, strip, and spell ``_`` as ``-`` (``"CUPY_NCCL"`` -> ``"cupy-nccl"``).

    Raises:
        TypeError: ``name`` is not a string. ValueError: it is empty.
    """
    if not isinstance(name, str):
        raise TypeError(f"backend name must be a str, got {type(name).__name__}")
    norm = name.strip().lower().replace("_", "-")
    if not norm:
        raise ValueError("backend name is empty")
    return norm


def _missing_module(module: str, pip: str, backend: str) -> ImportError | None:
    if importlib.util.find_spec(module) is None:
        return ImportError(f"the {backend} backend needs the {module} package: pip install {pip}")
    return None


def _no_check() -> Exception | None:
    return None


# ---------------------------------------------------------------------------- built-in backends
def _gloo_check() -> Exception | None:
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_gloo_available():
        return BackendUnavailableError(
            "this torch build has no gloo (torch.distributed.is_gloo_available() is False)"
        )
    return None


def _gloo_factory(
    launch: LaunchInfo, timeout: float | None, device: torch.device | None
) -> Communicator:
    from ..backends.gloo import GlooCommunicator

    return GlooCommunicator(launch, timeout=timeout)  # check_backend refused other devices


def _mpi_check() -> Exception | None:
    return _missing_module("mpi4py", "mpi4py  (and an MPI library, e.g. pip install mpich)", "mpi")


def _mpi_factory(
    launch: LaunchInfo, timeout: float | None, device: torch.device | None
) -> Communicator:
    from ..backends.mpi.communicator import MPICommunicator

    return MPICommunicator(launch, timeout=timeout, device=device)


def _nccl_check() -> Exception | None:
    from ..backends.nccl import nccl_unavailable

    return nccl_unavailable()


def _nccl_factory(
    launch: LaunchInfo, timeout: float | None, device: torch.device | None
) -> Communicator:
    from ..backends.nccl import NCCLCommunicator

    return NCCLCommunicator(launch, timeout=timeout, device=device)


def _cupy_nccl_check() -> Exception | None:
    from ..backends.cupy_nccl import cupy_nccl_unavailable

    return cupy_nccl_unavailable()


def _cupy_nccl_factory(
    launch: LaunchInfo, timeout: float | None, device: torch.device | None
) -> Communicator:
    from ..backends.cupy_nccl import CupyNCCLCommunicator

    return CupyNCCLCommunicator(launch, timeout=timeout, device=device)


_CUDA = frozenset({"cuda"})
_REGISTRY: dict[str, _Entry] = {
    "gloo": _Entry(_gloo_factory, _gloo_check, frozenset({"cpu"})),
    "mpi": _Entry(_mpi_factory, _mpi_check, frozenset({"cpu", "cuda"})),
    "nccl": _Entry(_nccl_factory, _nccl_check, _CUDA),
    "cupy-nccl": _Entry(_cupy_nccl_factory, _cupy_nccl_check, _CUDA),
}


def register_backend(
    name: str, factory: BackendFactory, *, check: BackendCheck | None = None, replace: bool = False
) -> None:
    """Make ``name`` selectable by :func:`gradcomm.init` and ``GRADCOMM_BACKEND``.

    Args:
        name: backend name (normalised by :func:`normalize_backend_name`).
        factory: ``factory(launch, timeout, device) -> Communicator``; called on every rank;
            ``device`` is None for the backend's default.
        check: ``check() -> Exception | None``: why the backend cannot run here, or None.
        replace: allow replacing an existing registration.

    Raises:
        TypeError: ``factory`` or ``check`` is not callable.
        ValueError: ``name`` is already registered and ``replace`` is False.
    """
    key = normalize_backend_name(name)
    if not callable(factory):
        raise TypeError(f"factory must be callable, got {type(factory).__name__}")
    if check is not None and not callable(check):
        raise TypeError(f"check must be callable or None, got {type(check).__name__}")
    if key in _REGISTRY and not replace:
        raise ValueError(f"backend {key!r} is already registered; pass replace=True to replace it")
    _REGISTRY[key] = _Entry(factory, check or _no_check)


def known_backends() -> list[str]:
    """Names of every registered backend, available here or not, sorted."""
    return sorted(_REGISTRY)


def available_backends() -> dict[str, BackendStatus]:
    """Every registered backend's status on this machine (imports nothing heavy, starts no MPI).

    Returns:
        ``{name: BackendStatus(name, available, reason)}``, sorted by name; ``reason`` says what is
        missing (and the pip command) when ``available`` is False.
    """
    out: dict[str, BackendStatus] = {}
    for name in sorted(_REGISTRY):
        problem = _REGISTRY[name].check()
        out[name] = BackendStatus(name, problem is None, "" if problem is None else str(problem))
    return out


def _entry(name: str) -> tuple[str, _Entry]:
    key = normalize_backend_name(name)
    entry = _REGISTRY.get(key)
    if entry is None:
        raise ValueError(
            f"unknown gradcomm backend {name!r}; known backends: {', '.join(known_backends())}"
        )
    return key, entry


def check_backend(name: str, device: torch.device | None = None) -> None:
    """Raise what :func:`create_communicator` would raise before building anything.

    Args:
        name: backend name.
        device: the device the communicator is asked for (None: its default); for the built-in
            backends its type is checked against the types they take.

    Raises:
        ValueError: unknown name, or a device type the backend does not take.
        ImportError: missing package (the message has the pip command).
        BackendUnavailableError: the machine lacks what the backend needs (a CUDA device asked
            for where ``torch.cuda.is_available()`` is False included).
    """
    key, entry = _entry(name)
    problem = entry.check()
    if problem is not None:
        raise problem
    if device is None:
        return
    if entry.device_types is not None and device.type not in entry.device_types:
        raise ValueError(f"the {key} backend works on {' or '.join(sorted(entry.device_types))} "
                         f"tensors, not {device}")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise BackendUnavailableError(f"the {key} backend was asked for {device}, but "
                                      "torch.cuda.is_available() is False")


def create_communicator(
    name: str, launch: LaunchInfo, timeout: float | None, device: torch.device | str | None = None
) -> Communicator:
    """Build backend ``name``'s communicator for this process (``device`` None: its default).

    Raises:
        What :func:`check_backend` raises (unknown name, a device type the backend does not
        take, missing package, no CUDA device or library), then whatever the backend raises.
    """
    dev = None if device is None else torch.device(device)
    check_backend(name, dev)
    return _entry(name)[1].factory(launch, timeout, dev)

"""The transports fault tolerance can re-form, built over the coordinator's store.

gloo, nccl and cupy-nccl build a new group over any store and can be aborted from another thread
(``Communicator.abort()``), which is all a re-formation needs. MPI cannot: its communicator is
fixed at ``MPI_Init`` and a dead rank ends the job under every MPI launcher, so it is refused.

This is the one module of :mod:`gradcomm.elastic` that imports below gradcomm's public names:
the backend classes, built from a :class:`~gradcomm.comm.LaunchInfo` whose ``store`` is the
generation's (no rendezvous).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ..comm import Communicator, LaunchInfo, select_backend

__all__ = ["CommunicatorFactory", "SUPPORTED", "factory_for"]

#: ``factory(launch, timeout, device) -> Communicator``: a group of ``launch.world_size`` ranks
#: built over ``launch.store`` (a prefix of the coordinator's store, the generation's own);
#: ``device`` None means the backend's default. The communicator must implement ``abort()``.
CommunicatorFactory = Callable[[LaunchInfo, float, "torch.device | None"], Communicator]

#: Backends whose groups can be re-formed.
SUPPORTED = ("gloo", "nccl", "cupy-nccl")

MPI_REFUSED = ("fault tolerance needs a group that can be re-formed at run time, which MPI's "
               "cannot (a dead rank ends the job); use gloo, nccl or cupy-nccl, workers "
               "started alone (by hand, srun), not by mpirun")


def _gloo(launch: LaunchInfo, timeout: float, device: torch.device | None) -> Communicator:
    from ..comm.backends.gloo import GlooCommunicator

    return GlooCommunicator(launch, timeout=timeout)


def _nccl(launch: LaunchInfo, timeout: float, device: torch.device | None) -> Communicator:
    from ..comm.backends.nccl import NCCLCommunicator

    return NCCLCommunicator(launch, timeout=timeout, device=device)


def _cupy_nccl(launch: LaunchInfo, timeout: float, device: torch.device | None) -> Communicator:
    from ..comm.backends.cupy_nccl import CupyNCCLCommunicator

    return CupyNCCLCommunicator(launch, timeout=timeout, device=device)


_FACTORIES: dict[str, CommunicatorFactory] = {"gloo": _gloo, "nccl": _nccl,
                                              "cupy-nccl": _cupy_nccl}


def factory_for(backend: str | CommunicatorFactory | None) -> tuple[str, CommunicatorFactory]:
    """``(name, factory)`` for a backend name (None: ``GRADCOMM_BACKEND``, else nccl with CUDA,
    else gloo, as :func:`gradcomm.init` chooses) or a factory of your own.

    Raises:
        TypeError: ``backend`` is neither a str, None nor callable.
        ValueError: an unknown name, ``mpi`` (the message names the backends that work), or a
            registered backend of your own given by name (pass its factory instead).
    """
    if callable(backend):
        return getattr(backend, "__name__", "custom"), backend
    if backend is not None and not isinstance(backend, str):
        raise TypeError(f"backend must be a name, a communicator factory or None, got "
                        f"{type(backend).__name__}")
    name = select_backend(backend).name
    if name == "mpi":
        raise ValueError(MPI_REFUSED)
    if name not in _FACTORIES:
        raise ValueError(f"fault tolerance re-forms gloo, nccl and cupy-nccl groups, not "
                         f"{name!r}; pass a factory(launch, timeout, device) instead")
    return name, _FACTORIES[name]

"""gradcomm.comm: one small collective interface, implemented by pluggable backends.

Layers, top down: :func:`init` (:mod:`.launch`: launcher detection, backend selection,
rendezvous, address choice, settings agreement) builds a :class:`Communicator`
(:mod:`.communicator`: the argument checks, the cross-rank consistency check and the stall guard
in front of one backend hook per operation), which a backend (:mod:`.backends`: gloo, nccl, mpi,
cupy-nccl) implements. :func:`register_backend` adds a backend, :func:`detect_launch` says how
this process was launched, :class:`DebugLevel` sets the cross-rank check (``GRADCOMM_DEBUG``).
"""

from .communicator import Communicator, P2PKind, P2POp
from .consistency import DebugLevel
from .errors import BackendUnavailableError, CollectiveTimeoutError, SlowPathWarning
from .hierarchical import HierarchicalAllReduce
from .launch.launcher import Launcher, LaunchInfo, detect_launch
from .launch.registry import BackendStatus, available_backends, register_backend
from .launch.selection import BackendChoice, init, select_backend
from .types import Collective, ReduceOp, Support, SupportLevel
from .work import Work

__all__ = [
    "Communicator",
    "Work",
    "P2POp",
    "P2PKind",
    "HierarchicalAllReduce",
    "ReduceOp",
    "Collective",
    "Support",
    "SupportLevel",
    "CollectiveTimeoutError",
    "BackendUnavailableError",
    "SlowPathWarning",
    "Launcher",
    "LaunchInfo",
    "detect_launch",
    "BackendStatus",
    "available_backends",
    "register_backend",
    "BackendChoice",
    "select_backend",
    "init",
    "DebugLevel",
]

"""gradcomm.comm: one small collective interface, implemented by pluggable backends.

See :class:`Communicator` for the interface, :func:`init` to build one, :func:`register_backend` to
add a backend, :func:`detect_launch` for launcher detection, and :class:`DebugLevel` for the
cross-rank check of every collective (``GRADCOMM_DEBUG``).
"""

from ._consistency import DebugLevel
from ._p2p import P2PKind, P2POp
from .communicator import Communicator
from .errors import BackendUnavailableError, CollectiveTimeoutError, SlowPathWarning
from .hierarchical import HierarchicalAllReduce
from .launcher import Launcher, LaunchInfo, detect_launch
from .registry import BackendStatus, available_backends, register_backend
from .selection import BackendChoice, init, select_backend
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

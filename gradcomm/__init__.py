"""gradcomm: backend-agnostic collectives and gradient all-reduce for data-parallel PyTorch.

Quick start::

    import gradcomm
    comm = gradcomm.init()                      # GRADCOMM_BACKEND, or nccl with CUDA, else gloo
    reducer = gradcomm.GradientReducer(model, comm)
    loss.backward()                             # gradients are averaged across ranks here
    optimizer.step()
"""

import logging

__version__ = "0.1.0"

from . import profiler
from .comm import (
    BackendUnavailableError,
    CollectiveTimeoutError,
    Communicator,
    LaunchInfo,
    ReduceOp,
    SlowPathWarning,
    Support,
    SupportLevel,
    Work,
    available_backends,
    detect_launch,
    init,
    register_backend,
)
from .hooks import CommHook, GradientReducer, apply_gradient_allreduce

# A library logs, it does not print; the application decides where records go (logging HOWTO,
# "Configuring Logging for a Library").
logging.getLogger(__name__).addHandler(logging.NullHandler())

__all__ = [
    "__version__",
    "init",
    "Communicator",
    "Work",
    "ReduceOp",
    "Support",
    "SupportLevel",
    "LaunchInfo",
    "detect_launch",
    "available_backends",
    "register_backend",
    "CollectiveTimeoutError",
    "BackendUnavailableError",
    "SlowPathWarning",
    "GradientReducer",
    "apply_gradient_allreduce",
    "CommHook",
    "profiler",
]

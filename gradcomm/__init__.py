"""gradcomm: backend-agnostic collectives and gradient all-reduce for data-parallel PyTorch.

Quick start::

    import gradcomm
    comm = gradcomm.init()                      # GRADCOMM_BACKEND, or nccl with CUDA, else gloo
    reducer = gradcomm.GradientReducer(model, comm)
    loss.backward()                             # gradients are averaged across ranks here
    optimizer.step()
"""

__version__ = "0.1.0"

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
]

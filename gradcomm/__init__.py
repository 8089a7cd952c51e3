"""gradcomm: backend-agnostic collectives and gradient all-reduce for data-parallel PyTorch.

Quick start::

    import gradcomm
    comm = gradcomm.init()                      # GRADCOMM_BACKEND, or nccl with CUDA, else gloo
    reducer = gradcomm.GradientReducer(model, comm)
    loss.backward()                             # gradients are averaged across ranks here
    optimizer.step()
"""

import logging as _logging

__version__ = "0.1.0"

from . import profiler  # noqa: F401 - gradcomm.profiler stays one attribute away
from .comm import (
    BackendUnavailableError,
    CollectiveTimeoutError,
    Communicator,
    ReduceOp,
    SlowPathWarning,
    Support,
    SupportLevel,
    Work,
    available_backends,
    init,
    register_backend,
)
from .hooks import GradientReducer, ShardedOptimizer, apply_gradient_allreduce
from .torch_backend import register as _register_torch_backend

# init_process_group("gradcomm") works after `import gradcomm` (no transport is imported here).
_register_torch_backend()

# A library logs, it does not print; the application decides where records go (logging HOWTO,
# "Configuring Logging for a Library").
_logging.getLogger(__name__).addHandler(_logging.NullHandler())

# What a training script needs, and no more: launcher details (detect_launch, LaunchInfo), comm
# hooks (CommHook, ...) and the profiler live in gradcomm.comm, gradcomm.hooks, gradcomm.profiler.
__all__ = [
    "__version__",
    "init",
    "Communicator",
    "Work",
    "ReduceOp",
    "Support",
    "SupportLevel",
    "available_backends",
    "register_backend",
    "CollectiveTimeoutError",
    "BackendUnavailableError",
    "SlowPathWarning",
    "GradientReducer",
    "apply_gradient_allreduce",
    "ShardedOptimizer",
]

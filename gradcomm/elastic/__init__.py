"""gradcomm.elastic: fault-tolerant data parallelism.

A failed worker costs one step, not the job: when a worker dies or stalls past the timeout, the
others agree on the new membership through a coordinator that outlives every worker
(:mod:`~gradcomm.elastic.coordinator`, a torch ``TCPStore`` in a process of its own), re-form
the communicator and what is built on it, discard the step that failed and go on with the next
global batch. A worker started later joins at a step boundary and receives the model, the
optimizer state and the step count from a live peer. See :class:`ElasticGroup` and
docs/fault-tolerance.md.
"""

from .coordinator import COORDINATOR_ENV
from .errors import ElasticError
from .group import ElasticGroup, Step
from .state import State

__all__ = ["COORDINATOR_ENV", "ElasticError", "ElasticGroup", "State", "Step"]

"""The error fault tolerance raises when the job cannot go on."""

from __future__ import annotations

__all__ = ["ElasticError"]


class ElasticError(RuntimeError):
    """The job cannot go on: fewer live workers than ``min_world_size``, the coordinator is
    unreachable, or this worker came after the job finished. Raised on every worker concerned,
    with the same message where they share the cause."""

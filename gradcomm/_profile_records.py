"""The profiler's records: one :class:`OpRecord` per collective, summaries per op and per step,
and nccl-tests' bus-bandwidth factors (``doc/PERFORMANCE.md`` in NVIDIA/nccl-tests).

Sizes are bytes, times seconds, bandwidths GB/s (10^9 bytes per second). :mod:`gradcomm.profiler`
re-exports these names; import them from there.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["OpRecord", "OpSummary", "StepSummary", "bus_factor", "summarize"]


def bus_factor(op: str, world_size: int) -> float:
    """The factor nccl-tests multiplies algbw by to get busbw (``doc/PERFORMANCE.md``).

    Args:
        op: ``"all_reduce"`` (``2(n-1)/n``); ``"all_gather"``, ``"reduce_scatter"``,
            ``"all_to_all"``, ``"gather"``, ``"scatter"`` (``(n-1)/n``); ``"broadcast"``,
            ``"reduce"`` (``1``); or ``"barrier"`` (``0``: it moves no payload).
        world_size: ``n``, the number of ranks (>= 1).

    Raises:
        ValueError: unknown op or world_size < 1.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    n = world_size
    if op == "all_reduce":
        return 2.0 * (n - 1) / n
    if op in ("all_gather", "reduce_scatter", "all_to_all", "gather", "scatter"):
        return (n - 1) / n
    if op in ("broadcast", "reduce"):
        return 1.0
    if op == "barrier":
        return 0.0
    raise ValueError(
        f"unknown collective {op!r}; known: all_reduce, all_gather, reduce_scatter, all_to_all, "
        "gather, scatter, broadcast, reduce, barrier"
    )


def _gbps(nbytes: float, seconds: float) -> float:
    return nbytes / seconds / 1e9 if seconds > 0 else 0.0


@dataclass(frozen=True)
class OpRecord:
    """One completed collective.

    Attributes:
        op: ``"all_reduce"``, ``"broadcast"``, ``"all_gather"`` or ``"barrier"``.
        bytes: size ``S`` in bytes as nccl-tests counts it (all_gather and gather: the whole
            output, 0 on a gather's non-root ranks; reduce_scatter and scatter: the whole input).
        count: number of elements of that buffer.
        dtype: element type, e.g. ``"float32"`` (``""`` for a barrier).
        backend: the communicator's backend name.
        rank, world_size: the communicator's.
        start: launch time, seconds since the profiler was created (``time.perf_counter``).
        duration: seconds from launch to observed completion (see the module docstring).
        label: what the caller named the data (e.g. ``"bucket 3"``), or None.
        step: index of the step it was launched in (see :meth:`Profiler.step`).
        async_op: launched with ``async_op=True``.
    """

    op: str
    bytes: int
    count: int
    dtype: str
    backend: str
    rank: int
    world_size: int
    start: float
    duration: float
    label: str | None
    step: int
    async_op: bool

    @property
    def algbw(self) -> float:
        """Algorithm bandwidth ``bytes / duration`` in GB/s (0 when the duration is 0)."""
        return _gbps(self.bytes, self.duration)

    @property
    def busbw(self) -> float:
        """Bus bandwidth ``algbw * bus_factor(op, world_size)`` in GB/s."""
        return self.algbw * bus_factor(self.op, self.world_size)


@dataclass(frozen=True)
class OpSummary:
    """Aggregate of the records of one collective type (or of all, ``op == "total"``).

    Attributes:
        op: collective name, or ``"total"``.
        calls: number of collectives.
        bytes: summed sizes in bytes.
        time: summed durations in seconds (overlapping async collectives count each).
        algbw: ``bytes / time`` in GB/s.
        busbw: ``sum(bytes_i * factor_i) / time`` in GB/s (for one op type ``algbw * factor``).
    """

    op: str
    calls: int
    bytes: int
    time: float
    algbw: float
    busbw: float


@dataclass(frozen=True)
class StepSummary:
    """Summary of one step (or of all steps when ``step`` is None).

    Attributes:
        step: step index, or None for every record.
        ops: one :class:`OpSummary` per collective type, in first-seen order.
        total: all collectives together.
        wall: seconds from the first launch to the last completion in the step.
    """

    step: int | None
    ops: list[OpSummary]
    total: OpSummary
    wall: float


def summarize(op: str, records: list[OpRecord]) -> OpSummary:
    nbytes = sum(r.bytes for r in records)
    seconds = sum(r.duration for r in records)
    bus_bytes = sum(r.bytes * bus_factor(r.op, r.world_size) for r in records)
    return OpSummary(op, len(records), nbytes, seconds, _gbps(nbytes, seconds),
                     _gbps(bus_bytes, seconds))

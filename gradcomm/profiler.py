"""Communication profiler: per-collective records, per-step summaries and a Chrome trace per rank.

Off by default. Turn it on for one communicator with the context manager::

    with gradcomm.profiler.profile(comm, trace_path="trace-rank{rank}.json") as prof:
        for batch in loader:
            ...                      # forward, backward (gradients all-reduced), optimizer step
            prof.step()              # closes the step: records after this belong to the next one
    print(prof.table())              # ops, bytes, time, algbw and busbw per collective

or for every communicator :func:`gradcomm.init` builds, without touching the script, with
``GRADCOMM_PROFILE=1``: the trace is then written when the communicator is closed (or at process
exit) to ``$GRADCOMM_PROFILE_DIR/gradcomm-trace-rank<rank>.json`` (default directory: the current
working directory) and the summary is logged at INFO level on the ``gradcomm.profiler`` logger.

What is measured. ``start`` is taken just before the backend launches the collective and
``duration`` runs until gradcomm observes its completion (``Work.wait()`` or ``is_completed()``
returning True), including gradcomm's own completion steps (the division of an emulated ``AVG``).
For synchronous collectives that is the collective's time. For ``async_op=True`` collectives it is
an upper bound: the time from launch until the caller waited, so overlapped bucket all-reduces
show how long each one was in flight, not how long the network took. On CUDA backends the host
clock stops when ``wait()`` returns, which for NCCL means the work was queued on the current
stream, not finished. World-size-1 communicators issue no collectives and record nothing.

Bandwidths follow nccl-tests' definitions (``doc/PERFORMANCE.md`` in
https://github.com/NVIDIA/nccl-tests): ``algbw = S / t`` with ``S`` the bytes of the buffer
(for all_gather and gather the whole output, ``world_size`` times the input; for reduce_scatter
and scatter the whole input) and ``busbw = algbw * factor``, ``factor`` = ``2(n-1)/n`` for
all_reduce, ``(n-1)/n`` for all_gather, reduce_scatter, all_to_all, gather and scatter, ``1`` for
broadcast and reduce (``n`` = world_size). Bandwidths are in GB/s (10^9 bytes per second), times
in seconds, sizes in bytes.

The trace is the Chrome "Trace Event Format" (JSON object with ``traceEvents``): one complete
(``"ph": "X"``) event per collective, ``pid`` = rank, timestamps in microseconds since the Unix
epoch so several ranks' files line up when opened together in https://ui.perfetto.dev or
``chrome://tracing``. Overlapping asynchronous collectives are placed on separate lanes (``tid``).
"""

from __future__ import annotations

import atexit
import itertools
import json
import logging
import os
import threading
import time
import weakref
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from ._profile_records import OpRecord, OpSummary, StepSummary, bus_factor, summarize
from .comm.communicator import Communicator
from .comm.launch.env import env_flag

__all__ = [
    "PROFILE_ENV",
    "PROFILE_DIR_ENV",
    "OpRecord",
    "OpSummary",
    "StepSummary",
    "Profiler",
    "profile",
    "bus_factor",
    "attach_from_env",
    "profile_requested",
    "trace_dir_from_env",
]

logger = logging.getLogger(__name__)

#: Environment variable that turns profiling on for :func:`gradcomm.init` (``1``/``true``/...).
PROFILE_ENV = "GRADCOMM_PROFILE"
#: Directory the ``GRADCOMM_PROFILE=1`` traces go to (default: the current working directory).
PROFILE_DIR_ENV = "GRADCOMM_PROFILE_DIR"

_trace_ids = itertools.count()  # distinct file names for several env-profiled comms per process


class Profiler:
    """Records every collective of one :class:`~gradcomm.comm.Communicator` while attached.

    Normally built by :func:`profile` or :func:`attach_from_env`; :meth:`attach` /
    :meth:`detach` do it by hand. Implements
    :class:`~gradcomm.comm.communicator.CollectiveObserver`.

    Args:
        comm: the communicator to observe.
        trace_dir: with ``write_on_close``, where :meth:`communicator_closed` writes the trace.
        write_on_close: write the trace (and log the summary) when ``comm`` is closed or at
            process exit, whichever comes first.
    """

    def __init__(
        self,
        comm: Communicator,
        *,
        trace_dir: str | os.PathLike[str] | None = None,
        write_on_close: bool = False,
    ) -> None:
        if not isinstance(comm, Communicator):
            raise TypeError(f"comm must be a gradcomm Communicator, got {type(comm).__name__}")
        if comm.closed:
            raise RuntimeError(f"{comm.backend} communicator is closed: nothing to profile")
        self.rank = comm.rank
        self.world_size = comm.world_size
        self.backend = comm.backend
        self.records: list[OpRecord] = []
        self.trace_dir = Path.cwd() if trace_dir is None else Path(trace_dir)
        self.write_on_close = write_on_close
        self.trace_file: Path | None = None  # set once the close/exit trace is written
        self._comm_ref = weakref.ref(comm)
        self._step = 0
        self._perf0 = time.perf_counter()
        self._wall0 = time.time()
        self._lock = threading.Lock()
        self._written = False

    # ------------------------------------------------------------------ attach / detach
    def attach(self) -> Profiler:
        """Make this profiler ``comm.profiler`` (replacing any other). Returns self.

        Raises:
            RuntimeError: the communicator no longer exists.
        """
        self._comm().profiler = self
        return self

    def detach(self) -> None:
        """Stop recording (``comm.profiler`` becomes None if it is this profiler)."""
        comm = self._comm_ref()
        if comm is not None and comm.profiler is self:
            comm.profiler = None

    def _comm(self) -> Communicator:
        comm = self._comm_ref()
        if comm is None:
            raise RuntimeError("the profiled communicator has been garbage-collected")
        return comm

    # ------------------------------------------------------------------ observer protocol
    def collective_started(
        self, op: str, tensor: torch.Tensor | None, label: str | None, async_op: bool
    ) -> Callable[[], None]:
        """Note the launch of ``op`` on ``tensor``; return the function that records completion."""
        if tensor is None:
            count, nbytes, dtype = 0, 0, ""
        else:
            count = tensor.numel()
            if op in ("reduce_scatter", "scatter"):  # handed the output: nccl-tests counts input
                count *= self.world_size
            nbytes = count * tensor.element_size()
            dtype = str(tensor.dtype).removeprefix("torch.")
        step = self._step
        start = time.perf_counter()

        def done() -> None:
            end = time.perf_counter()
            record = OpRecord(op, nbytes, count, dtype, self.backend, self.rank, self.world_size,
                              start - self._perf0, end - start, label, step, async_op)
            with self._lock:
                self.records.append(record)

        return done

    def communicator_closed(self) -> None:
        """With ``write_on_close``: write the trace and log the summary (once)."""
        if self.write_on_close:
            self._write_final()

    # ------------------------------------------------------------------ steps and summaries
    def step(self) -> None:
        """End the current step: collectives launched from now on count in the next one."""
        self._step += 1

    @property
    def current_step(self) -> int:
        """Index of the step collectives launched now are counted in (starts at 0)."""
        return self._step

    def clear(self) -> None:
        """Forget every record (the step counter is kept)."""
        with self._lock:
            self.records.clear()

    def summary(self, step: int | None = None) -> StepSummary:
        """Ops, bytes, time, algbw and busbw of ``step`` (None: of every record).

        Raises:
            TypeError: ``step`` is not an int or None.
        """
        if step is not None and (isinstance(step, bool) or not isinstance(step, int)):
            raise TypeError(f"step must be an int or None, got {type(step).__name__}")
        with self._lock:
            records = [r for r in self.records if step is None or r.step == step]
        by_op: dict[str, list[OpRecord]] = {}
        for r in records:
            by_op.setdefault(r.op, []).append(r)
        wall = (
            max(r.start + r.duration for r in records) - min(r.start for r in records)
            if records else 0.0
        )
        return StepSummary(
            step, [summarize(op, rs) for op, rs in by_op.items()], summarize("total", records),
            wall,
        )

    def steps(self) -> list[StepSummary]:
        """One :class:`StepSummary` per step that has records, in step order."""
        with self._lock:
            indices = sorted({r.step for r in self.records})
        return [self.summary(i) for i in indices]

    def table(self, step: int | None = None) -> str:
        """The summary of ``step`` (None: every record) as a text table, nccl-tests' units."""
        s = self.summary(step)
        which = "all steps" if step is None else f"step {step}"
        head = (
            f"# gradcomm profile: rank {self.rank}/{self.world_size} backend {self.backend}, "
            f"{which}, wall {s.wall * 1e3:.3f} ms"
        )
        lines = [
            head,
            f"{'op':>12} {'calls':>7} {'bytes':>14} {'time(ms)':>10} {'algbw(GB/s)':>12} "
            f"{'busbw(GB/s)':>12}",
        ]
        for row in [*s.ops, s.total]:
            lines.append(
                f"{row.op:>12} {row.calls:>7} {row.bytes:>14} {row.time * 1e3:>10.3f} "
                f"{row.algbw:>12.4f} {row.busbw:>12.4f}"
            )
        return "\n".join(lines)

    # ------------------------------------------------------------------ Chrome trace
    def chrome_trace(self) -> dict[str, Any]:
        """The records as a Chrome Trace Event Format object (``{"traceEvents": [...]}``).

        One ``"ph": "X"`` event per record (``ts``/``dur`` in microseconds, ``ts`` since the Unix
        epoch), ``pid`` = rank; synchronous collectives on lane (``tid``) 0, overlapping
        asynchronous ones on lanes 1, 2, ... so that no two events on a lane overlap.
        """
        with self._lock:
            records = sorted(self.records, key=lambda r: r.start)
        events: list[dict[str, Any]] = [
            {"name": "process_name", "ph": "M", "pid": self.rank, "tid": 0,
             "args": {"name": f"rank {self.rank} ({self.backend})"}},
        ]
        lane_ends: list[float] = []  # end time of the last event on async lane i + 1
        for r in records:
            tid = 0
            if r.async_op:
                end = r.start + r.duration
                for i, lane_end in enumerate(lane_ends):
                    if lane_end <= r.start:
                        lane_ends[i], tid = end, i + 1
                        break
                else:
                    lane_ends.append(end)
                    tid = len(lane_ends)
            events.append({
                "name": r.op if r.label is None else f"{r.op} {r.label}",
                "cat": "gradcomm",
                "ph": "X",
                "ts": (self._wall0 + r.start) * 1e6,
                "dur": r.duration * 1e6,
                "pid": self.rank,
                "tid": tid,
                "args": {
                    "bytes": r.bytes, "count": r.count, "dtype": r.dtype, "label": r.label,
                    "step": r.step, "async_op": r.async_op, "backend": r.backend,
                    "algbw_GBps": r.algbw, "busbw_GBps": r.busbw,
                },
            })
        return {
            "traceEvents": events,
            "displayTimeUnit": "ms",
            "otherData": {
                "rank": self.rank, "world_size": self.world_size, "backend": self.backend,
                "summary": asdict(self.summary()),
            },
        }

    def export_chrome_trace(self, path: str | os.PathLike[str]) -> Path:
        """Write :meth:`chrome_trace` as JSON to ``path``; ``{rank}`` in it is replaced by the rank.

        Returns:
            The path written. Parent directories are created.

        Raises:
            OSError: the file cannot be written.
        """
        out = Path(str(path).replace("{rank}", str(self.rank)))
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(self.chrome_trace()))
        logger.debug("rank %d: wrote %d collectives to %s", self.rank, len(self.records), out)
        return out

    def _write_final(self) -> None:
        with self._lock:
            if self._written:
                return
            self._written = True
        k = next(_trace_ids)
        name = f"gradcomm-trace-rank{self.rank}" + ("" if k == 0 else f"-{k}") + ".json"
        self.trace_file = self.export_chrome_trace(self.trace_dir / name)
        logger.info("%s\nChrome trace: %s", self.table(), self.trace_file)


@contextmanager
def profile(
    comm: Communicator, *, trace_path: str | os.PathLike[str] | None = None
) -> Iterator[Profiler]:
    """Record every collective ``comm`` issues inside the ``with`` block.

    Args:
        comm: the communicator to observe (its previous ``profiler``, if any, is restored after).
        trace_path: if given, the Chrome trace is written there on exit; ``{rank}`` in it is
            replaced by the rank (e.g. ``"trace-rank{rank}.json"``).

    Yields:
        The :class:`Profiler`; its records and summaries stay readable after the block.

    Raises:
        TypeError: ``comm`` is not a Communicator.
        RuntimeError: ``comm`` is closed.
    """
    prof = Profiler(comm)
    previous = comm.profiler
    comm.profiler = prof
    try:
        yield prof
    finally:
        comm.profiler = previous
        if trace_path is not None:
            prof.export_chrome_trace(trace_path)


def profile_requested(env: Mapping[str, str] | None = None) -> bool:
    """Whether ``GRADCOMM_PROFILE`` (in ``env``, default os.environ) turns profiling on.

    Unset or empty: off. The words are :func:`gradcomm.comm.launch.env.env_flag`'s.

    Raises:
        ValueError: it is set to something that is neither on (1/true/yes/on) nor off
            (0/false/no/off).
    """
    return env_flag(PROFILE_ENV, False, env)


def trace_dir_from_env(
    env: Mapping[str, str] | None = None, *, create: bool = False
) -> Path | None:
    """The directory ``GRADCOMM_PROFILE_DIR`` names (None when unset or blank).

    Checked by :func:`gradcomm.init` before training starts (with ``create=True``: the
    directory is made then, as the trace will be written into it), not when the trace is written
    at the end of the job.

    Raises:
        ValueError: the path, or the first of its parents that exists, is not a directory, or
            the path cannot be examined or (``create``) made: a name too long for the file
            system, no permission.
    """
    env = os.environ if env is None else env
    raw = env.get(PROFILE_DIR_ENV, "").strip()
    if not raw:
        return None
    path = Path(raw)
    try:
        # the first part of the path that exists must be a directory (it is created below it)
        existing = next((p for p in (path, *path.parents) if p.exists()), None)
        if existing is not None and not existing.is_dir():
            where = "is" if existing == path else f"is below {str(existing)!r}, which is"
            raise ValueError(f"{PROFILE_DIR_ENV}={raw!r} {where} not a directory (the traces "
                             "are written into it as gradcomm-trace-rank<rank>.json)")
        if create:
            path.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ValueError(f"{PROFILE_DIR_ENV}={raw!r} cannot be used: {exc}") from None
    return path


def attach_from_env(comm: Communicator, env: Mapping[str, str] | None = None) -> Profiler | None:
    """Attach a write-on-close :class:`Profiler` to ``comm`` when ``GRADCOMM_PROFILE`` is on.

    Called by :func:`gradcomm.init`. The trace goes to ``GRADCOMM_PROFILE_DIR`` (default: the
    current working directory) as ``gradcomm-trace-rank<rank>.json`` when ``comm`` is closed, or
    at process exit if it never is.

    Returns:
        The attached profiler, or None when profiling is off.

    Raises:
        ValueError: ``GRADCOMM_PROFILE`` is set to something that is neither on nor off, or
            ``GRADCOMM_PROFILE_DIR`` is a file.
    """
    env = os.environ if env is None else env
    if not profile_requested(env):
        return None
    trace_dir = trace_dir_from_env(env)
    prof = Profiler(comm, trace_dir=trace_dir, write_on_close=True).attach()
    atexit.register(prof._write_final)  # no-op if the communicator was closed first
    logger.debug("rank %d: profiling %s collectives, trace to %s", comm.rank, comm.backend,
                 prof.trace_dir)
    return prof

"""ElasticGroup: data-parallel training that survives failed workers and admits new ones.

A training script adds a few lines::

    state = elastic.State(model, optimizer)                    # what a joining worker receives
    group = elastic.ElasticGroup(state, build, min_world_size=2, timeout=10.0)
    for step in group.steps(total_steps):                      # re-forms the group when needed
        with step as comm:                                     # discarded and retried on failure
            x, y = global_batch(step.index)
            ...forward on this rank's shard, backward, optimizer.step()

where ``build(comm, state)`` makes what runs over each new communicator (a
:class:`~gradcomm.GradientReducer`, comm-hook state) and returns the reducer. The guide is
docs/fault-tolerance.md.
"""

from __future__ import annotations

import math
import numbers
import os
import socket
import uuid
from collections.abc import Callable, Iterator
from types import TracebackType

import torch
import torch.distributed as dist

from ..comm import Communicator
from ..hooks import GradientReducer
from ._formation import Build, Formation, brief
from ._membership import Generation, Membership
from ._monitor import Monitor
from ._transports import CommunicatorFactory, factory_for
from .coordinator import COORDINATOR_ENV, connect
from .state import State

__all__ = ["Build", "ElasticGroup", "Step"]


def _seconds(name: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a number of seconds, got {type(value).__name__}")
    seconds = float(value)
    if not 0 < seconds < math.inf:
        raise ValueError(f"{name} must be a positive, finite number of seconds, got {value!r}")
    return seconds


def _count(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or int(value) < 1:
        raise ValueError(f"{name} must be an int >= 1, got {value!r}")
    return int(value)


class Step:
    """One training step of :meth:`ElasticGroup.steps`: enter it with ``with step as comm:``.

    Leaving the block normally commits the step (``state.step`` becomes ``index + 1``). When a
    collective inside it fails (a peer died, stalled past the timeout, or the group is re-formed
    for a joining worker), the block's exception is swallowed, the step is discarded on this
    worker (its gradients dropped; unless its optimizer step had already been applied), and
    :meth:`ElasticGroup.steps` re-forms the group and yields the step to take next. Any other
    exception propagates, and this worker leaves the group.

    Attributes:
        index: the global step: the number of optimizer steps applied before it, on every
            worker. Choose the step's global batch by it.
    """

    def __init__(self, group: ElasticGroup, index: int) -> None:
        self.index = index
        self._group = group
        self.entered = False

    def __enter__(self) -> Communicator:
        self.entered = True
        self._group._applied = False  # an optimizer step outside the block does not count
        return self._group.comm

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> bool:
        return self._group._end_step(self, exc)

    def __repr__(self) -> str:
        return f"<Step {self.index}>"


class ElasticGroup:
    """Fault-tolerant data parallelism: the communicator of a group of workers whose membership
    changes at step boundaries, agreed through a coordinator that outlives the workers.

    Args:
        state: the :class:`~gradcomm.elastic.State` to keep consistent (model, optimizer, step).
        build: ``build(comm, state)``, called with every new communicator once the state is
            agreed: build what runs over it -- a :class:`~gradcomm.GradientReducer`, comm-hook
            state (a new ``PowerSGDState(comm)``) -- and return the reducer (or None), which is
            removed at the next re-formation. None: nothing is built (a script that reduces by
            hand). A :class:`~gradcomm.ShardedOptimizer` is made here too (assign it to
            ``state.optimizer``): its full state is then kept as a snapshot (below).
        coordinator: ``"host:port"`` of the coordinator (``python -m
            gradcomm.elastic``); default ``GRADCOMM_COORDINATOR``.
        backend: ``"gloo"``, ``"nccl"``, ``"cupy-nccl"``, or a factory
            ``(launch, timeout, device) -> Communicator`` of your own, building its group over
            ``launch.store`` (the generation's prefix of the coordinator's store); default as
            :func:`gradcomm.init` chooses. ``"mpi"`` is refused (ValueError).
        device: the device of this worker's communicator; default the backend's (nccl and
            cupy-nccl: ``cuda:<LOCAL_RANK>``, from the environment; it stays fixed across
            re-formations).
        min_world_size: the fewest workers the job may continue with (torchrun's ``--nnodes``
            minimum, torchft's ``min_replica_size``): when fewer are alive after a failure, and
            none joins within ``join_timeout``, every survivor raises
            :class:`~gradcomm.elastic.ElasticError`.
        world_size: how many workers the first generation waits for (at most ``join_timeout``
            seconds); default ``WORLD_SIZE`` from the environment, else ``min_world_size``.
        timeout: seconds a collective may take (the communicator's timeout, as DDP's): a worker
            that stalls longer is left out. Also how long a re-formation waits for a member
            that still heartbeats.
        heartbeat_timeout: seconds without a heartbeat after which a worker counts as dead
            (heartbeats every ``heartbeat_timeout / 5`` s, at most every 0.1 s). A killed
            worker's group re-forms after about this long.
        join_timeout: seconds a formation waits for workers to join when fewer than needed.
        job_id: the job's name on the coordinator (jobs sharing one use different names).
        snapshot_every: with a :class:`~gradcomm.ShardedOptimizer`, steps between snapshots of
            its full state in every worker's host memory (its collective ``state_dict()``: one
            all-gather per bucket and state key). Each rank holds the only copy of its shard, so
            after a failure every worker returns to the newest snapshot and takes the steps
            since again. Ignored with an unsharded optimizer (nothing is repeated there).

    Raises:
        TypeError / ValueError: an argument of the wrong type or range, no coordinator address,
            the mpi backend, a device the backend does not take.
        RuntimeError: no coordinator answered within ``timeout``.

    Use it as a context manager, or call :meth:`close` at the end.
    """

    def __init__(self, state: State, build: Build | None = None, *,
                 coordinator: str | None = None,
                 backend: str | CommunicatorFactory | None = None,
                 device: torch.device | str | None = None,
                 min_world_size: int = 1, world_size: int | None = None,
                 timeout: float = 30.0, heartbeat_timeout: float = 2.0,
                 join_timeout: float = 60.0, job_id: str = "default",
                 snapshot_every: int = 1) -> None:
        if not isinstance(state, State):
            raise TypeError(f"state must be a gradcomm.elastic.State, got {type(state).__name__}")
        if build is not None and not callable(build):
            raise TypeError(f"build must be callable or None, got {type(build).__name__}")
        self._min = _count("min_world_size", min_world_size)
        env_size = os.environ.get("WORLD_SIZE", "").strip()
        first = world_size if world_size is not None else (
            int(env_size) if env_size.isdigit() else self._min)
        self._first = _count("world_size", first)
        if self._first < self._min:
            raise ValueError(f"world_size ({self._first}) must be >= min_world_size "
                             f"({self._min})")
        self._timeout = _seconds("timeout", timeout)
        self._heartbeat_timeout = _seconds("heartbeat_timeout", heartbeat_timeout)
        self._join_timeout = _seconds("join_timeout", join_timeout)
        if not isinstance(job_id, str) or not job_id or "/" in job_id:
            raise ValueError(f"job_id must be a non-empty str without '/', got {job_id!r}")
        self._snapshot_every = _count("snapshot_every", snapshot_every)
        self.backend, self._factory = factory_for(backend)
        self._device = self._resolve_device(device)
        address = coordinator if coordinator is not None else os.environ.get(COORDINATOR_ENV)
        if not address:
            raise ValueError(f"no coordinator: pass coordinator='host:port' or set "
                             f"{COORDINATOR_ENV} (start one: python -m "
                             "gradcomm.elastic)")
        self.coordinator = address
        self._state = state
        self.worker_id = f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"
        client = connect(address, self._timeout)
        prefix = f"gradcomm-elastic/{job_id}"
        self._store = dist.PrefixStore(prefix, client)
        self._membership = Membership(
            self._store, self.worker_id, socket.gethostname(), min_world_size=self._min,
            world_size=self._first, timeout=self._timeout,
            heartbeat_timeout=self._heartbeat_timeout, join_timeout=self._join_timeout)
        monitor_client = client.clone()  # type: ignore[attr-defined]  # a second connection
        self._monitor = Monitor(dist.PrefixStore(prefix, monitor_client),
                                self._membership.heartbeat_key,
                                min(0.1, self._heartbeat_timeout / 5))
        self._formation = Formation(self._membership, self._monitor, self._store, self._factory,
                                    self._device, self._timeout, state, build, address)
        self._applied = False  # the optimizer stepped inside the current step
        self._hooked: tuple[int, object] | None = None
        self._closed = False

    def _resolve_device(self, device: torch.device | str | None) -> torch.device | None:
        if device is None:
            if self.backend in ("nccl", "cupy-nccl"):
                return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0") or 0))
            return None
        if not isinstance(device, (str, torch.device)):
            raise TypeError(f"device must be a str or torch.device, got {type(device).__name__}")
        dev = torch.device(device)
        if self.backend == "gloo" and dev.type != "cpu":
            raise ValueError(f"the gloo backend works on cpu tensors, not {dev}")
        return dev

    # ------------------------------------------------------------------ what scripts read
    @property
    def comm(self) -> Communicator:
        """The current generation's communicator (formed by the first :meth:`steps` step).

        Raises:
            RuntimeError: no generation is formed yet.
        """
        comm = self._formation.comm
        if comm is None:
            raise RuntimeError("no generation is formed yet: iterate over group.steps(...)")
        return comm

    @property
    def rank(self) -> int:
        """This worker's rank in the current generation."""
        return self.comm.rank

    @property
    def world_size(self) -> int:
        """Number of workers in the current generation."""
        return self.comm.world_size

    @property
    def generation(self) -> int:
        """The current generation's number (0 before the first)."""
        return self._formation.number

    @property
    def reducer(self) -> GradientReducer | None:
        """What ``build`` returned for the current generation."""
        return self._formation.reducer

    @property
    def last_formation_s(self) -> float | None:
        """Seconds the last formation took (from leaving the old generation to the new one's
        state being agreed), or None before the first."""
        return self._formation.last_formation_s

    # ------------------------------------------------------------------ the loop
    def steps(self, total: int) -> Iterator[Step]:
        """Yield the steps to take until ``state.step`` reaches ``total`` on every worker.

        Before each step it forms the group when needed (the first time, after a failure, when
        a worker joins) and agrees the state. At the end every member of the last generation
        confirms through the coordinator that it finished too, so all end with the same state;
        a member that failed in the last step is brought up to date first.

        Raises:
            ElasticError: fewer live workers than ``min_world_size`` (after ``join_timeout``),
                the coordinator is unreachable, or the job finished before this worker joined.
            RuntimeError: a yielded step was not entered (``with step as comm:``).
        """
        given: object = total  # annotated int, but callers pass anything
        if isinstance(given, bool) or not isinstance(given, numbers.Integral) or int(given) < 0:
            raise ValueError(f"total must be an int >= 0, got {total!r}")
        if self._closed:
            raise RuntimeError("this ElasticGroup is closed")
        while True:
            self._formation.ensure()
            if self._state.step >= total:
                if self._agree(self._membership.finish):
                    self._membership.mark_finished(self._state.step)
                    return
                self._formation.ended.set()
                continue
            step = Step(self, self._state.step)
            self._hook_optimizer()
            yield step
            if not step.entered:
                raise RuntimeError("group.steps(): enter each step with 'with step as comm:' "
                                   "(it commits the step, or discards it on a failure)")

    def _agree(self, fn: Callable[[Generation], bool]) -> bool:
        generation = self._formation.generation
        assert generation is not None
        try:
            return fn(generation)
        except (RuntimeError, dist.DistError) as exc:
            raise self._formation.coordinator_lost(exc) from exc

    def _hook_optimizer(self) -> None:
        opt = self._state.optimizer
        if opt is None or (self._hooked is not None and self._hooked[0] == id(opt)):
            return
        handle = opt.register_step_post_hook(lambda *_: setattr(self, "_applied", True))
        self._hooked = (id(opt), handle)

    def _end_step(self, step: Step, exc: BaseException | None) -> bool:
        applied, self._applied = self._applied, False
        if exc is None:
            self._state.step = step.index + 1
            if (self._state.snapshot is not None
                    and self._state.step % self._snapshot_every == 0):
                self._formation.snapshot()
            return False
        formation = self._formation
        if not isinstance(exc, Exception) or not formation.is_failure(exc, formation.number):
            formation.leave(f"raised {brief(exc, 60)}")
            return False
        if applied:  # the failure came after this worker's optimizer step: the step counts
            self._state.step = step.index + 1
        else:
            formation.discard()
        formation.fail(f"worker {self.worker_id} (rank {self.rank}) failed in step "
                       f"{step.index}: {brief(exc)}")
        return True

    # ------------------------------------------------------------------ the end
    def close(self) -> None:
        """Leave the job (the others stop waiting for this worker), stop heartbeating and
        release the communicators. Waits up to ``timeout`` seconds for the communicators of
        earlier generations, whose transport may still be ending a collective. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._formation.leave("closed")
        self._monitor.close()
        self._formation.close()

    def __enter__(self) -> ElasticGroup:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        where = "not formed" if self._formation.comm is None else (
            f"generation {self.generation}, rank {self.rank}/{self.world_size}")
        return f"<ElasticGroup {self.backend} {where}, step {self._state.step}>"

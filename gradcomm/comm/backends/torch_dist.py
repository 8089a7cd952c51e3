"""Shared code of the backends built on torch.distributed process groups (gloo, nccl).

Each communicator owns a process group of its own, built on a store from
:mod:`gradcomm.comm._rendezvous`; it never creates or changes the user's default process group, so a
script may use ``torch.distributed`` beside gradcomm.
"""

from __future__ import annotations

import abc
import atexit
import dataclasses
import datetime
import functools
import os
import re
import threading
import time
import weakref
from typing import ClassVar

import torch
import torch.distributed as dist

from ..checks import flat_bytes
from ..communicator import Communicator, SplitPlan
from ..errors import MESSAGE_LIMIT, brief
from ..launch.launcher import Launcher, LaunchInfo
from ..launch.rendezvous import rendezvous
from ..types import ReduceOp
from ..work import DescriptionLike, Work

__all__ = ["TorchWork", "TorchDistCommunicator"]

_TORCH_OPS: dict[ReduceOp, dist.ReduceOp.RedOpType] = {
    ReduceOp.SUM: dist.ReduceOp.SUM,
    ReduceOp.MIN: dist.ReduceOp.MIN,
    ReduceOp.MAX: dist.ReduceOp.MAX,
    ReduceOp.PRODUCT: dist.ReduceOp.PRODUCT,
    ReduceOp.AVG: dist.ReduceOp.AVG,
}


@functools.cache
def _reduce_options(op: ReduceOp) -> dist.AllreduceOptions:
    # Built once per op and reused (process groups only read them): building one is two pybind
    # constructions, a visible part of a small all-reduce's cost.
    opts = dist.AllreduceOptions()
    opts.reduceOp = dist.ReduceOp(_TORCH_OPS[op])
    return opts


@functools.cache
def _reduce_scatter_options(op: ReduceOp) -> dist.ReduceScatterOptions:
    opts = dist.ReduceScatterOptions()
    opts.reduceOp = dist.ReduceOp(_TORCH_OPS[op])
    return opts


@functools.lru_cache(maxsize=8)
def _timedelta(seconds: float) -> datetime.timedelta:
    return datetime.timedelta(seconds=seconds)


#: Longest single wait on a torch Work, in seconds, on a communicator that can be aborted: gloo
#: cannot interrupt a wait, so a longer one is cut into waits this long that each check whether
#: :meth:`TorchDistCommunicator.abort` was called. A wait that ends sooner costs nothing more.
ABORT_POLL_S = 0.1


def _close_if_alive(ref: weakref.ref[Communicator]) -> None:
    comm = ref()
    if comm is not None:
        comm.close()


class TorchWork(Work):
    """Wraps a :class:`torch.distributed.Work`; its timeout errors become TimeoutError, and
    :meth:`~Work.is_completed` raises the transport's error for a collective that failed.

    ``aborted`` (optional): the communicator's abort flag; while it is clear a wait is cut into
    waits of at most :data:`ABORT_POLL_S`, and once set a wait or test raises RuntimeError.
    """

    def __init__(
        self,
        work: dist.Work,
        description: DescriptionLike,
        timeout: float | None,
        aborted: threading.Event | None = None,
    ) -> None:
        super().__init__(description, timeout)
        self._work = work
        # The process group's own timeout (the communicator's): it ends the collective then,
        # whatever a wait asks for.
        self._group_timeout = timeout
        self._abort_flag = aborted
        #: A receive from any rank: sets :attr:`source` once complete.
        self.any_source = False

    def _limit(self, requested: float | None) -> float | None:
        cap = self._group_timeout
        if cap is None or (requested is not None and requested <= cap):
            return requested
        return cap

    def _failed(self, exc: BaseException) -> str:
        """The message of a transport failure, within MESSAGE_LIMIT: gloo's own messages start
        with their source location (dropped; the chained exception keeps it) and end with long
        advice."""
        text = re.sub(r"^\[[^\]]*\]\s*", "", str(exc))
        rest = f" failed: {brief(text, 110)}"
        return brief(str(self.description), MESSAGE_LIMIT - len(rest)) + rest

    def _check_aborted(self) -> None:
        if self._abort_flag is not None and self._abort_flag.is_set():
            raise RuntimeError(f"{self.description} failed: the communicator was aborted")

    def _wait(self, timeout: float | None) -> None:
        if self._abort_flag is None:
            self._wait_once(timeout)
            return
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            self._check_aborted()
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                raise TimeoutError(f"{self.description} did not complete within {timeout} s")
            try:
                self._wait_once(ABORT_POLL_S if left is None else min(ABORT_POLL_S, left))
                return
            except TimeoutError:
                if self._work.is_completed():
                    # Done by now: failed by the group's own timeout, or completed just after
                    # this slice ended (a race that made a good collective fail). Its own
                    # outcome decides: wait() returns at once, or raises its error again.
                    self._wait_once(None)
                    return
                # else only this slice of the wait ended: check the flag and wait on

    def _wait_once(self, timeout: float | None) -> None:
        try:
            if timeout is None:
                self._work.wait()
            else:
                # torch reads a timeout of 0 ms (kNoTimeout) as "the group's": never ask for
                # less than a millisecond, or a wait's last slice would last the group timeout.
                self._work.wait(_timedelta(max(timeout, 0.001)))
        except RuntimeError as exc:  # torch reports timeouts as RuntimeError/DistBackendError
            text = str(exc).lower()
            if "timed out" in text or "timeout" in text:
                raise TimeoutError(str(exc)) from exc
            raise RuntimeError(self._failed(exc)) from exc
        if self.any_source:
            # the sender, as torch.distributed.recv reads it from the same work
            self.source = self._work._source_rank()

    def _test(self) -> bool:
        # torch's is_completed() is also True for a collective that failed or timed out; its
        # wait() then raises at once, so a failure surfaces here instead of passing as done.
        if not self._work.is_completed():
            self._check_aborted()
            return False
        try:
            self._wait_once(None)
        except TimeoutError as exc:  # completed by the group's own timeout: it failed
            raise RuntimeError(self._failed(exc)) from exc
        return True


class TorchDistCommunicator(Communicator):
    """A communicator over one torch.distributed process group (subclassed per backend).

    Subclasses implement :meth:`_make_group` and :meth:`supports`.

    ``launch.store`` (optional): a store every rank shares, given by the caller (see
    :class:`~gradcomm.comm.LaunchInfo`); the group is built over it as it is and no rendezvous
    runs. The transport then binds its default address (on several hosts, set the backend's
    interface variable, ``GLOO_SOCKET_IFNAME`` / ``NCCL_SOCKET_IFNAME``).

    Attributes:
        bind_address: the IPv4 address the transport binds when the ranks span hosts (see
            :func:`gradcomm.comm._rendezvous.rendezvous`); None on one host or world_size 1.
        bind_interface: the name of the interface carrying it (None if unknown).
    """

    #: The variable naming the transport's network interface; set by the user, it wins.
    interface_variable: ClassVar[str | None] = None
    #: Whether the transport reads its interface only from ``interface_variable``, so gradcomm
    #: sets it (when unset) to the interface it chose: NCCL's bootstrap has no other input.
    exports_interface: ClassVar[bool] = False
    #: Whether a send's or receive's wait may be cut into slices (to see :meth:`abort`): not
    #: on gloo, where a transfer whose timed wait elapses fails ("Timed out waiting 100ms for
    #: send operation to complete"), so a peer 0.1 s late broke it.
    transfer_waits_sliced: ClassVar[bool] = True

    def __init__(self, launch: LaunchInfo, *, device: torch.device,
                 timeout: float | None) -> None:
        super().__init__(
            rank=launch.rank,
            world_size=launch.world_size,
            local_rank=launch.local_rank,
            device=device,
            timeout=timeout,
        )
        self.launch = launch
        self._abort_flag = threading.Event()  # set by abort(), from any thread
        self._group: dist.ProcessGroup | None = None
        # The job's store: sub-communicators build their groups over it under a prefix.
        self._store: dist.Store | None = None
        self.bind_address: str | None = None
        self.bind_interface: str | None = None
        if launch.world_size > 1 and launch.store is not None:
            self._store = launch.store
            self._group = self._make_group(launch.store, launch, timeout)
        elif launch.world_size > 1:
            found = rendezvous(launch, timeout, self.backend,
                               interface_variable=self.interface_variable)
            self.bind_address, self.bind_interface = found.bind_address, found.interface
            variable = self.interface_variable
            if (self.exports_interface and variable is not None and found.interface is not None
                    and not os.environ.get(variable, "").strip()):
                os.environ[variable] = f"={found.interface}"  # "=": that exact name
            self._store = found.store
            self._group = self._make_group(found.store, launch, timeout)
        self._register_close_at_exit()

    def _register_close_at_exit(self) -> None:
        # A gloo group still alive at interpreter teardown can abort the process ("terminate
        # called without an active exception", exit code 6; seen in 1 of 2 runs under mpiexec),
        # so a communicator the user never closed is closed by an atexit handler. Registered
        # after mpi4py's, it runs before MPI_Finalize.
        self._close_at_exit = functools.partial(_close_if_alive, weakref.ref(self))
        atexit.register(self._close_at_exit)

    @abc.abstractmethod
    def _make_group(
        self, store: dist.Store, launch: LaunchInfo, timeout: float | None
    ) -> dist.ProcessGroup:
        """Build this backend's process group over ``store``."""

    @property
    def process_group(self) -> dist.ProcessGroup | None:
        """The underlying process group (None when world_size is 1)."""
        return self._group

    def _wrap(self, work: dist.Work | None, description: DescriptionLike) -> Work:
        if work is None:  # pragma: no cover - async_op=True always returns a Work
            raise RuntimeError(f"{description}: torch.distributed returned no Work")
        return TorchWork(work, description, self._timeout, self._abort_flag)

    # The process group's own methods: they need no registration in torch's default world
    # (the functional ``dist.broadcast`` refuses unregistered groups).
    def _pg(self) -> dist.ProcessGroup:
        if self._abort_flag.is_set():
            raise RuntimeError(f"{self.backend} communicator was aborted")
        if self._group is None:  # pragma: no cover - world_size 1 never reaches a collective
            raise RuntimeError(f"{self.backend} communicator has no process group")
        return self._group

    def _all_reduce(self, tensor: torch.Tensor, op: ReduceOp, description: DescriptionLike) -> Work:
        return self._wrap(self._pg().allreduce([tensor], _reduce_options(op)), description)

    # broadcast and all_gather move bytes, so they go as uint8 views: any dtype works (gloo
    # rejects uint16/32/64, float8 and, for all_gather, complex with "Invalid scalar type").
    def _broadcast(self, tensor: torch.Tensor, src: int, description: DescriptionLike) -> Work:
        opts = dist.BroadcastOptions()
        opts.rootRank = src
        return self._wrap(self._pg().broadcast([flat_bytes(tensor)], opts), description)

    def _all_gather(
        self, output: torch.Tensor, input: torch.Tensor, description: DescriptionLike
    ) -> Work:
        chunks = list(flat_bytes(output).chunk(self.world_size))
        return self._wrap(self._pg().allgather([chunks], [flat_bytes(input)]), description)

    def _reduce_scatter(self, output: torch.Tensor, input: torch.Tensor, op: ReduceOp,
                        description: DescriptionLike) -> Work:
        # The group's list form: chunk r of input (a view, no copy) is reduced into rank r.
        # Detached views of the same memory: gloo copies the result in with an autograd-aware
        # copy_, which a leaf that requires grad (an nn.Parameter) refuses.
        chunks = list(input.detach().chunk(self.world_size))
        work = self._pg().reduce_scatter([output.detach()], [chunks],
                                         _reduce_scatter_options(op))
        return self._wrap(work, description)

    def _all_to_all(self, output: torch.Tensor, input: torch.Tensor, output_counts: list[int],
                    input_counts: list[int], description: DescriptionLike) -> Work:
        # As bytes (any dtype); the counts are then byte counts along the 1-D views.
        size = input.element_size()
        work = self._pg().alltoall_base(flat_bytes(output), flat_bytes(input),
                                        [c * size for c in output_counts],
                                        [c * size for c in input_counts], dist.AllToAllOptions())
        return self._wrap(work, description)

    def _reduce(self, tensor: torch.Tensor, dst: int, op: ReduceOp,
                description: DescriptionLike) -> Work:
        opts = dist.ReduceOptions()
        opts.reduceOp = dist.ReduceOp(_TORCH_OPS[op])
        opts.rootRank = dst
        return self._wrap(self._pg().reduce([tensor], opts), description)

    def _gather(self, output: torch.Tensor | None, input: torch.Tensor, dst: int,
                description: DescriptionLike) -> Work:
        opts = dist.GatherOptions()
        opts.rootRank = dst
        chunks = [] if output is None else [list(flat_bytes(output).chunk(self.world_size))]
        return self._wrap(self._pg().gather(chunks, [flat_bytes(input)], opts), description)

    def _scatter(self, output: torch.Tensor, input: torch.Tensor | None, src: int,
                 description: DescriptionLike) -> Work:
        opts = dist.ScatterOptions()
        opts.rootRank = src
        chunks = [] if input is None else [list(flat_bytes(input).chunk(self.world_size))]
        return self._wrap(self._pg().scatter([flat_bytes(output)], chunks, opts), description)

    def _barrier(self, description: DescriptionLike) -> Work:
        # An all-reduce of one element: the same on every process group type.
        token = torch.zeros(1, device=self.device)
        return self._wrap(self._pg().allreduce([token], _reduce_options(ReduceOp.SUM)), description)

    # ------------------------------------------------------------------ point-to-point
    # As bytes (see _broadcast); both sides then agree on sizes in bytes, which gloo checks.
    def _send(self, tensor: torch.Tensor, dst: int, tag: int, description: DescriptionLike) -> Work:
        return self._transfer(self._pg().send([flat_bytes(tensor)], dst, tag), description)

    def _recv(self, tensor: torch.Tensor, src: int, tag: int, description: DescriptionLike) -> Work:
        return self._transfer(self._pg().recv([flat_bytes(tensor)], src, tag), description)

    def _recv_any(self, tensor: torch.Tensor, tag: int, description: DescriptionLike) -> Work:
        work = self._transfer(self._pg().recv_anysource([flat_bytes(tensor)], tag), description)
        work.any_source = True
        return work

    def _transfer(self, work: dist.Work, description: DescriptionLike) -> TorchWork:
        """A send's or receive's work: waited for in one piece where slices would break it
        (:attr:`transfer_waits_sliced`; :meth:`abort` then does not cut its wait short)."""
        return TorchWork(work, description, self._timeout,
                         self._abort_flag if self.transfer_waits_sliced else None)

    # ------------------------------------------------------------------ sub-communicators
    def _split_child(self, plan: SplitPlan) -> TorchDistCommunicator | None:
        """A communicator of ``plan``'s members: a new process group of this backend over the
        job's store under ``plan.prefix`` (members only; torch's ``new_group`` does the same
        with the default group's store). The bound address and interface are the parent's."""
        if plan.color is None:
            return None
        launch = LaunchInfo(plan.rank, len(plan.members), plan.local_rank,
                            plan.local_world_size, Launcher.EXPLICIT)
        child = object.__new__(type(self))  # the subclass's state, without a rendezvous
        Communicator.__init__(child, rank=plan.rank, world_size=len(plan.members),
                              local_rank=plan.local_rank, device=self.device,
                              timeout=self._timeout)
        child.launch = launch
        child._abort_flag = threading.Event()
        child._group = None
        child._store = None
        child.bind_address, child.bind_interface = self.bind_address, self.bind_interface
        if launch.world_size > 1:
            if self._store is None:  # pragma: no cover - a parent of world_size 1 has 1 member
                raise RuntimeError(f"{self.backend} communicator has no store to split")
            child._store = dist.PrefixStore(plan.prefix, self._store)
            child._group = child._make_group(child._store, launch, self._timeout)
        child._register_close_at_exit()
        return child

    def abort(self) -> None:
        """End this communicator at once, from any thread (see :meth:`Communicator.abort`): a
        wait in progress raises RuntimeError within :data:`ABORT_POLL_S` seconds, and so does
        every later collective (on gloo, a send or receive already posted waits on until it
        completes or times out: see :attr:`transfer_waits_sliced`). gloo has no way to cancel a
        running collective, so its transport is released only by :meth:`close`, which blocks
        until that collective ends."""
        self._abort_flag.set()

    def _subgroup_child(self, plan: SplitPlan) -> TorchDistCommunicator:
        """As :meth:`_split_child`, which the members already run alone (store prefix
        ``plan.prefix``, unique per member list and count)."""
        child = self._split_child(plan)
        if child is None:  # pragma: no cover - a subgroup's plan always has a color
            raise RuntimeError(f"{self.backend}: subgroup plan without members")
        return child

    def _close(self) -> None:
        group, self._group = self._group, None
        # The store's last reference goes now, not at the next garbage collection (the
        # communicator's helpers hold bound methods of it): a TCPStore this rank serves frees
        # its port, so a next init_process_group may listen there again.
        self._store = None
        self.launch = dataclasses.replace(self.launch, store=None)
        self._unobserved.clear()  # their torch works hold the transport, and it the store
        atexit.unregister(self._close_at_exit)
        shutdown = getattr(group, "shutdown", None)
        if shutdown is not None:
            shutdown()  # frees the transport now, not at interpreter teardown

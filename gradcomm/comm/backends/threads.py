"""An in-process backend: ``world_size`` ranks as threads of one process, for fast logic tests.

Private: a test double, not one of gradcomm's backends. It is not registered (``gradcomm.init``
cannot build it, ``available_backends()`` does not list it), not in the API reference, and may
change at any time. Not for training: it exists so the gradient hook manager's logic can be tested
without spawning processes (as PyTorch's own thread-based distributed tests do). Each rank has one
worker thread that runs its collectives in the order they were issued, so a mismatch between ranks
shows as a timeout, as it would on a real transport. Reductions are computed in rank order on every
rank, so results are bit-identical across ranks.
"""

from __future__ import annotations

import collections
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout

import torch

from ..communicator import Communicator, SplitPlan
from ..types import ReduceOp, Support, SupportLevel
from ..work import DescriptionLike, Work, writing_into

__all__ = ["ThreadGroup", "ThreadCommunicator"]

_REDUCERS: dict[ReduceOp, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = {
    ReduceOp.SUM: torch.add,
    ReduceOp.PRODUCT: torch.mul,
    ReduceOp.MIN: torch.minimum,
    ReduceOp.MAX: torch.maximum,
}


def _fold(reduce: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
          parts: list[torch.Tensor]) -> torch.Tensor:
    """``parts`` reduced in rank order (so every rank computes bit-identical results)."""
    acc = parts[0].clone()
    for part in parts[1:]:
        acc = reduce(acc, part)
    return acc


class _FutureWork(Work):
    def __init__(
        self,
        future: Future[None],
        description: DescriptionLike,
        timeout: float | None,
    ) -> None:
        super().__init__(description, timeout)
        self._future = future

    def _wait(self, timeout: float | None) -> None:
        try:
            self._future.result(timeout)
        except FutureTimeout as exc:
            raise TimeoutError(str(exc)) from exc

    def _test(self) -> bool:
        return self._future.done()


class _MailWork(Work):
    """A point-to-point transfer: ``take(timeout)`` completes it (None: already complete); a
    failed one raises its error from every later wait and test."""

    _failure: RuntimeError | None = None

    def __init__(self, take: Callable[[float | None], bool] | None,
                 description: DescriptionLike, timeout: float | None) -> None:
        super().__init__(description, timeout)
        self._take = take

    def _taken(self, timeout: float | None) -> bool:
        if self._failure is not None:
            raise self._failure
        if self._take is not None:
            try:
                got = self._take(timeout)
            except RuntimeError as exc:  # the message left the mailbox: keep the verdict
                self._failure, self._take = exc, None
                raise
            if not got:
                return False
            self._take = None
        return True

    def _wait(self, timeout: float | None) -> None:
        if not self._taken(timeout):
            raise TimeoutError(f"{self.description}: nothing was sent")

    def _test(self) -> bool:
        return self._taken(0.0)


class ThreadGroup:
    """Shared state of ``world_size`` in-process ranks.

    Args:
        world_size: number of ranks (threads).
        timeout: seconds a collective waits for the other ranks before failing.

    Use :meth:`communicator` from each rank's thread, or run a function on every rank with
    :meth:`run`.
    """

    def __init__(self, world_size: int, timeout: float | None = 30.0) -> None:
        if world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {world_size}")
        self.world_size = world_size
        self.timeout = timeout
        self._barrier = threading.Barrier(world_size)
        self._slots: list[torch.Tensor | None] = [None] * world_size
        #: number of collectives each rank issued (for tests: "no collective at world_size 1").
        self.calls = [0] * world_size
        # Point-to-point: sent tensors by (src, dst, tag, n), the n-th send with that key; a
        # receive reserves its n when posted, so receives match sends in posting order.
        self._mail: dict[tuple[int, int, int, int], torch.Tensor] = {}
        self._mail_ready = threading.Condition()
        self._sent: collections.Counter[tuple[int, int, int]] = collections.Counter()
        self._posted: collections.Counter[tuple[int, int, int]] = collections.Counter()
        self._subgroups: dict[tuple[int, int], ThreadGroup] = {}

    def communicator(self, rank: int) -> ThreadCommunicator:
        """Return rank ``rank``'s communicator."""
        return ThreadCommunicator(self, rank)

    def run(self, fn: Callable[[ThreadCommunicator], object]) -> list[object]:
        """Call ``fn(comm)`` on every rank in its own thread; return the results in rank order.

        Raises:
            RuntimeError: some rank raised; the first error (by rank) is chained.
        """
        results: list[object] = [None] * self.world_size
        errors: list[BaseException | None] = [None] * self.world_size

        def body(rank: int) -> None:
            comm = self.communicator(rank)
            try:
                results[rank] = fn(comm)
            except BaseException as exc:  # noqa: BLE001 - reported to the caller below
                errors[rank] = exc
                self._barrier.abort()  # wake the other ranks instead of leaving them waiting
            finally:
                comm.close()

        threads = [threading.Thread(target=body, args=(r,)) for r in range(self.world_size)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        for rank, err in enumerate(errors):
            if err is not None:
                raise RuntimeError(f"rank {rank} raised {type(err).__name__}: {err}") from err
        return results

    def _put(self, key: tuple[int, int, int], tensor: torch.Tensor) -> None:
        with self._mail_ready:
            self._mail[(key[0], key[1], key[2], self._sent[key])] = tensor
            self._sent[key] += 1
            self._mail_ready.notify_all()

    def _reserve(self, key: tuple[int, int, int]) -> tuple[int, int, int, int]:
        with self._mail_ready:
            slot = (key[0], key[1], key[2], self._posted[key])
            self._posted[key] += 1
            return slot

    def _take(self, slot: tuple[int, int, int, int], timeout: float | None) -> torch.Tensor | None:
        with self._mail_ready:
            if not self._mail_ready.wait_for(lambda: slot in self._mail, timeout):
                return None
            return self._mail.pop(slot)

    def _subgroup(self, plan: SplitPlan) -> ThreadGroup:
        """The group of ``plan``'s members: made by the first member to ask."""
        with self._mail_ready:
            return self._subgroups.setdefault((plan.index, plan.color or 0),
                                              ThreadGroup(len(plan.members), self.timeout))

    # One collective, run by every rank's worker thread in the same order.
    def _exchange(self, rank: int, contribution: torch.Tensor) -> list[torch.Tensor]:
        self._slots[rank] = contribution
        self._barrier.wait(self.timeout)
        gathered = [t for t in self._slots if t is not None]
        self._barrier.wait(self.timeout)  # nobody overwrites a slot before everyone has read
        self.calls[rank] += 1
        return gathered


class ThreadCommunicator(Communicator):
    """Rank ``rank`` of a :class:`ThreadGroup`; CPU tensors, every real dtype, every op."""

    backend = "threads"

    def __init__(self, group: ThreadGroup, rank: int, local_rank: int | None = None) -> None:
        super().__init__(
            rank=rank,
            world_size=group.world_size,
            local_rank=rank if local_rank is None else local_rank,
            device="cpu",
            timeout=group.timeout,
        )
        self.group = group
        self._worker = ThreadPoolExecutor(1, thread_name_prefix=f"gradcomm-thread-rank{rank}")

    @property
    def background_progress(self) -> bool:
        """True: each rank's collectives run on a worker thread of their own."""
        return True

    def _supports(self, dtype: torch.dtype, device: torch.device | str | None) -> Support:
        dev = self.device if device is None else torch.device(device)
        if dev.type != "cpu":
            return Support(SupportLevel.UNSUPPORTED, "the threads backend is CPU-only")
        if dtype.is_complex:  # as on the real transports: the base class reduces the real view
            return Support(SupportLevel.UNSUPPORTED, f"the threads backend cannot reduce {dtype}")
        return Support(SupportLevel.NATIVE, "", dtype)

    def _submit(self, fn: Callable[[], None], description: DescriptionLike) -> Work:
        def guarded() -> None:
            try:
                fn()
            except threading.BrokenBarrierError as exc:
                raise TimeoutError(f"{description}: another rank did not arrive") from exc

        return _FutureWork(self._worker.submit(guarded), description, self._timeout)

    def _all_reduce(self, tensor: torch.Tensor, op: ReduceOp, description: DescriptionLike) -> Work:
        reduce = _REDUCERS[op]

        def run() -> None:
            acc = _fold(reduce, self.group._exchange(self.rank, tensor.clone()))
            with writing_into(tensor):  # grad mode is per thread: on in this worker
                tensor.copy_(acc)

        return self._submit(run, description)

    def _broadcast(self, tensor: torch.Tensor, src: int, description: DescriptionLike) -> Work:
        def run() -> None:
            parts = self.group._exchange(self.rank, tensor.clone())
            with writing_into(tensor):
                tensor.copy_(parts[src])

        return self._submit(run, description)

    def _all_gather(
        self, output: torch.Tensor, input: torch.Tensor, description: DescriptionLike
    ) -> Work:
        def run() -> None:
            parts = self.group._exchange(self.rank, input.clone())
            with writing_into(output):
                output.copy_(torch.cat(parts))

        return self._submit(run, description)

    def _reduce_scatter(self, output: torch.Tensor, input: torch.Tensor, op: ReduceOp,
                        description: DescriptionLike) -> Work:
        reduce, n = _REDUCERS[op], output.numel()

        def run() -> None:
            parts = self.group._exchange(self.rank, input.clone())
            acc = _fold(reduce, [p[self.rank * n:(self.rank + 1) * n] for p in parts])
            with writing_into(output):
                output.copy_(acc)

        return self._submit(run, description)

    def _all_to_all(self, output: torch.Tensor, input: torch.Tensor, output_counts: list[int],
                    input_counts: list[int], description: DescriptionLike) -> Work:
        def run() -> None:
            parts = self.group._exchange(self.rank, input.clone())
            counts = self.group._exchange(self.rank, torch.tensor(input_counts))
            mine = []
            for part, sent in zip(parts, counts, strict=True):
                start = int(sent[: self.rank].sum())
                mine.append(part[start:start + int(sent[self.rank])])
            got = torch.cat(mine)
            if got.numel() != output.numel():
                raise ValueError(f"{description}: the peers sent {got.numel()} elements, "
                                 f"output_split_sizes expect {output.numel()}")
            with writing_into(output):
                output.copy_(got)

        return self._submit(run, description)

    def _all_gather_v(self, output: torch.Tensor, input: torch.Tensor, counts: list[int],
                      description: DescriptionLike) -> Work:
        return self._all_gather(output, input, description)  # torch.cat takes uneven parts

    def _reduce(self, tensor: torch.Tensor, dst: int, op: ReduceOp,
                description: DescriptionLike) -> Work:
        reduce = _REDUCERS[op]

        def run() -> None:
            parts = self.group._exchange(self.rank, tensor.clone())
            if self.rank == dst:
                acc = _fold(reduce, parts)
                with writing_into(tensor):
                    tensor.copy_(acc)

        return self._submit(run, description)

    def _gather(self, output: torch.Tensor | None, input: torch.Tensor, dst: int,
                description: DescriptionLike) -> Work:
        def run() -> None:
            parts = self.group._exchange(self.rank, input.clone())
            if output is not None:
                with writing_into(output):
                    output.copy_(torch.cat(parts))

        return self._submit(run, description)

    def _scatter(self, output: torch.Tensor, input: torch.Tensor | None, src: int,
                 description: DescriptionLike) -> Work:
        def run() -> None:
            mine = torch.zeros(0, dtype=output.dtype) if input is None else input.clone()
            parts = self.group._exchange(self.rank, mine)
            n = output.numel()
            with writing_into(output):
                output.copy_(parts[src][self.rank * n:(self.rank + 1) * n])

        return self._submit(run, description)

    def _barrier(self, description: DescriptionLike) -> Work:
        def run() -> None:
            self.group._exchange(self.rank, torch.zeros(0))

        return self._submit(run, description)

    def _send(self, tensor: torch.Tensor, dst: int, tag: int, description: DescriptionLike) -> Work:
        # Buffered: the data is copied when posted, so a send never waits for its receive.
        self.group._put((self.rank, dst, tag), tensor.clone())
        return _MailWork(None, description, self._timeout)

    def _recv(self, tensor: torch.Tensor, src: int, tag: int, description: DescriptionLike) -> Work:
        slot = self.group._reserve((src, self.rank, tag))

        def take(timeout: float | None) -> bool:
            got = self.group._take(slot, timeout)
            if got is None:
                return False
            if got.dtype != tensor.dtype or got.numel() != tensor.numel():
                raise RuntimeError(f"{description}: rank {src} sent {got.numel()} {got.dtype}, "
                                   f"the receive buffer holds {tensor.numel()} {tensor.dtype}")
            with writing_into(tensor):
                tensor.copy_(got.reshape(tensor.shape))
            return True

        return _MailWork(take, description, self._timeout)

    def _split_child(self, plan: SplitPlan) -> ThreadCommunicator | None:
        if plan.color is None:
            return None
        return ThreadCommunicator(self.group._subgroup(plan), plan.rank, plan.local_rank)

    def _close(self) -> None:
        self._worker.shutdown(wait=False)

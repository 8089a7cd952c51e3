"""PowerSGD: low-rank gradient compression as a comm hook.

The algorithm of Vogels, Karimireddy and Jaggi, "PowerSGD: Practical Low-Rank Gradient Compression
for Distributed Optimization" (NeurIPS 2019, Algorithm 1 with error feedback and warm start), with
the options and defaults of torch's ``torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook``.
For each bucket, every gradient of two or more dimensions is viewed as an ``n x m`` matrix ``M``
(its first dimension by the rest) and, with ``r = min(n, m, matrix_approximation_rank)``:

1. error feedback: ``M += E`` (what this rank's earlier approximations left out);
2. ``Q`` (``m x r``): the previous step's ``Q`` (warm start) or, the first time, standard normal
   values from a seed every rank draws alike; orthogonalized (Gram-Schmidt);
3. ``P = M Q`` (``n x r``), summed over ranks (one all-reduce for all of a bucket's ``P``);
   orthogonalized;
4. ``Q = M^T P`` (``m x r``), summed over ranks (one all-reduce);
5. the bucket receives ``P Q^T``, an approximation of the sum of the ranks' ``M``, and
   ``E = M - P Q^T / world_size`` (this rank's share of the average that was not sent).

Gradients of one dimension (biases) and matrices whose compression would save less than
``min_compression_rate`` (``n * m <= (n + m) * r * min_compression_rate``) are summed uncompressed,
in one all-reduce per bucket. Before ``start_powerSGD_iter`` steps, and for buckets that are not
real floating point, the hook is a plain all-reduce. Every all-reduce is a SUM of the reducer's
pre-divided bucket (see :mod:`gradcomm.hooks.comm_hooks`), so it works on every backend.

Where this differs from torch's hook: the error of an uncompressed gradient is 0 (torch keeps
``local - average`` there, whose sum over ranks is 0); with ``orthogonalization_epsilon=0`` a zero
column stays zero instead of becoming NaN; ``batch_tensors_with_same_shape`` is not offered. The
``P`` all-reduce starts in the hook; the ``Q`` all-reduce starts when the reducer waits for the
bucket (at the end of backward, in bucket order, so every rank issues the same sequence).
"""

from __future__ import annotations

import logging
import random
from dataclasses import dataclass, field

import torch

from ..comm.communicator import Communicator
from ..comm.types import ReduceOp
from ..comm.work import Work
from .comm_hooks import GradBucket, allreduce_hook

__all__ = ["PowerSGDState", "powersgd_hook"]

logger = logging.getLogger("gradcomm.hooks")


@dataclass(eq=False)
class PowerSGDState:
    """Options and memory of :func:`powersgd_hook` for one reducer (option names as torch's).

    Args:
        comm: the communicator the buckets are summed over (the reducer's).
        matrix_approximation_rank: the rank ``r`` of the approximation (torch's default 1).
        start_powerSGD_iter: backward passes reduced by a plain all-reduce first (default 1000).
        min_compression_rate: compress a matrix only if ``n * m`` is more than this many times
            ``(n + m) * r`` (default 2).
        use_error_feedback: add what earlier approximations left out (default True).
        warm_start: start each step's power iteration from the last step's ``Q`` (default True).
        orthogonalization_epsilon: added to each column norm in Gram-Schmidt (default 0).
        random_seed: seed of the first ``Q`` (the same on every rank; default 0).

    Memory, per bucket index: ``error_dict`` (the error ``E``, flat, the bucket's numel and dtype),
    ``p_memory_dict`` and ``q_memory_dict`` (every compressed matrix's ``P`` then ``Q``, flat);
    ``iter``: backward passes seen.

    Raises:
        TypeError: ``comm`` is not a Communicator, or an option has the wrong type.
        ValueError: ``matrix_approximation_rank < 1``, ``start_powerSGD_iter < 0``,
            ``min_compression_rate < 0`` or ``orthogonalization_epsilon < 0``.
    """

    comm: Communicator
    matrix_approximation_rank: int = 1
    start_powerSGD_iter: int = 1_000
    min_compression_rate: float = 2.0
    use_error_feedback: bool = True
    warm_start: bool = True
    orthogonalization_epsilon: float = 0.0
    random_seed: int = 0
    iter: int = field(default=0, init=False)
    error_dict: dict[int, torch.Tensor] = field(default_factory=dict, init=False)
    p_memory_dict: dict[int, torch.Tensor] = field(default_factory=dict, init=False)
    q_memory_dict: dict[int, torch.Tensor] = field(default_factory=dict, init=False)

    def __post_init__(self) -> None:
        if not isinstance(self.comm, Communicator):
            raise TypeError(f"comm must be a gradcomm Communicator, got {type(self.comm).__name__}")
        for name in ("matrix_approximation_rank", "start_powerSGD_iter", "random_seed"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise TypeError(f"{name} must be an int, got {type(value).__name__}")
        for name in ("use_error_feedback", "warm_start"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"{name} must be True or False, got {getattr(self, name)!r}")
        for name in ("min_compression_rate", "orthogonalization_epsilon"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise TypeError(f"{name} must be a number, got {type(value).__name__}")
            if not value >= 0:
                raise ValueError(f"{name} must be >= 0, got {value}")
        if self.matrix_approximation_rank < 1:
            raise ValueError(f"matrix_approximation_rank must be >= 1, "
                             f"got {self.matrix_approximation_rank}")
        if self.start_powerSGD_iter < 0:
            raise ValueError(f"start_powerSGD_iter must be >= 0, got {self.start_powerSGD_iter}")
        self._rng = random.Random(self.random_seed)

    def _compressed_shape(self, t: torch.Tensor) -> tuple[int, int, int] | None:
        """``(n, m, r)`` when ``t`` is compressed, else None (sent as it is)."""
        if t.dim() < 2:
            return None
        n = t.shape[0]
        m = t.numel() // n if n else 0
        r = min(n, m, self.matrix_approximation_rank)
        if r == 0 or n * m <= (n + m) * r * self.min_compression_rate:
            return None
        return n, m, r

    def _next_seed(self) -> int:
        # The same sequence on every rank: each rank draws once per bucket that needs a new Q,
        # in bucket order.
        return self._rng.randrange(2**31)


def _orthogonalize(m: torch.Tensor, epsilon: float) -> None:
    """Gram-Schmidt on the columns of ``m`` (``k x r``) in place; a zero column stays zero."""
    for i in range(m.shape[1]):
        col = m[:, i : i + 1]
        norm = torch.linalg.vector_norm(col) + epsilon
        col.div_(torch.where(norm > 0, norm, torch.ones_like(norm)))
        if i + 1 < m.shape[1]:
            rest = m[:, i + 1 :]
            rest.sub_(col @ (col.T @ rest))


class _PowerSGDWork(Work):
    """The rest of one bucket's PowerSGD after its first collectives: run by :meth:`wait`.

    :meth:`is_completed` never starts a collective (it drives the first ones' progress and says
    False), so the ``Q`` all-reduces are issued in the order the reducer waits for its buckets.
    """

    def __init__(self, first: list[Work], finish: _Finish, label: str) -> None:
        super().__init__(f"PowerSGD of {label}", None)
        self._first = first
        self._finish_fn = finish

    def _wait(self, timeout: float | None) -> None:
        for w in self._first:
            w.wait(timeout)
        self._finish_fn(timeout)

    def _test(self) -> bool:
        for w in self._first:
            w.is_completed()
        return False


@dataclass
class _Finish:
    """The second half of one bucket's PowerSGD (after the ``P`` and uncompressed sums)."""

    state: PowerSGDState
    bucket: GradBucket
    matrices: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]  # (M view, P, Q)
    offsets: list[int]  # where each M starts in the bucket's buffer
    q_flat: torch.Tensor
    uncompressed: list[torch.Tensor]
    packed: torch.Tensor | None  # the uncompressed gradients, summed
    local: torch.Tensor | None  # M before the send (error feedback only)

    def __call__(self, timeout: float | None) -> None:
        state = self.state
        eps = state.orthogonalization_epsilon
        with torch.no_grad():
            for m, p, q in self.matrices:
                _orthogonalize(p, eps)
                torch.matmul(m.T, p, out=q)
            state.comm.all_reduce(self.q_flat, ReduceOp.SUM, async_op=True,
                                  label=f"PowerSGD Q of {self.bucket.label()}").wait(timeout)
            if self.packed is not None:
                offset = 0
                for t in self.uncompressed:
                    t.copy_(self.packed[offset : offset + t.numel()].view_as(t))
                    offset += t.numel()
            for m, p, q in self.matrices:
                torch.matmul(p, q.T, out=m)
            if self.local is not None:
                # E = M - P Q^T / world_size on the compressed matrices, 0 elsewhere.
                err = self.state.error_dict[self.bucket.index()]
                err.zero_()
                for (m, _, _), lo in zip(self.matrices, self.offsets, strict=True):
                    span = slice(lo, lo + m.numel())
                    torch.sub(self.local[span], m.reshape(-1), alpha=1.0 / state.comm.world_size,
                              out=err[span])


def powersgd_hook(state: PowerSGDState | Communicator, bucket: GradBucket) -> Work:
    """Sum ``bucket.buffer()`` over ranks approximately, by PowerSGD (see the module).

    ``state``: a :class:`PowerSGDState`; a bare Communicator (what ``comm_hook="powersgd"`` passes
    before the reducer makes a default state) is refused.

    Raises:
        TypeError: ``state`` is not a PowerSGDState.
    """
    if not isinstance(state, PowerSGDState):
        raise TypeError(f"powersgd_hook needs a PowerSGDState, got {type(state).__name__}")
    flat = bucket.buffer()
    index = bucket.index()
    is_last = bucket.is_last()
    step = state.iter
    if is_last:
        state.iter += 1
        if state.iter == state.start_powerSGD_iter:
            logger.info("PowerSGD: compression starts at the next backward pass (iteration %d)",
                        state.iter)
    if step < state.start_powerSGD_iter or not flat.dtype.is_floating_point:
        return allreduce_hook(state.comm, bucket)
    with torch.no_grad():
        return _start(state, bucket, flat, index)


def _start(state: PowerSGDState, bucket: GradBucket, flat: torch.Tensor, index: int) -> Work:
    """Error feedback, ``P = M Q`` and the first all-reduces of one bucket (see the module)."""
    grads: list[torch.Tensor] = []
    starts: list[int] = []
    offset = 0
    for p in bucket.parameters():
        grads.append(flat[offset : offset + p.numel()].view(p.shape))
        starts.append(offset)
        offset += p.numel()
    shapes = [state._compressed_shape(g) for g in grads]
    compressed = [(g, s) for g, s in zip(grads, shapes, strict=True) if s is not None]
    offsets = [o for o, s in zip(starts, shapes, strict=True) if s is not None]
    if not compressed:
        return allreduce_hook(state.comm, bucket)
    local: torch.Tensor | None = None
    if state.use_error_feedback:
        err = state.error_dict.get(index)
        if err is None or err.shape != flat.shape or err.dtype != flat.dtype:
            err = state.error_dict[index] = torch.zeros_like(flat)
        else:
            flat.add_(err)
        local = flat.clone()
    p_total = sum(n * r for _, (n, _, r) in compressed)
    q_total = sum(m * r for _, (_, m, r) in compressed)
    p_flat = state.p_memory_dict.get(index)
    q_flat = state.q_memory_dict.get(index)
    fresh = (not state.warm_start or q_flat is None or q_flat.numel() != q_total
             or q_flat.dtype != flat.dtype)
    if p_flat is None or p_flat.numel() != p_total or p_flat.dtype != flat.dtype:
        p_flat = state.p_memory_dict[index] = torch.empty(p_total, dtype=flat.dtype,
                                                         device=flat.device)
    if fresh:
        gen = torch.Generator().manual_seed(state._next_seed())
        q_flat = torch.randn(q_total, generator=gen, dtype=flat.dtype).to(flat.device)
        state.q_memory_dict[index] = q_flat
    assert q_flat is not None  # just made, or kept from the last step
    matrices = []
    po = qo = 0
    for g, (n, m, r) in compressed:
        mat = g.view(n, m)
        p = p_flat[po : po + n * r].view(n, r)
        q = q_flat[qo : qo + m * r].view(m, r)
        po, qo = po + n * r, qo + m * r
        _orthogonalize(q, state.orthogonalization_epsilon)
        torch.matmul(mat, q, out=p)
        matrices.append((mat, p, q))
    label = bucket.label()
    first = []
    uncompressed = [g for g, s in zip(grads, shapes, strict=True) if s is None]
    packed = None
    if uncompressed:
        packed = torch.cat([g.reshape(-1) for g in uncompressed])
        first.append(state.comm.all_reduce(packed, ReduceOp.SUM, async_op=True,
                                           label=f"PowerSGD uncompressed of {label}"))
    first.append(state.comm.all_reduce(p_flat, ReduceOp.SUM, async_op=True,
                                       label=f"PowerSGD P of {label}"))
    finish = _Finish(state, bucket, matrices, offsets, q_flat, uncompressed, packed, local)
    return _PowerSGDWork(first, finish, label)

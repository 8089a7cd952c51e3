"""Shard layout of a :class:`~gradcomm.hooks.ShardedOptimizer`: which elements of each reducer
bucket a rank owns, and the flat views through which its optimizer steps them.

A bucket's *flat layout* is the one its buffer has: its parameters one after the other, in bucket
order, each in its own memory order (the dense strides of :func:`~._buckets.dense_strides`, so a
channels_last weight stays channels_last). With ``n`` elements and ``W`` ranks, the bucket is
padded to ``W * chunk`` elements, ``chunk = ceil(n / W)``, and rank ``r`` owns the elements
``[r * chunk, min((r + 1) * chunk, n))`` -- the split of DeepSpeed ZeRO's flat partitions and of
torch's ``reduce_scatter_tensor`` (equal parts, rank order). A rank's shard of a bucket is cut into
one :class:`Segment` per parameter it touches: a 1-D view of that parameter's own memory, so the
local optimizer updates the parameter in place and per-parameter hyperparameters, a gradient of
None and per-parameter state (Adam's ``step``) behave as in an unsharded optimizer.
"""

from __future__ import annotations

import pickle
from dataclasses import dataclass, field

import torch
from torch import nn

from ..comm.communicator import Communicator
from ._bucket_plan import bucket_strides, dense_strides
from ._buckets import Bucket

__all__ = ["Segment", "BucketShard", "flat_of", "check_dense", "all_gather_object",
           "gather_params"]


def _is_dense_in_order(t: torch.Tensor, p: torch.Tensor) -> bool:
    """``t`` (shaped as ``p``) lies densely in ``p``'s bucket order, so a flat view of it exists."""
    return tuple(st if n > 1 else 0 for n, st in zip(t.shape, t.stride(), strict=True)) \
        == bucket_strides(p)


def flat_of(t: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """``t`` (shaped as parameter ``p``) as 1-D in ``p``'s bucket order: a view when ``t`` lies
    that way in memory, else a copy."""
    if not _is_dense_in_order(t, p):
        tmp = torch.empty_strided(p.shape, dense_strides(p), dtype=t.dtype, device=t.device)
        tmp.copy_(t)
        t = tmp
    return t.as_strided((t.numel(),), (1,), t.storage_offset())


@dataclass
class Segment:
    """The part ``[lo, hi)`` (flat, bucket order) of one parameter that this rank steps.

    ``tensor`` is a 1-D view of the parameter's memory (a leaf without autograd history), the
    tensor the local optimizer holds; ``start`` is where it lies in this rank's shard.
    """

    slot: int
    param: nn.Parameter
    lo: int
    hi: int
    start: int
    tensor: torch.Tensor


@dataclass
class BucketShard:
    """This rank's shard of one reducer bucket (see the module)."""

    bucket: Bucket
    world_size: int
    rank: int
    offsets: list[int] = field(default_factory=list)  # each parameter's start in the bucket
    segments: list[Segment] = field(default_factory=list)
    grad: torch.Tensor | None = None  # stage 2: averaged gradients of the shard (chunk elements)
    filled: bool = False  # stage 2: ``grad`` holds a synchronised backward's gradients
    present: list[bool] = field(default_factory=list)  # stage 2: a parameter has a gradient
    pending: tuple[torch.Tensor, bool] | None = None  # stage 2: (output, accumulate) in flight

    def __post_init__(self) -> None:
        b = self.bucket
        self.numel = b.numel
        self.chunk = -(-b.numel // self.world_size)
        self.lo = min(self.rank * self.chunk, b.numel)
        self.hi = min(self.lo + self.chunk, b.numel)
        off = 0
        for slot, p in enumerate(b.params):
            self.offsets.append(off)
            lo, hi = max(self.lo, off), min(self.hi, off + p.numel())
            if lo < hi:
                base = p.detach()
                view = base.as_strided((p.numel(),), (1,), base.storage_offset())
                self.segments.append(
                    Segment(slot, p, lo - off, hi - off, lo - self.lo, view[lo - off:hi - off]))
            off += p.numel()
        self.present = [False] * len(b.params)

    @property
    def padded(self) -> int:
        """Elements of the padded bucket: ``world_size * chunk``."""
        return self.world_size * self.chunk

    def pack(self, values: dict[int, torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
        """A zero ``chunk``-element tensor with ``values[slot]`` (1-D, one segment each) at their
        segments' places in the shard."""
        out = torch.zeros(self.chunk, dtype=dtype, device=self.bucket.device)
        for s in self.segments:
            if s.slot in values:
                out[s.start:s.start + s.hi - s.lo].copy_(values[s.slot])
        return out

    def unpack(self, full: torch.Tensor, slot: int) -> torch.Tensor:
        """Parameter ``slot``'s part of a gathered padded bucket ``full``, shaped as the
        parameter, in its memory order."""
        p = self.bucket.params[slot]
        return full.as_strided(p.shape, dense_strides(p), self.offsets[slot])


def check_dense(params: tuple[nn.Parameter, ...], names: tuple[str, ...]) -> None:
    """Raise ValueError naming a parameter that is not dense in memory (a strided slice of a
    larger tensor): its flat view, which the local optimizer steps, does not exist."""
    for p, name in zip(params, names, strict=True):
        if not _is_dense_in_order(p, p):
            raise ValueError(f"ShardedOptimizer: parameter {name} is not dense in memory; make "
                             "it a tensor of its own (e.g. .clone()) before building the reducer")


def gather_params(comm: Communicator, shards: list[BucketShard],
                  buffers: list[torch.Tensor]) -> None:
    """All-gather every bucket's updated shards and copy them into the parameters, so every rank
    ends with the same parameters.

    One all-gather per bucket, two in flight: the next bucket's gather runs while the previous one
    is copied out. ``buffers``: the two padded-bucket buffers this uses, kept by the caller
    between steps (made here, of the largest padded bucket, when missing or too small).
    """
    previous: tuple[BucketShard, torch.Tensor, object] | None = None
    for i, bs in enumerate(shards):
        b = bs.bucket
        if len(buffers) < 2:
            size = max((s.padded for s in shards if s.bucket.dtype == b.dtype), default=0)
            buffers.append(torch.empty(size, dtype=b.dtype, device=b.device))
        out = buffers[i % 2]
        if out.dtype != b.dtype or out.device != b.device or out.numel() < bs.padded:
            out = buffers[i % 2] = torch.empty(bs.padded, dtype=b.dtype, device=b.device)
        send = bs.pack({s.slot: s.tensor for s in bs.segments}, b.dtype)
        work = comm.all_gather(out[:bs.padded], send, async_op=True)
        if previous is not None:
            _copy_out(*previous)
        previous = (bs, out, work)
    if previous is not None:
        _copy_out(*previous)


def _copy_out(bs: BucketShard, full: torch.Tensor, work: object) -> None:
    work.wait()  # type: ignore[attr-defined]
    with torch.no_grad():
        for slot, p in enumerate(bs.bucket.params):
            p.copy_(bs.unpack(full, slot))


def all_gather_object(comm: Communicator, obj: object) -> list[object]:
    """Every rank's picklable ``obj``, in rank order (two all-gathers: sizes, then the bytes).

    Used for the small per-parameter metadata of a checkpoint; tensors in it travel pickled.
    """
    data = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8)
    dev = comm.device
    sizes = torch.empty(comm.world_size, dtype=torch.int64, device=dev)
    comm.all_gather(sizes, torch.tensor([data.numel()], dtype=torch.int64, device=dev))
    most = int(sizes.max())
    send = torch.zeros(most, dtype=torch.uint8, device=dev)
    send[:data.numel()].copy_(data)
    every = torch.empty(most * comm.world_size, dtype=torch.uint8, device=dev)
    comm.all_gather(every, send)
    rows = every.cpu().view(comm.world_size, most)
    return [pickle.loads(rows[r, :int(sizes[r])].numpy().tobytes())
            for r in range(comm.world_size)]

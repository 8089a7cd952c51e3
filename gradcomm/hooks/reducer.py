"""The gradient hook manager: bucket, flatten, all-reduce, average and write back gradients.

How one backward pass is reduced (the algorithm of torch DDP's reducer, in Python):

1. At construction, trainable parameters (tied ones once, frozen ones skipped) are grouped by
   (device, dtype) into buckets, filled in reverse registration order -- roughly the order backward
   produces their gradients -- the first one capped at ``first_bucket_cap_mb`` (by default 1 MiB
   only where the transport progresses in the background, see
   :func:`resolve_first_bucket_cap_mb`), the others at ``bucket_cap_mb``. Each bucket owns one
   persistent flat buffer, allocated once. A gradient of at least ``in_place_min_mb`` (by default
   2 MiB where collectives are cheap, see :func:`resolve_in_place_min_mb`) is a bucket of its own
   with no buffer: it is reduced in place in ``param.grad``, as Horovod reduces tensors, which
   saves copying it. In-place buckets come after the shared ones and are sent at the end of
   backward, when no autograd node can still read the gradient's memory.
2. A post-accumulate-grad hook on each parameter copies its gradient, pre-divided, into its slot
   (one pass; an in-place gradient is divided where it lies) and marks it ready. When every
   parameter of the lowest-index bucket not yet launched is ready, that bucket's comm hook (an
   async all-reduce by default) is started; buckets are launched strictly in index order, so
   every rank issues the same collectives in the same order. The last shared bucket (when there
   is no in-place one) is left to the end-of-backward callback, so that a backward that fails
   after its last parameter hook still has a bucket to send marked as failed.
3. The first hook of a backward pass queues one end-of-backward callback on the autograd engine. It
   launches the remaining buckets (parameters with no gradient on this rank count as zeros), waits
   for every bucket in order, post-divides and writes the averages back, so ``optimizer.step()``
   after ``loss.backward()`` sees averaged gradients.

Presence of gradients: each bucket's buffer carries one flag per parameter (1 when this rank has a
gradient for it) that is summed with the gradients by the same collective. A parameter whose flag
sums to 0 had no gradient on any rank and keeps ``grad=None``; no extra collective is needed. The
in-place buckets' flags go in one small all-reduce of their own at the end of backward (a rank
without such a gradient sends zeros in its place).

Nested backward passes (reentrant activation checkpointing) run their own autograd graph task; a
callback that fires at the end of such an inner task defers itself to the end of the outer one.
"""

from __future__ import annotations

import contextlib
import logging
import math
import numbers
import weakref
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from ..comm.communicator import Communicator
from ..comm.errors import MESSAGE_LIMIT, CollectiveTimeoutError
from ..comm.errors import brief as _brief
from ..comm.work import Work
from ._structure import StructureWatch
from ._sync import broadcast_tensors, check_fingerprint
from .comm_hooks import CommHook, CommHookFn, GradBucket, resolve_comm_hook

# What the forward check compares: (what, table, key, the object expected at table[key]).
_Entry = tuple[str, dict[str, Any], str, object]

__all__ = [
    "GradientReducer",
    "BucketInfo",
    "apply_gradient_allreduce",
    "default_predivide_factor",
    "resolve_first_bucket_cap_mb",
    "resolve_in_place_min_mb",
]

logger = logging.getLogger("gradcomm.hooks")

_MIB = 2**20
_HALF = (torch.float16, torch.bfloat16)
# What a bucket slot holds in this backward (gradient_as_bucket_view): nothing yet; the gradient,
# pre-divided, with param.grad None until the send; the gradient accumulated in place in the view
# (param.grad is the view), divided at launch.
_EMPTY, _DIVIDED, _IN_VIEW = 0, 1, 2
_PRESENCE_LABEL = "presence flags of the in-place gradients"


# Closing advice of the errors for a model changed after wrapping (details: docs/failures.md).
_REBUILD = "change the model before wrapping it (reducer.remove() first)"
# With the automatic defaults each rank derives first_bucket_cap_mb and in_place_min_mb from its
# own hardware, which can differ on uneven hosts (docs/failures.md).
_OPTIONS_ADVICE = "set them explicitly, the same on every rank"
_MODEL_FIX = "build the same model, with the same options, on every rank"


def _first_changed(entries: list[_Entry]) -> str | None:
    """The ``what`` of the first entry whose table no longer holds its object, else None."""
    for what, table, local, obj in entries:
        if table.get(local) is not obj:
            return what
    return None


def _has_nan(flags: list[Any]) -> bool:
    """Whether summed presence flags carry a NaN: a rank sent the bucket as failed."""
    return any(f != f for f in flags)


def _queue_engine_callback(fn: Any) -> None:
    # torch has no public API to run code when a backward pass ends (the proposal to expose
    # torch.autograd.graph.queue_callback, pytorch#193958, was not merged); torch DDP and FSDP use
    # this same engine method.
    torch.autograd.Variable._execution_engine.queue_callback(fn)


def _current_autograd_node() -> Any:
    # The node the autograd engine is running on this thread, None outside a backward pass. Used
    # to tell the end of a nested (reentrant) backward from the end of the outermost one.
    return torch._C._current_autograd_node()


def default_predivide_factor(world_size: int, dtype: torch.dtype) -> float:
    """The pre-divide factor used when ``gradient_predivide_factor`` is None.

    Gradients are divided by the pre-divide factor before the sum and by
    ``world_size / predivide`` after it (their product is ``world_size``), the scheme of Horovod's
    ``gradient_predivide_factor`` and of DDP's fp16 hooks, which divide before summing "to avoid
    overflow".

    * float16 / bfloat16: the largest power of two <= sqrt(world_size), but at least 2 -- about
      the square root, which balances overflow of the sum against underflow of the parts, and a
      power of two, so the division itself is exact (no rounding unless the result is subnormal).
      Two ranks of 40000 in fp16 sum to 40000 (not inf); 8 ranks of 1e-7 average to 1.19e-7 (not 0).
    * wider dtypes: ``world_size`` (one division, before the sum, as DDP does; fp32 has the range).

    Raises:
        ValueError: ``world_size < 1``.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if world_size == 1:
        return 1.0
    if dtype in _HALF:
        return float(2 ** max(1, int(math.log2(world_size)) // 2))
    return float(world_size)


def resolve_first_bucket_cap_mb(
    first_bucket_cap_mb: float | None, bucket_cap_mb: float, comm: Communicator
) -> float:
    """The cap of bucket 0 in MiB: ``first_bucket_cap_mb``, or when it is None, chosen for ``comm``.

    A small first bucket (DDP's 1 MiB) lets the first all-reduce start early in backward; that pays
    only when the transport moves data while backward computes
    (:attr:`Communicator.background_progress`: NCCL's stream, gloo with a spare core per process).
    Otherwise -- MPI without a progress thread, which advances only inside our polls, or 2 ranks on
    2 cores, where gloo's thread competes with backward for the core -- overlap hides nothing and
    splitting costs: fewer, larger collectives are cheaper, so bucket 0 gets ``bucket_cap_mb``
    (docs/performance.md says where this was measured).
    """
    if first_bucket_cap_mb is not None:
        return float(first_bucket_cap_mb)
    return 1.0 if comm.background_progress else float(bucket_cap_mb)


def resolve_in_place_min_mb(in_place_min_mb: float | None, comm: Communicator) -> float:
    """The size in MiB from which gradients are reduced in place: ``in_place_min_mb``, or when it
    is None, chosen for ``comm``.

    Reducing a gradient in place in ``param.grad`` saves copying it into a shared bucket (a pass
    over its memory) and costs one more collective. That pays where collectives are cheap
    (:attr:`Communicator.cheap_collectives`: MPI on host memory), from 2 MiB up; elsewhere the
    default is ``math.inf`` (none). docs/performance.md says where this was measured.

    Raises:
        TypeError: not a number (or a bool). ValueError: negative or NaN.
    """
    if in_place_min_mb is None:
        return 2.0 if comm.cheap_collectives else math.inf
    return _checked_in_place_min_mb(in_place_min_mb)


def _checked_mib(name: str, value: object) -> float:
    """A size argument in MiB as a float, or raise TypeError (not a real number, or a bool; numpy
    scalars are accepted)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a number of MiB, got {type(value).__name__}")
    return float(value)


def _checked_cap_mb(name: str, value: object) -> float:
    """A bucket cap in MiB: positive, and finite in bytes too, or raise ValueError."""
    mb = _checked_mib(name, value)
    if not (mb > 0 and math.isfinite(mb * _MIB)):
        raise ValueError(f"{name} must be a positive number of MiB, finite in bytes too, "
                         f"got {value}")
    return mb


def _checked_in_place_min_mb(value: object) -> float:
    """``value`` as a float >= 0 (``-0.0`` as ``0.0``, so ranks compare equal; a size too large to
    count in bytes as ``math.inf``, which it means), or raise."""
    mb = _checked_mib("in_place_min_mb", value)
    if not mb >= 0:
        raise ValueError(f"in_place_min_mb must be a number of MiB >= 0 (or math.inf), got {value}")
    return mb + 0.0 if math.isfinite(mb * _MIB) else math.inf


@dataclass(frozen=True)
class BucketInfo:
    """Read-only description of one bucket (see :attr:`GradientReducer.buckets`).

    Attributes:
        index: launch order (0 first, holding the gradients backward produces first).
        device: device of the flat buffer. dtype: its dtype.
        numel: number of gradient elements. nbytes: ``numel * element size`` (bytes).
        param_names: names of its parameters, in buffer order.
        in_place: the bucket is one parameter whose gradient is all-reduced in place in
            ``param.grad`` (see ``in_place_min_mb``); it has no buffer of its own.
    """

    index: int
    device: torch.device
    dtype: torch.dtype
    numel: int
    nbytes: int
    param_names: tuple[str, ...]
    in_place: bool = False


class _BackwardEnd:
    """The end-of-backward callback of one backward pass (weakly referenced by the reducer)."""

    __slots__ = ("__weakref__", "reducer")

    def __init__(self, reducer: GradientReducer) -> None:
        self.reducer = reducer

    def __call__(self) -> None:
        self.reducer._on_backward_end(self)


class _InertHook:
    """What a copy of a wrapped module holds where the original has the reducer's forward hook."""

    __slots__ = ()

    def __call__(self, module: nn.Module, args: Any) -> None:
        return None


class _ForwardPreHook:
    """The reducer's forward pre-hook on its module.

    A copy of the module (``copy.deepcopy``, or ``torch.save``/pickle of the whole module) gets an
    :class:`_InertHook` in its place, so the copy is an ordinary local module -- as the ``.module``
    of a DDP wrapper is -- and copying never tries to copy the communicator (which cannot be).
    """

    __slots__ = ("reducer",)

    def __init__(self, reducer: GradientReducer) -> None:
        self.reducer = reducer

    def __call__(self, module: nn.Module, args: Any) -> None:
        self.reducer._on_forward(module, args)

    def __deepcopy__(self, memo: dict[int, Any]) -> _InertHook:
        return _InertHook()

    def __reduce__(self) -> tuple[type[_InertHook], tuple[()]]:
        return (_InertHook, ())


def _qualified_name(fn: Callable[..., Any]) -> str:
    """``module.qualname`` of a function (or of a callable object's class): the same on every
    rank for the same hook."""
    named = fn if hasattr(fn, "__qualname__") else type(fn)
    return f"{getattr(named, '__module__', '?')}.{named.__qualname__}"


def _no_reducer() -> None:
    """What an unpickled :class:`GradientReducer` becomes (see ``GradientReducer.__reduce__``)."""
    return None


#: How a parameter's gradient hook finds its reducer (see :func:`_on_grad_ready`).
_ReducerRef = Callable[[], "GradientReducer | None"]


class _StrongRef:
    """Called like a weak reference, but keeps the reducer alive (see :func:`_on_grad_ready`)."""

    __slots__ = ("_reducer",)

    def __init__(self, reducer: GradientReducer) -> None:
        self._reducer = reducer

    def __call__(self) -> GradientReducer:
        return self._reducer


class _Bucket:
    """A bucket's persistent state (internal)."""

    def __init__(
        self, index: int, params: list[tuple[int, str, nn.Parameter]], in_place: bool = False
    ) -> None:
        first = params[0][2]
        self.index = index
        self.device = first.device
        self.dtype = first.dtype
        self.param_ids = [i for i, _, _ in params]
        self.names = tuple(n for _, n, _ in params)
        self.params = tuple(p for _, _, p in params)
        self.numel = sum(p.numel() for p in self.params)
        self.in_place = in_place
        # In place (one parameter): the buffer is the gradient itself, found at launch, and the
        # presence flag is this bucket's slot of the reducer's presence tensor (set there).
        self.buffer: torch.Tensor | None = None
        self.views: list[torch.Tensor] = []
        if in_place:
            self.flat = self.data = self.flags = torch.zeros(0, dtype=self.dtype)
        else:
            self.flat = torch.zeros(self.numel + len(self.params), dtype=self.dtype,
                                    device=self.device)
            self.data = self.flat[: self.numel]
            self.flags = self.flat[self.numel:]
        offset = 0
        for p in self.params if not in_place else ():
            self.views.append(self.data.as_strided(p.shape, _dense_strides(p), offset))
            offset += p.numel()
        self.pending = len(self.params)
        self.present = [False] * len(self.params)  # this rank has a gradient (this backward)
        self.slot_state = [_EMPTY] * len(self.params)  # gradient_as_bucket_view only
        self.work: Work | None = None
        self.grad_bucket: GradBucket | None = None

    def info(self) -> BucketInfo:
        return BucketInfo(self.index, self.device, self.dtype, self.numel,
                          self.numel * self.params[0].element_size(), self.names, self.in_place)

    def label(self) -> str:
        assert self.grad_bucket is not None
        return self.grad_bucket.label()


def _dense_strides(p: torch.Tensor) -> tuple[int, ...]:
    """The strides of ``p``'s view in a shared bucket: dense, in ``p``'s memory order (as
    ``torch.empty_like`` makes them; channels_last stays channels_last, like DDP's views)."""
    return tuple(torch.empty_like(p, device="meta").stride())


def _bucket_strides(p: torch.Tensor) -> tuple[int, ...]:
    """:func:`_dense_strides` as the cross-rank fingerprint compares them: 0 for dims of size 1,
    whose stride does not change where any element lies."""
    return tuple(st if n > 1 else 0 for n, st in zip(p.shape, _dense_strides(p), strict=True))


def _assign_buckets(
    params: list[tuple[int, str, nn.Parameter]], cap_bytes: int, first_cap_bytes: int,
    in_place_bytes: int | None = None,
) -> list[tuple[list[tuple[int, str, nn.Parameter]], bool]]:
    """Group by (device, dtype) in reverse order; close a bucket when it reaches its cap.

    A parameter of at least ``in_place_bytes`` (None: none) is a bucket of its own, reduced in
    place. Returns ``(group, in_place)`` pairs in launch order: the shared buckets by their first
    parameter (highest registration index), descending -- the order backward fills them -- then
    the in-place ones, in the same order (they are sent at the end of backward).
    """
    open_: dict[tuple[torch.device, torch.dtype], list[tuple[int, str, nn.Parameter]]] = {}
    size: dict[tuple[torch.device, torch.dtype], int] = {}
    shared: list[list[tuple[int, str, nn.Parameter]]] = []
    in_place: list[list[tuple[int, str, nn.Parameter]]] = []
    for entry in reversed(params):
        p = entry[2]
        nbytes = p.numel() * p.element_size()
        if in_place_bytes is not None and nbytes >= in_place_bytes:
            in_place.append([entry])
            continue
        key = (p.device, p.dtype)
        open_.setdefault(key, []).append(entry)
        size[key] = size.get(key, 0) + nbytes
        limit = first_cap_bytes if not shared else cap_bytes
        if size[key] >= limit:
            shared.append(open_.pop(key))
            size[key] = 0
    shared.extend(open_.values())
    shared.sort(key=lambda b: -b[0][0])
    return [(group, False) for group in shared] + [(group, True) for group in in_place]


def _named_params(
    module_or_params: nn.Module | Iterable[Any],
) -> tuple[nn.Module | None, list[tuple[str, torch.Tensor]]]:
    if isinstance(module_or_params, nn.Module):
        return module_or_params, list(module_or_params.named_parameters())
    if isinstance(module_or_params, torch.Tensor):
        raise TypeError("pass an nn.Module or an iterable of parameters, not a single tensor")
    if not isinstance(module_or_params, Iterable):
        raise TypeError("GradientReducer takes an nn.Module or an iterable of parameters, got "
                        f"{type(module_or_params).__name__}")
    out: list[tuple[str, torch.Tensor]] = []
    seen: set[int] = set()
    for i, item in enumerate(module_or_params):
        if isinstance(item, dict):
            raise TypeError("parameter groups (dicts) are not supported; pass the parameters")
        name, p = item if isinstance(item, tuple) else (f"params.{i}", item)
        if not isinstance(name, str):
            raise TypeError(f"parameter names must be str (as in named_parameters()), got "
                            f"{type(name).__name__} {name!r} for item {i}")
        if not isinstance(p, torch.Tensor):
            raise TypeError(f"{name} is a {type(p).__name__}, not a torch.Tensor")
        if id(p) not in seen:
            seen.add(id(p))
            out.append((name, p))
    return None, out


class GradientReducer:
    """Average gradients across ranks during ``loss.backward()``, overlapped with the backward pass.

    Args:
        module_or_params: an ``nn.Module`` (its parameters and buffers are synchronised) or an
            iterable of parameters or of ``(name, parameter)`` pairs (as Horovod takes them). Tied
            parameters are reduced once, frozen ones (``requires_grad=False``) are skipped.
        comm: the communicator; None calls :func:`gradcomm.init`.
        bucket_cap_mb: cap of each bucket in MiB (2**20 bytes) of gradients (DDP's default 25).
        first_bucket_cap_mb: cap of bucket 0 in MiB (a shared bucket: in-place buckets, see
            ``in_place_min_mb``, always come after the shared ones). None (default): see
            :func:`resolve_first_bucket_cap_mb` -- DDP's 1 MiB, so the first all-reduce starts
            early in the backward pass, when the transport progresses in the background, else
            ``bucket_cap_mb``. Ranks must resolve it alike (checked with the model).
        in_place_min_mb: a gradient of at least this many MiB (2**20 bytes) is not copied into a
            shared bucket: it is a bucket of its own, pre-divided and all-reduced in place in
            ``param.grad`` at the end of backward, which saves a pass
            over its memory for one more collective (the presence flags of all such buckets go
            in one more small all-reduce per backward pass). Such a ``param.grad`` is never a
            bucket view: it stays the tensor autograd made. ``0``: every gradient;
            ``math.inf``: none. None (default): see :func:`resolve_in_place_min_mb` -- 2 MiB
            where collectives are cheap (MPI on host memory), else ``math.inf``. Ranks must
            resolve it alike (checked with the model).
        gradient_as_bucket_view: make each ``param.grad`` a view into its bucket (strides as the
            parameter's), so no gradient is copied out and no memory beyond the buckets is used.
            With ``optimizer.zero_grad(set_to_none=False)`` backward accumulates into the views in
            place; with ``set_to_none=True`` (torch's default) each fresh gradient is copied in and
            pre-divided in one pass and freed, ``param.grad`` reads None until its bucket is sent
            during backward, then is the view.
        broadcast_buffers: also broadcast the module's buffers from rank 0 before every forward
            that runs with gradients enabled outside :meth:`no_sync` (as DDP: an evaluation
            under ``torch.no_grad()``, perhaps on rank 0 only, issues no collective).
        comm_hook: how a bucket is summed: a :class:`~gradcomm.hooks.CommHook`, its name
            (``"allreduce"``, ``"fp16_compress"``, ``"bf16_compress"``) or a callable
            ``hook(state, bucket) -> Work`` (see :mod:`gradcomm.hooks.comm_hooks`).
        gradient_predivide_factor: divide gradients by this before the sum and by
            ``world_size / factor`` after it, a number from 1 to ``world_size`` (so neither step
            multiplies); None: :func:`default_predivide_factor` per bucket dtype.
        overlap: launch buckets during backward as they fill (True) or all at its end (False, the
            old end-of-backward algorithm; same values, bit for bit).
        broadcast_parameters: broadcast parameters and buffers from rank 0 at construction.

    Raises:
        TypeError: bad argument types; a parameter that will produce sparse gradients
            (``nn.Embedding(sparse=True)``) -- named -- or is not a leaf tensor.
        ValueError: bad caps, or a factor outside [1, world_size]; parameters on a device the
            communicator does not serve; the model differs across ranks (raised on every rank,
            naming the first difference, before any other collective).
        RuntimeError: ``comm`` is closed.

    Gradient hooks of your own that change ``param.grad`` (per-parameter clipping, noise) must be
    registered (``register_post_accumulate_grad_hook``) before the reducer is constructed: they
    then run before the reducer's hook, and what they leave in ``param.grad`` is what is reduced,
    on every path. A hook registered after it runs once the gradient was taken: in a shared
    bucket a change is lost (the copy was already made; with ``gradient_as_bucket_view`` it may
    even read ``param.grad`` as None), in an in-place bucket it is summed, so the result would
    depend on ``in_place_min_mb`` and hence on the backend. Such hooks should only read. (In DDP
    they run before its reducer whatever the order, as it hooks the gradient accumulator node.)

    The module is not wrapped: a copy of it (``copy.deepcopy``, ``torch.save`` of the whole module)
    is an ordinary local module whose gradients are not reduced, like the ``.module`` of a DDP
    wrapper.

    During backward it raises :class:`~gradcomm.CollectiveTimeoutError` naming the bucket when a
    collective times out (and RuntimeError from every later backward: a late rank may complete
    the step that timed out here, so the ranks could no longer agree on which step they are in),
    ``TypeError`` naming a parameter whose gradient is sparse, and ``RuntimeError`` (naming it)
    when a parameter or a submodule with parameters was replaced (or deleted) on the module after
    wrapping, or a parameter added, unfrozen, frozen, converted to another dtype or resized there (a
    reassigned buffer is picked up: buffers have no gradient), or when a gradient was accumulated
    again after its bucket was sent (reentrant checkpointing of a parameter also used outside the
    checkpointed region: use ``use_reentrant=False``).

    The reducer owns the order of collectives on ``comm`` during backward. Ranks may differ in which
    parameters get a gradient (a bucket missing one is sent at the end of backward instead), so
    other collectives on the same communicator *inside* backward -- a second reducer's buckets in
    the same backward, an all-reduce in an autograd function -- can pair up out of order across
    ranks; give them a communicator of their own. (A backward that reaches none of the reducer's
    parameters on some rank is not seen there at all, like a skipped backward; as in DDP.)
    """

    def __init__(
        self,
        module_or_params: nn.Module | Iterable[Any],
        comm: Communicator | None = None,
        *,
        bucket_cap_mb: float = 25.0,
        first_bucket_cap_mb: float | None = None,
        in_place_min_mb: float | None = None,
        gradient_as_bucket_view: bool = False,
        broadcast_buffers: bool = False,
        comm_hook: CommHook | str | CommHookFn = CommHook.ALLREDUCE,
        gradient_predivide_factor: float | None = None,
        overlap: bool = True,
        broadcast_parameters: bool = True,
    ) -> None:
        # numpy scalars become floats here, so sizes in bytes are computed in float64
        bucket_cap_mb = _checked_cap_mb("bucket_cap_mb", bucket_cap_mb)
        if first_bucket_cap_mb is not None:
            first_bucket_cap_mb = _checked_cap_mb("first_bucket_cap_mb", first_bucket_cap_mb)
        for name, flag in (("gradient_as_bucket_view", gradient_as_bucket_view),
                           ("broadcast_buffers", broadcast_buffers), ("overlap", overlap),
                           ("broadcast_parameters", broadcast_parameters)):
            if not isinstance(flag, bool):
                raise TypeError(f"{name} must be True or False, got {flag!r}")
        if gradient_predivide_factor is not None:
            f: object = gradient_predivide_factor
            if isinstance(f, bool) or not isinstance(f, numbers.Real):
                raise TypeError(
                    f"gradient_predivide_factor must be a number, got {type(f).__name__}"
                )
            gradient_predivide_factor = float(f)  # 2 and 2.0 (and numpy scalars) alike
        if in_place_min_mb is not None:
            in_place_min_mb = _checked_in_place_min_mb(in_place_min_mb)
        hook_fn = resolve_comm_hook(comm_hook)
        if comm is None:
            from ..comm.selection import init

            comm = init()
        elif not isinstance(comm, Communicator):
            raise TypeError(f"comm must be a gradcomm Communicator, got {type(comm).__name__}")
        if comm.closed:  # at world_size 1 no collective would have noticed
            raise RuntimeError(f"{comm.backend} communicator is closed; build the reducer with an "
                               "open one (gradcomm.init())")
        if gradient_predivide_factor is not None and not (
            1.0 <= gradient_predivide_factor <= comm.world_size
        ):
            # Outside [1, world_size] one of the two factors multiplies: the gradients then
            # overflow or flush to zero sooner than with no split at all (1e39 gave zeros).
            raise ValueError(f"gradient_predivide_factor must be between 1 and world_size "
                             f"({comm.world_size}), got {gradient_predivide_factor}")
        self._comm = comm
        self._module, named = _named_params(module_or_params)
        self._view = bool(gradient_as_bucket_view)
        self._broadcast_buffers = bool(broadcast_buffers)
        self._overlap = bool(overlap)
        self._predivide_arg = gradient_predivide_factor
        self._hook: CommHookFn = hook_fn
        self._hook_state: Any = comm
        # Set by the first synchronised backward, which checks that every rank uses one hook.
        self._hook_agreed = False

        # ---- parameters: trainable, deduplicated, checked
        sparse_names = self._sparse_param_names()
        trainable: list[tuple[int, str, nn.Parameter]] = []
        for name, p in named:
            if not p.requires_grad:
                continue
            if not p.is_leaf:
                raise TypeError(f"parameter {name} is not a leaf tensor; gradients of non-leaf "
                                "tensors are not accumulated")
            if p.layout is not torch.strided:
                raise TypeError(f"parameter {name} is not a dense (strided) tensor")
            if name in sparse_names:
                raise TypeError(f"parameter {name} produces sparse gradients (sparse=True), which "
                                "gradcomm does not reduce; construct the module with sparse=False")
            if p.device.type != comm.device.type:
                raise ValueError(f"parameter {name} is on {p.device}, but the {comm.backend} "
                                 f"communicator reduces tensors on {comm.device}")
            trainable.append((len(trainable), name, p))  # type: ignore[arg-type]
        self._params = [p for _, _, p in trainable]
        self._names = [n for _, n, _ in trainable]
        buffers = list(self._module.named_buffers()) if self._module is not None else []

        # ---- ranks agree on the model (first collective), then on its state
        # The bucket layout decides which collectives run, so ranks must agree on it too (the
        # automatic first cap follows each rank's own background_progress). The options come
        # first: a rank with extra parameters then shows '<no such entry>' against them, not a
        # parameter against the options.
        first_cap = resolve_first_bucket_cap_mb(first_bucket_cap_mb, bucket_cap_mb, comm)
        self._first_bucket_cap_mb = first_cap
        in_place_mb = resolve_in_place_min_mb(in_place_min_mb, comm)
        self._in_place_min_mb = in_place_mb
        entries = [f"GradientReducer option bucket_cap_mb={float(bucket_cap_mb)} "
                   f"first_bucket_cap_mb={first_cap} in_place_min_mb={in_place_mb} "
                   f"gradient_predivide_factor={gradient_predivide_factor}",
                   # These decide which collectives run (a compression hook changes their dtype).
                   f"GradientReducer setting comm_hook={_qualified_name(hook_fn)} "
                   f"broadcast_buffers={broadcast_buffers} "
                   f"broadcast_parameters={broadcast_parameters}"]
        # The layout too: a shared bucket holds each gradient in its parameter's memory order,
        # so a channels_last weight on one rank against a contiguous one on another would sum
        # unrelated elements.
        entries += [f"param {n} {tuple(p.shape)} {p.dtype} requires_grad={p.requires_grad} "
                    f"strides={_bucket_strides(p)}" for n, p in named]
        entries += [f"buffer {n} {tuple(b.shape)} {b.dtype}" for n, b in buffers]
        try:
            check_fingerprint(comm, entries, fix=_MODEL_FIX)
        except ValueError as exc:
            if "GradientReducer option" not in str(exc):
                raise
            # Every rank saw every rank's entry, so every rank raises this same message.
            base = str(exc).removesuffix(f"; {_MODEL_FIX}")
            base = _brief(base, MESSAGE_LIMIT - len(_OPTIONS_ADVICE) - 2)
            raise ValueError(f"{base}; {_OPTIONS_ADVICE}") from None
        if broadcast_parameters:
            broadcast_tensors(comm, [p.detach() for _, p in named] + [b for _, b in buffers])

        # ---- buckets
        in_place_bytes = None if math.isinf(in_place_mb) else int(in_place_mb * _MIB)
        groups = _assign_buckets(trainable, int(bucket_cap_mb * _MIB), int(first_cap * _MIB),
                                 in_place_bytes)
        self._buckets = [_Bucket(i, g, ip) for i, (g, ip) in enumerate(groups)]
        self._loc: list[tuple[int, int]] = [(0, 0)] * len(self._params)
        for b in self._buckets:
            for slot, pid in enumerate(b.param_ids):
                self._loc[pid] = (b.index, slot)
            if not b.in_place:  # an in-place bucket's GradBucket wraps the gradient, at launch
                b.grad_bucket = GradBucket(b.index, b.flat, b.numel, b.params, b.names,
                                           b.index == len(self._buckets) - 1)
        # Presence flags of the in-place buckets (1 where this rank has the gradient), summed by
        # one all-reduce at the end of each synchronised backward pass: float32, which every
        # transport reduces natively and which counts ranks exactly.
        self._in_place = [b for b in self._buckets if b.in_place]
        # Hooks launch the shared buckets below this index; the rest go at the end of backward.
        # At least one bucket always waits for the end-of-backward callback (the last shared one
        # when there is no in-place bucket), so a backward that raises after its last parameter
        # hook (a parameter-free branch that runs last, a read-only user hook registered after
        # the reducer's) still has a bucket to send marked as failed (see _abort_epoch), and the
        # other ranks learn of the failure. Costs nothing where the last gradient is among the
        # last things backward computes (the first layer's weight, as usual).
        shared = len(self._buckets) - len(self._in_place)
        self._hook_launch_limit = shared if self._in_place else max(shared - 1, 0)
        self._presence = torch.zeros(
            len(self._in_place), dtype=torch.float32,
            device=self._in_place[0].device if self._in_place else None,
        )
        for k, b in enumerate(self._in_place):
            b.flags = self._presence[k : k + 1]
        self._presence_work: Work | None = None
        self._overlapping: frozenset[int] = frozenset()
        self._pre = [self._factors(b.dtype)[0] for b in self._buckets]
        self._post = [self._factors(b.dtype)[1] for b in self._buckets]

        # ---- what to watch for replacement after wrapping
        self._owners: list[_Entry] = []
        self._links: list[_Entry] = []
        self._frozen: list[tuple[str, torch.Tensor]] = []  # may be unfrozen later
        self._param_ids = frozenset(id(p) for p in self._params)
        self._layouts = [(p.dtype, p.shape) for p in self._params]  # what the buckets hold
        self._watch: StructureWatch | None = None
        if self._module is not None:
            self._watch_entries(named)
            self._watch = StructureWatch()
            weakref.finalize(self, self._watch.close)

        # ---- per-backward state
        self._require_sync = True
        self._epoch_active = False
        self._ready = [False] * len(self._params)
        self._next = 0  # next bucket to launch
        self._polled = 0  # buckets below this index have completed
        self._removed = False
        # Why reduction stopped for good (a collective of some backward pass failed or timed out).
        self._failed: str | None = None
        self._checked = False  # module checked for replaced params since the last backward
        self._token: weakref.ref[_BackwardEnd] = weakref.ref(_BackwardEnd(self))  # dead

        ref: _ReducerRef = (
            _StrongRef(self) if self._module is None else weakref.ref(self)
        )
        self._handles: list[RemovableHandle] = [
            p.register_post_accumulate_grad_hook(partial(_on_grad_ready, ref, i))
            for i, p in enumerate(self._params)
        ]
        if self._module is not None:
            self._handles.append(self._module.register_forward_pre_hook(_ForwardPreHook(self)))
        elif self._view:
            # Without a module there is no forward hook to notice a failed backward before the
            # next one; in view mode autograd would then add the first new gradient into its view
            # before the reducer's hook sends the failed pass's rest and zeroes the views (with
            # zero_grad(set_to_none=False) the gradients are the views). A hook that runs before
            # accumulation notices it first.
            self._handles += [p.register_hook(partial(_before_accumulate, ref))
                              for p in self._params]
        logger.debug("GradientReducer: %d params in %d buckets on %s", len(self._params),
                     len(self._buckets), comm)

    # ------------------------------------------------------------------ public API
    @property
    def module(self) -> nn.Module | None:
        """The wrapped module (None when constructed from parameters)."""
        return self._module

    @property
    def comm(self) -> Communicator:
        """The communicator the gradients are reduced over."""
        return self._comm

    @property
    def buckets(self) -> tuple[BucketInfo, ...]:
        """One :class:`BucketInfo` per bucket, in launch order."""
        return tuple(b.info() for b in self._buckets)

    @property
    def first_bucket_cap_mb(self) -> float:
        """The cap of bucket 0 in MiB in use (see :func:`resolve_first_bucket_cap_mb`)."""
        return self._first_bucket_cap_mb

    @property
    def in_place_min_mb(self) -> float:
        """Gradients of at least this many MiB are reduced in place (see
        :func:`resolve_in_place_min_mb`; ``math.inf``: none)."""
        return self._in_place_min_mb

    @property
    def parameter_names(self) -> tuple[str, ...]:
        """Names of the reduced parameters, in registration order."""
        return tuple(self._names)

    def predivide_factors(self) -> tuple[tuple[float, float], ...]:
        """``(pre, post)`` divide factors per bucket; ``pre * post == world_size``."""
        return tuple(zip(self._pre, self._post, strict=True))

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Context in which backward passes only accumulate gradients locally.

        The first backward after the context reduces the accumulated sum (DDP's ``no_sync``). The
        backward must run inside the context for its gradients to stay local.
        """
        old = self._require_sync
        self._require_sync = False
        try:
            yield
        finally:
            self._require_sync = old

    def register_comm_hook(self, hook: CommHook | str | CommHookFn, state: Any = None) -> None:
        """Replace how buckets are summed (see :mod:`gradcomm.hooks.comm_hooks`).

        Args:
            hook: a :class:`CommHook`, its name, or a callable ``hook(state, bucket) -> Work``.
            state: first argument of the hook; None passes the communicator.

        Call it on every rank, before the first synchronised backward pass (as DDP requires).
        That backward checks, with one all-gather, that every rank uses the same hook (by its
        ``module.qualname``; the built-in ones by name), and raises ValueError on every rank if
        not; a hook that differed would pair different collectives across ranks (wrong values on
        MPI, an abort on gloo).

        Raises:
            ValueError: unknown hook name.
            TypeError: a hook that is not a name, CommHook or callable.
            RuntimeError: a backward is in flight, or the first synchronised backward pass has
                already run.
        """
        if self._epoch_active:
            raise RuntimeError("cannot change the comm hook while a backward pass is being reduced")
        if self._hook_agreed:
            raise RuntimeError(
                "register_comm_hook must run on every rank before the first synchronised "
                "backward pass; to change the hook, call reducer.remove() and build a new "
                "GradientReducer"
            )
        self._hook = resolve_comm_hook(hook)
        self._hook_state = self._comm if state is None else state

    def synchronize(self) -> None:
        """Wait for every bucket in flight and write the averaged gradients back.

        ``loss.backward()`` already does this at its end; call it (as with Horovod) to be explicit
        before clipping. After a backward pass that raised, it sends the rest of that pass's
        buckets marked as failed -- the other ranks' backward of that step then raises -- and
        writes nothing back (the next forward or backward would do the same).
        """
        self._discard_if_stale()
        if self._epoch_active:
            self._finish_epoch()

    def remove(self) -> None:
        """Detach every hook; later backward passes leave gradients local. Idempotent."""
        for h in self._handles:
            h.remove()
        self._handles = []
        if self._watch is not None:
            self._watch.close()
        self._removed = True

    # A copy of the module is an ordinary local one (see _ForwardPreHook): a reference to the
    # reducer inside it -- apply_gradient_allreduce's ``module.gradient_reducer`` -- is copied and
    # pickled as None rather than trying to copy the live communicator (which cannot be).
    def __deepcopy__(self, memo: dict[int, Any]) -> None:
        return None

    def __reduce__(self) -> tuple[Callable[[], None], tuple[()]]:
        return (_no_reducer, ())

    def __repr__(self) -> str:
        return (f"<GradientReducer {len(self._params)} params in {len(self._buckets)} buckets, "
                f"{self._comm.backend} rank {self._comm.rank}/{self._comm.world_size}>")

    # ------------------------------------------------------------------ construction helpers
    def _factors(self, dtype: torch.dtype) -> tuple[float, float]:
        ws = self._comm.world_size
        pre = (default_predivide_factor(ws, dtype) if self._predivide_arg is None
               else float(self._predivide_arg))
        return pre, ws / pre

    def _sparse_param_names(self) -> set[str]:
        if self._module is None:
            return set()
        out = set()
        for mname, m in self._module.named_modules():
            if isinstance(m, (nn.Embedding, nn.EmbeddingBag)) and m.sparse:
                out.add(f"{mname}.weight" if mname else "weight")
        return out

    def _ownership(self) -> tuple[list[_Entry], list[_Entry]]:
        """What the forward check compares by identity: each reduced parameter in its module's
        ``_parameters`` table, and each submodule on a path from the root to such a module in
        its parent's ``_modules`` table -- every path, for a submodule registered in two places
        -- so that a submodule replaced by one without parameters, moved or deleted is noticed
        too (the replaced module's own table still holds its parameters)."""
        assert self._module is not None
        owners: list[_Entry] = []
        links: list[_Entry] = []
        watched = {id(p) for p in self._params}
        paths = list(self._module.named_modules(remove_duplicate=False))
        by_path = dict(paths)
        seen: set[int] = set()
        on_path: set[str] = set()
        for mname, m in paths:
            params = [(local, p) for local, p in m._parameters.items()
                      if p is not None and id(p) in watched]
            if not params:
                continue
            if id(m) not in seen:
                seen.add(id(m))
                prefix = f"{mname}." if mname else ""
                owners += [(f"parameter {prefix}{local}", m._parameters, local, p)
                           for local, p in params]
            parts = mname.split(".") if mname else []
            on_path.update(".".join(parts[:k]) for k in range(1, len(parts) + 1))
        for path in sorted(on_path):
            parent, _, local = path.rpartition(".")
            links.append((f"submodule {path}", by_path[parent]._modules, local, by_path[path]))
        # Buffers are not watched: they have no gradient, and broadcast_buffers reads them
        # afresh each forward, so a buffer reassigned (``self.avg = 0.9 * self.avg + ...``)
        # is simply picked up.
        return owners, links

    def _check_unchanged(self) -> None:
        for name, p, (dtype, shape) in zip(self._names, self._params, self._layouts,
                                           strict=True):
            if not p.requires_grad:  # frozen after wrapping, maybe on some ranks only
                raise RuntimeError(
                    f"parameter {_brief(name, 60)} was frozen (requires_grad=False) after the "
                    f"GradientReducer was built; {_REBUILD}"
                )
            if p.dtype != dtype or p.shape != shape:  # model.double(), p.data = other shape
                raise RuntimeError(
                    f"parameter {_brief(name, 50)} is now {p.dtype} {tuple(p.shape)}, but it was "
                    f"{dtype} {tuple(shape)} when the GradientReducer was built; {_REBUILD}"
                )
        what = _first_changed(self._owners)
        if what is not None:
            raise RuntimeError(
                f"{_brief(what, 70)} was replaced after the GradientReducer was built; {_REBUILD}"
            )
        if self._module is None or self._watch is None:
            return
        # A parameter unfrozen, or a submodule or parameter added or replaced, after wrapping: its
        # gradient would stay local. Unfreezing keeps the registered object, so it is checked
        # here; anything registered shows in the watch, and only then is the module walked.
        for name, frozen in self._frozen:
            if frozen.requires_grad:
                self._raise_unreduced(name)
        changed = self._watch.changed
        named: list[tuple[str, torch.Tensor]] = []
        if changed:
            known = self._param_ids
            named = list(self._module.named_parameters())
            for name, t in named:
                if t.requires_grad and id(t) not in known:
                    self._raise_unreduced(name)
        # A submodule on the way to reduced parameters replaced without new trainable ones (by
        # nn.Identity(), a frozen copy) or deleted (``del``, which no registration hook sees).
        what = _first_changed(self._links)
        if what is not None:
            raise RuntimeError(
                f"{_brief(what, 70)} was replaced, moved or deleted after the GradientReducer was "
                f"built; {_REBUILD}"
            )
        if changed:
            self._watch_entries(named)  # only frozen parameters came: watch them too
            self._watch.changed = False

    def _watch_entries(self, named: Sequence[tuple[str, torch.Tensor]]) -> None:
        """Record what the forward check compares against: every reduced parameter in its
        module's table, the submodules on the way to them, and the frozen parameters (``named``:
        the module's)."""
        self._owners, self._links = self._ownership()
        self._frozen = [(n, t) for n, t in named if not t.requires_grad]

    @staticmethod
    def _raise_unreduced(name: str) -> None:
        raise RuntimeError(
            f"parameter {_brief(name, 60)} was added, replaced or unfrozen after the "
            f"GradientReducer was built; {_REBUILD}"
        )

    # ------------------------------------------------------------------ forward
    def _on_forward(self, module: nn.Module, args: Any) -> None:
        self._discard_if_stale()
        self._check_unchanged()
        self._checked = True  # _begin_epoch need not check again
        # As DDP: only a forward that will be followed by a synchronised backward broadcasts, so
        # an evaluation under torch.no_grad() on some ranks only (or one inside no_sync) issues
        # no collective; a recompute inside backward (checkpointing) does not either.
        if (self._broadcast_buffers and self._require_sync and torch.is_grad_enabled()
                and _current_autograd_node() is None and self._failed is None):
            broadcast_tensors(self._comm, [b for _, b in module.named_buffers()])

    def _discard_if_stale(self) -> None:
        # A backward pass that raised never runs its end-of-backward callback; the engine then
        # drops the callback, which is how we notice (the weak reference is dead).
        if self._epoch_active and self._token() is None:
            logger.warning("GradientReducer: the previous backward pass ended with an error; "
                           "discarding its partial reduction and sending the rest of its buckets "
                           "marked as failed, so that the other ranks' backward of that step "
                           "raises too")
            self._abort_epoch()

    # ------------------------------------------------------------------ backward
    def _begin_epoch(self) -> None:
        if self._failed is not None:
            raise RuntimeError(
                f"GradientReducer: an earlier backward pass failed ({_brief(self._failed, 85)}); "
                "restart from a checkpoint with a new communicator and reducer"
            )
        if not self._hook_agreed:
            self._agree_on_hook()
        if not self._checked:
            self._check_unchanged()
        token = _BackwardEnd(self)
        self._token = weakref.ref(token)
        self._epoch_active = True
        _queue_engine_callback(token)

    def _agree_on_hook(self) -> None:
        # register_comm_hook is a local call: before the first bucket is sent, every rank checks
        # that the others use the same hook (once per reducer; world_size 1 exchanges nothing).
        try:
            check_fingerprint(
                self._comm, [f"GradientReducer comm_hook={_qualified_name(self._hook)}"],
                problem="the comm hook differs across ranks",
                fix="register the same comm hook on every rank",
                entry="the comm hook",
            )
        except CollectiveTimeoutError as exc:
            self._mark_failed(f"checking the comm hook timed out: {exc}")
            raise CollectiveTimeoutError(
                f"checking that every rank uses the same comm hook: {_brief(str(exc), 140)}"
            ) from exc
        self._hook_agreed = True

    def _on_backward_end(self, token: _BackwardEnd) -> None:
        node = _current_autograd_node()
        if node is not None:
            # End of a nested backward (reentrant checkpoint): run again when the outer node ends.
            handle: list[RemovableHandle] = []

            def requeue(*_: Any) -> None:
                handle[0].remove()
                _queue_engine_callback(token)

            handle.append(node.register_hook(requeue))
            return
        if self._epoch_active:  # synchronize() may have finished it already
            self._finish_epoch()

    def _poll(self) -> None:
        # Drive progress of in-flight collectives (MPI progresses only inside MPI calls).
        while self._polled < self._next:
            b = self._buckets[self._polled]
            try:
                if b.work is None or not b.work.is_completed():
                    return
            except RuntimeError as exc:  # the transport failed (gloo: a peer closed or timed out)
                self._mark_failed(f"reducing {b.label()} failed: {exc}")
                raise
            self._polled += 1

    def _mark_failed(self, why: str) -> None:
        """Refuse every later backward (see _begin_epoch): after a collective failed or timed out
        on this rank, the ranks may disagree on which steps completed."""
        if self._failed is None:
            self._failed = why

    def _stage(self, b: _Bucket, slot: int) -> None:
        """Put one parameter's pre-divided gradient into its bucket slot.

        Copy mode: ``torch.div(grad, pre, out=view)``, one pass, as DDP's reducer does (a gradient
        accumulated again before the bucket is sent is simply staged again).

        ``gradient_as_bucket_view``: a gradient that already is the view (``zero_grad(set_to_none=
        False)``: accumulated in place) is divided in place at launch. A fresh gradient is copied
        and divided in one pass, and ``param.grad`` is set to None until the bucket is sent (then it
        becomes the view): the fresh tensor is freed at once, and a gradient accumulated again
        before the send (reentrant checkpointing) arrives as a new tensor that is added, divided,
        to the slot instead of landing on an already divided view.
        """
        if b.in_place:  # the gradient stays where it is; launch reads and divides it
            return
        if torch.is_grad_enabled():  # backward(create_graph=True); otherwise autograd turned it off
            with torch.no_grad():
                return self._stage(b, slot)
        p, v = b.params[slot], b.views[slot]
        g = p.grad
        pre = self._pre[b.index]
        state = b.slot_state[slot]  # stays _EMPTY in copy mode
        if g is None:
            if state != _DIVIDED:  # a staged view-mode slot reads None until the send
                b.present[slot], b.slot_state[slot] = False, _EMPTY
                v.zero_()  # no gradient on this rank counts as zeros
            return
        b.present[slot] = True
        if g is v:  # view mode, accumulated in place: divided at launch
            b.slot_state[slot] = _IN_VIEW
            return
        if state == _DIVIDED:  # view mode, accumulated again before the send: add this part
            v.add_(torch.div(g, pre) if pre != 1.0 else g)
        elif pre != 1.0:
            torch.div(g, pre, out=v)
        else:
            v.copy_(g)
        if self._view:
            b.slot_state[slot] = _DIVIDED
            p.grad = None  # becomes the view when the bucket is sent

    def _launch(self, b: _Bucket) -> None:
        for slot in range(len(b.params)):
            if not self._ready[b.param_ids[slot]]:  # flushed at the end of backward
                self._stage(b, slot)
        if b.in_place:
            self._launch_in_place(b)
            return
        with torch.no_grad():
            if self._view:
                pre = self._pre[b.index]
                state = b.slot_state
                if pre != 1.0 and _IN_VIEW in state:
                    if all(s == _IN_VIEW for s in state):
                        b.data.div_(pre)  # one kernel for the whole bucket
                    else:
                        for slot, v in enumerate(b.views):
                            if state[slot] == _IN_VIEW:
                                v.div_(pre)
                for slot, p in enumerate(b.params):
                    if state[slot] == _DIVIDED:
                        p.grad = b.views[slot]
            if all(b.present):
                b.flags.fill_(1)
            else:
                b.flags.copy_(torch.tensor(b.present, dtype=b.dtype))
        assert b.grad_bucket is not None
        self._send(b, b.grad_bucket)

    def _launch_in_place(self, b: _Bucket) -> None:
        """Pre-divide the gradient in ``param.grad`` and send it as the bucket's buffer.

        Runs at the end of backward only: autograd may hand a parameter a gradient that is a view
        of a tensor other nodes still read (``p.unsqueeze(0)`` added to an activation), so writing
        into it earlier would corrupt other gradients. A rank without the gradient sends zeros (a
        new tensor, kept if another rank had one). A non-contiguous gradient, a lazy conjugate or
        negative view (``w.conj()`` in the model: its values live in a bit, not in memory, and
        hooks that reinterpret the buffer, e.g. ``torch.view_as_real``, refuse it), or one whose
        memory overlaps another parameter's gradient (see :meth:`_overlapping_grads`), is sent
        as a contiguous pre-divided copy and written back after the sum (``copy_`` honours the
        bits).
        """
        p = b.params[0]
        g = p.grad
        with torch.no_grad():
            pre = self._pre[b.index]
            if g is None:
                buf = torch.zeros(p.shape, dtype=p.dtype, device=p.device)
            elif (g.is_contiguous() and not g.is_conj() and not g.is_neg()
                  and g.data_ptr() not in self._overlapping):
                buf = g
                if pre != 1.0:
                    buf.div_(pre)
            else:
                buf = torch.empty(g.shape, dtype=g.dtype, device=g.device)
                if pre != 1.0:
                    torch.div(g, pre, out=buf)
                else:
                    buf.copy_(g)
            b.flags.fill_(1.0 if g is not None else 0.0)
        self._send_in_place(b, buf)

    def _send_in_place(self, b: _Bucket, buf: torch.Tensor) -> None:
        """Send in-place bucket ``b`` with ``buf`` (the gradient, or a tensor in its stead)."""
        b.buffer = buf
        self._send(b, GradBucket(b.index, buf.view(-1), b.numel, b.params, b.names,
                                 b.index == len(self._buckets) - 1, in_place=True))

    def _send_presence(self) -> None:
        """Post the in-place buckets' presence flags, once per backward pass (if there are any)."""
        if self._in_place and self._presence_work is None:
            self._presence_work = self._comm.all_reduce(
                self._presence, async_op=True, label=_PRESENCE_LABEL
            )

    def _send(self, b: _Bucket, grad_bucket: GradBucket) -> None:
        b.grad_bucket = grad_bucket
        work = self._hook(self._hook_state, grad_bucket)
        if not isinstance(work, Work):
            raise TypeError(f"comm hook {getattr(self._hook, '__name__', self._hook)!r} returned "
                            f"{type(work).__name__}, not a gradcomm Work")
        b.work = work

    def _finish_epoch(self) -> None:
        try:
            if self._in_place or not self._view:  # view mode repoints every grad to its view
                self._overlapping = self._overlapping_grads()
            while self._next < len(self._buckets):
                self._launch(self._buckets[self._next])
                self._next += 1
            self._send_presence()
            failed_elsewhere: str | None = None  # a bucket another rank sent as failed
            for b in self._buckets:
                assert b.work is not None
                self._wait(b.work, b.label())
                if not b.in_place and failed_elsewhere is None and not self._write_back(b):
                    failed_elsewhere = b.label()
            if self._presence_work is not None:
                self._wait(self._presence_work, _PRESENCE_LABEL)
                if failed_elsewhere is None and _has_nan(self._presence.tolist()):
                    failed_elsewhere = _PRESENCE_LABEL
                if failed_elsewhere is None:
                    for b in self._in_place:
                        self._write_back_in_place(b)
        except BaseException as exc:
            if isinstance(exc, RuntimeError):  # a launch or a wait failed in the transport
                self._mark_failed(f"{type(exc).__name__}: {exc}")
            if self._epoch_active:
                self._abort_epoch()
            raise
        self._reset_epoch()
        observer = self._comm.profiler
        if observer is not None:
            observer.step()  # a profiled step ends when its backward's buckets are reduced
        if failed_elsewhere is not None:
            raise RuntimeError(
                f"GradientReducer: the backward pass of this step raised on another rank, which "
                f"marked {_brief(failed_elsewhere, 50)} and later buckets as failed; skip or redo "
                "this step alike on every rank"
            )

    def _overlapping_grads(self) -> frozenset[int]:
        """Start addresses (``data_ptr()``) of the gradients whose memory overlaps the gradient of
        another parameter.

        Autograd can give two parameters views of one memory as gradients (two ``p.unsqueeze(0)``
        added to one activation, batch of 1): reducing both in place would divide and sum that
        memory twice, and writing the results back into it would leave the last one in both --
        and keep them aliased, so that with ``zero_grad(set_to_none=False)`` the next backward
        adds both parameters' gradients into one memory. Such gradients are sent as copies and
        get tensors of their own at write-back. Views that share a storage without overlapping
        (``torch.stack`` of parameters, or a flat gradient buffer of the user's with ``p.grad``
        set to views of it, as apex does) are reduced and written back where they lie, as DDP
        does. Cheap when no storage is shared: one ``untyped_storage().data_ptr()`` per
        gradient; only grads in a shared storage have their byte extents compared.
        """
        by_storage: dict[int, list[torch.Tensor]] = {}
        shared = False
        for p in self._params:
            g = p.grad
            if g is not None and g.numel():
                views = by_storage.setdefault(g.untyped_storage().data_ptr(), [])
                views.append(g)
                shared = shared or len(views) > 1
        if not shared:
            return frozenset()
        spans = []  # (first byte, one past the last byte) of each grad in a shared storage
        for views in by_storage.values():
            if len(views) > 1:
                for g in views:
                    last = sum((n - 1) * st for n, st in zip(g.shape, g.stride(), strict=True))
                    spans.append((g.data_ptr(), g.data_ptr() + (last + 1) * g.element_size()))
        spans.sort()
        overlapping: set[int] = set()
        active: list[tuple[int, int]] = []  # spans that reach past the current start
        for first, stop in spans:
            active = [(a, b) for a, b in active if b > first]
            if active:
                overlapping.add(first)
                overlapping.update(a for a, _ in active)
            active.append((first, stop))
        return frozenset(overlapping)

    def _wait(self, work: Work, label: str) -> None:
        try:
            work.wait()
        except CollectiveTimeoutError as exc:
            self._mark_failed(f"reducing {label} timed out")
            self._abort_epoch(wait=False)
            raise CollectiveTimeoutError(f"reducing {label}: {exc}") from exc

    def _write_back_in_place(self, b: _Bucket) -> None:
        buf, b.buffer = b.buffer, None
        assert buf is not None
        if float(b.flags) == 0.0:
            return  # no gradient on any rank (so none here either): grad stays None everywhere
        p, post = b.params[0], self._post[b.index]
        with torch.no_grad():
            if post != 1.0:
                buf.div_(post)
            g = p.grad
            if g is None or (g is not buf
                             and g.data_ptr() in self._overlapping):
                # no gradient here (the sum arrived in a zero tensor), or one whose memory other
                # gradients share: a tensor of its own, in the parameter's layout as autograd
                # would have made it (channels_last...)
                p.grad = buf if p.is_contiguous() else torch.empty_like(p).copy_(buf)
            elif g is not buf:  # sent as a copy (non-contiguous, lazy conj/neg)
                g.copy_(buf)

    def _write_back(self, b: _Bucket) -> bool:
        """Average and write back one shared bucket; False (nothing written) when another rank
        sent it as failed (NaN presence flags, see :meth:`_abort_epoch`)."""
        post = self._post[b.index]
        flags = b.flags.tolist()
        if _has_nan(flags):
            return False
        overlapping = self._overlapping  # copy mode: grads that must not be written into
        with torch.no_grad():
            if self._view and post != 1.0:
                b.data.div_(post)
            for slot, p in enumerate(b.params):
                if flags[slot] == 0:
                    continue  # no gradient on any rank: grad stays None everywhere
                v, g = b.views[slot], p.grad
                if self._view:
                    if g is not v:
                        p.grad = v
                elif g is None or (overlapping and g.data_ptr() in overlapping):
                    p.grad = torch.div(v, post) if post != 1.0 else v.clone()
                elif post != 1.0:
                    torch.div(v, post, out=g)
                else:
                    g.copy_(v)
        return True

    def _reset_epoch(self) -> None:
        for b in self._buckets:
            b.pending = len(b.params)
            b.work = None
            b.buffer = None
            b.slot_state = [_EMPTY] * len(b.params)
        self._presence_work = None
        self._ready = [False] * len(self._params)
        self._next = 0
        self._polled = 0
        self._epoch_active = False
        self._checked = False

    def _send_rest_as_failed(self) -> None:
        """Send the buckets of this backward pass not sent yet, with NaN presence flags (see
        :meth:`_abort_epoch`): a rank that receives a NaN flag raises instead of writing back."""
        nan = float("nan")
        try:
            with torch.no_grad():
                while self._next < len(self._buckets):
                    b = self._buckets[self._next]
                    if b.in_place:  # zeros: the gradient in param.grad is left alone
                        p = b.params[0]
                        self._send_in_place(b, torch.zeros(p.shape, dtype=p.dtype,
                                                           device=p.device))
                    else:
                        assert b.grad_bucket is not None
                        b.flags.fill_(nan)
                        self._send(b, b.grad_bucket)
                    self._next += 1
                if self._presence_work is None:  # not posted yet: it can still carry the mark
                    self._presence.fill_(nan)
                self._send_presence()
        except Exception as exc:  # noqa: BLE001 - already failing; wait for what went out
            logger.warning("GradientReducer: sending the rest of a failed backward pass failed: "
                           "%s", exc)

    def _abort_epoch(self, wait: bool = True) -> None:
        # A backward pass that failed here (a user hook, a data-dependent error) may not have
        # failed on the other ranks: they wait for the buckets this rank has not sent yet. Send
        # them, marked as failed (NaN presence flags), so that the others' backward of this step
        # raises too instead of averaging partial gradients or pairing the next step's buckets
        # with these; then wait for what was sent, so the next step starts clean on every rank.
        # Not after a timeout or a transport failure, and not past the first failure: the buckets
        # behind a collective that timed out would each time out in turn (MPI cannot cancel
        # them), so a hang would take one full timeout per bucket in flight to surface instead
        # of one.
        failed_here = wait and self._failed is None
        if failed_here:
            self._send_rest_as_failed()
        if wait:
            works = [(b.work, b.label()) for b in self._buckets[: self._next]]
            works.append((self._presence_work, _PRESENCE_LABEL))
            for work, label in works:
                if work is not None:
                    try:
                        work.wait()
                    except Exception as exc:  # noqa: BLE001 - already failing; keep the first
                        logger.warning("GradientReducer: %s failed while aborting: %s; not "
                                       "waiting for the buckets after it", label, exc)
                        break
        if failed_here and self._view:
            # The views are param.grad: what the pass's buckets hold now (partial sums, NaN-flagged
            # data) arrived after the error, perhaps after the caller's zero_grad(set_to_none=
            # False), and would be added to the next step's gradients. The step failed: zero them.
            with torch.no_grad():
                for b in self._buckets:
                    if not b.in_place:
                        b.data.zero_()
        self._reset_epoch()


def _before_accumulate(ref: _ReducerRef, grad: torch.Tensor) -> None:
    """Tensor hook (before accumulation) of a parameter-list reducer in view mode: send the rest
    of a failed backward pass before autograd adds the new gradient into a view (see __init__)."""
    reducer = ref()
    if reducer is not None and reducer._epoch_active and reducer._token() is None:
        reducer._discard_if_stale()


def _on_grad_ready(ref: _ReducerRef, pid: int, param: torch.Tensor) -> None:
    """Post-accumulate-grad hook of parameter ``pid``: stage its gradient, launch ready buckets.

    ``ref()`` gives the reducer: a weak reference when it wraps a module (whose forward hook
    keeps it alive), because torch does not show a tensor's hooks to Python's garbage collector
    and a strong reference here would keep every reducer and module dropped without ``remove()``
    alive for good; a :class:`_StrongRef` when it was built from parameters (nothing else holds
    it). A function, not a method, so that the lookup costs no extra Python call on this path
    (it runs once per parameter per backward).
    """
    reducer = ref()
    if reducer is None or not reducer._require_sync or reducer._removed:
        return
    grad = param.grad
    if grad is not None and grad.layout is not torch.strided:
        raise TypeError(f"parameter {reducer._names[pid]} has a {grad.layout} gradient; "
                        "gradcomm reduces dense gradients only (use sparse=False)")
    # Runs once per parameter per backward: the checks of _discard_if_stale and _poll are
    # inlined so that the common case calls nothing.
    if reducer._epoch_active and reducer._token() is None:
        reducer._discard_if_stale()
    if not reducer._epoch_active:
        reducer._begin_epoch()
    bidx, slot = reducer._loc[pid]
    bucket = reducer._buckets[bidx]
    if reducer._ready[pid]:
        if bucket.work is not None:
            reducer._abort_epoch()
            raise RuntimeError(
                f"the gradient of {reducer._names[pid]} was accumulated again after "
                f"{_brief(bucket.label(), 40)} was sent; a parameter used inside and outside a "
                "reentrant checkpoint does this (use checkpoint(..., use_reentrant=False))"
            )
        reducer._stage(bucket, slot)  # accumulated again before the bucket left: copy again
        return
    reducer._ready[pid] = True
    reducer._stage(bucket, slot)
    bucket.pending -= 1
    if reducer._overlap and bucket.pending == 0 and bidx == reducer._next:
        try:
            buckets = reducer._buckets
            while (reducer._next < reducer._hook_launch_limit
                   and buckets[reducer._next].pending == 0):  # the rest go at the end of backward
                reducer._launch(buckets[reducer._next])
                reducer._next += 1
        except BaseException as exc:
            if isinstance(exc, RuntimeError):  # the transport refused or failed a launch
                reducer._mark_failed(f"{type(exc).__name__}: {exc}")
            reducer._abort_epoch()
            raise
    if reducer._polled < reducer._next:
        reducer._poll()


def apply_gradient_allreduce(module: nn.Module, comm: Communicator | None = None) -> nn.Module:
    """Attach gradient averaging to ``module`` and return it (the old NVIDIA entry point).

    Drop-in for the ``apply_gradient_allreduce(module)`` of NVIDIA's tacotron2/waveglow
    ``distributed.py``: parameters are broadcast from rank 0 and every ``loss.backward()`` ends with
    averaged gradients. The :class:`GradientReducer` doing it (default options) is stored as
    ``module.gradient_reducer``; a ``copy.deepcopy`` or ``torch.save`` of the module is a local
    module whose ``gradient_reducer`` is None.

    Raises:
        TypeError: ``module`` is not an ``nn.Module``.
    """
    if not isinstance(module, nn.Module):
        raise TypeError(f"module must be an nn.Module, got {type(module).__name__}")
    reducer = GradientReducer(module, comm)
    object.__setattr__(module, "gradient_reducer", reducer)
    return module

"""Communication hooks: how one bucket of gradients is summed across ranks.

In the style of PyTorch's ``torch.distributed.algorithms.ddp_comm_hooks.default_hooks``: a hook is a
small pure function ``hook(state, bucket) -> Work`` that starts an asynchronous reduction of
``bucket.buffer()`` and returns its :class:`~gradcomm.comm.Work`. After ``Work.wait()`` the buffer
must hold the element-wise **sum** over ranks; the :class:`~gradcomm.hooks.GradientReducer` does the
averaging itself (pre-divide before the hook, post-divide after the wait), so hooks never divide.
``state`` is whatever was given to ``register_comm_hook`` (default: the reducer's communicator).

Built-in hooks, selectable by :class:`~gradcomm.hooks.CommHook` member, by its name
(:mod:`.choice`), or as the functions below:

==================  =====================================================================
``allreduce``        :func:`allreduce_hook`: one all-reduce (SUM) of the bucket as it is.
``fp16_compress``    :func:`fp16_compress_hook`: cast to float16, all-reduce, cast back.
``bf16_compress``    :func:`bf16_compress_hook`: cast to bfloat16, all-reduce, cast back.
``powersgd``         :func:`~gradcomm.hooks.powersgd.powersgd_hook`: low-rank compression
                     (PowerSGD); by name it gets a :class:`~gradcomm.hooks.PowerSGDState` of
                     default options (see :func:`~gradcomm.hooks.choice.default_hook_state`).
==================  =====================================================================

Accumulation dtype of the compression hooks: the sum is computed by the transport in the wire dtype
(float16 or bfloat16) -- gloo adds 16-bit values element by element, rounding each partial sum to
the wire dtype; a backend whose ``supports(dtype).transfer_dtype`` is wider (e.g. an MPI backend
that upcasts to float32) accumulates in that wider dtype. The result is then cast back to the
bucket's dtype. The reducer's pre-divide
(see :func:`~gradcomm.hooks.reducer.default_predivide_factor`) keeps float16 partial sums in
range, "to avoid overflow" as the DDP fp16 hook puts it.

The bucket buffer holds exactly the bucket's gradients, flattened in parameter order: the
reducer's own state (which ranks have which gradient, whether a rank's backward failed) travels in
a control tensor of its own, so a hook may transform the buffer freely (compress it, approximate
it) as long as it leaves the sum. An in-place bucket (``GradBucket.in_place``: one large gradient
reduced in ``param.grad`` itself at the end of backward, see the reducer's ``in_place_min_mb``)
has the gradient itself as its buffer (see :attr:`GradBucket.flat`).
"""

from __future__ import annotations

import logging
import threading
import warnings
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any, TypeAlias

import torch

from ..comm.communicator import Communicator
from ..comm.errors import SlowPathWarning, brief
from ..comm.hierarchical import HierarchicalAllReduce
from ..comm.types import ReduceOp
from ..comm.work import Work

__all__ = [
    "GradBucket",
    "CommHookFn",
    "allreduce_hook",
    "fp16_compress_hook",
    "bf16_compress_hook",
    "compress_wrapper",
    "fp16_compress_wrapper",
    "bf16_compress_wrapper",
    "warn_if_slow",
]

logger = logging.getLogger("gradcomm.hooks")


@dataclass(frozen=True)
class GradBucket:
    """One bucket as a comm hook sees it (mirrors ``torch.distributed.GradBucket``'s accessors).

    Attributes:
        bucket_index: index of the bucket; buckets are reduced in increasing index order.
        flat: 1-D contiguous tensor of ``numel`` elements, the bucket's dtype and device: the
            (pre-divided) gradients, one after the other in ``params`` order. In an in-place
            bucket: a flat view of the one parameter's gradient itself -- or of a pre-divided
            contiguous copy when the gradient is not contiguous, a lazy conjugate view or
            overlaps another parameter's, or of zeros on a rank without it.
        numel: number of gradient elements (all of ``flat``).
        params: the bucket's parameters, in the order their gradients lie in ``flat``.
        param_names: their names (``module.named_parameters()`` names, or ``params.<i>``).
        last: True for the bucket with the highest index.
        in_place: the buffer is one parameter's gradient.
    """

    bucket_index: int
    flat: torch.Tensor
    numel: int
    params: tuple[torch.Tensor, ...]
    param_names: tuple[str, ...]
    last: bool
    in_place: bool = False

    def index(self) -> int:
        """Index of this bucket (0 is reduced first)."""
        return self.bucket_index

    def buffer(self) -> torch.Tensor:
        """The flat tensor the hook must replace with its element-wise sum over ranks."""
        return self.flat

    def gradients(self) -> torch.Tensor:
        """The gradients (a view of :meth:`buffer`'s ``numel`` elements: all of it)."""
        return self.flat[: self.numel]

    def parameters(self) -> tuple[torch.Tensor, ...]:
        """The bucket's parameters, in buffer order."""
        return self.params

    def is_last(self) -> bool:
        """True for the last bucket reduced in a backward pass."""
        return self.last

    def label(self) -> str:
        """Short text naming the bucket and its first parameters, for messages."""
        names = ", ".join(self.param_names[:3])
        names = brief(names, 40)  # long module paths: errors that quote the label stay short
        more = f" and {len(self.param_names) - 3} more" if len(self.param_names) > 3 else ""
        return f"bucket {self.bucket_index} ({names}{more})"

    def with_buffer(self, flat: torch.Tensor) -> GradBucket:
        """A copy of this bucket whose buffer is ``flat`` (e.g. a compressed copy)."""
        return replace(self, flat=flat)


#: Signature of a comm hook: ``hook(state, bucket) -> Work``.
CommHookFn: TypeAlias = Callable[[Any, GradBucket], Work]

_warned: set[tuple[str, torch.dtype, str]] = set()
_warned_lock = threading.Lock()


def warn_if_slow(comm: Communicator, dtype: torch.dtype, device: torch.device) -> None:
    """Issue one :class:`~gradcomm.SlowPathWarning` per (backend, dtype, device) per process.

    Warns when ``comm.supports(dtype, device).is_slow`` and a collective will really be issued
    (``world_size > 1``); later calls with the same key are silent, whatever the :mod:`warnings`
    filters say (filter the category to silence the first one). The built-in hooks call it with
    the dtype that goes on the wire; a custom hook that calls ``comm.all_reduce`` itself may too.
    """
    key = (comm.backend, dtype, str(device))
    if key in _warned or comm.world_size == 1:
        return
    support = comm.supports(dtype, device)
    with _warned_lock:
        if key in _warned:
            return
        _warned.add(key)  # checked: a fast path is not looked up again either
    if not support.is_slow:
        return
    warnings.warn(
        f"gradcomm: {comm.backend} reduces {dtype} buckets on {device} through a slow path: "
        f"{support.reason}",
        SlowPathWarning,
        stacklevel=2,
    )


def _then(work: Work, fn: Callable[[], None]) -> Work:
    """Run ``fn`` once ``work`` is complete (now, if it already is)."""
    if work.is_completed():
        fn()
    else:
        work.add_callback(fn)
    return work


def allreduce_hook(comm: Communicator, bucket: GradBucket) -> Work:
    """Start one asynchronous all-reduce (SUM) of ``bucket.buffer()`` in place; return its Work."""
    flat = bucket.buffer()
    warn_if_slow(comm, flat.dtype, flat.device)
    return comm.all_reduce(flat, ReduceOp.SUM, async_op=True, label=bucket.label())


def hierarchical_hook(state: HierarchicalAllReduce, bucket: GradBucket) -> Work:
    """Sum ``bucket.buffer()`` by :class:`~gradcomm.comm.HierarchicalAllReduce` (intra-host
    reduce_scatter, inter-host all_reduce, intra-host all_gather); the returned Work is complete.
    :class:`~gradcomm.hooks.GradientReducer` uses it with ``hierarchical=True``."""
    flat = bucket.buffer()
    warn_if_slow(state.comm, flat.dtype, flat.device)
    return state.all_reduce(flat, ReduceOp.SUM, label=bucket.label())


def compress_wrapper(hook: CommHookFn, dtype: torch.dtype) -> CommHookFn:
    """Wrap ``hook`` so that it reduces a copy of the bucket cast to ``dtype``.

    The wrapped hook casts ``bucket.buffer()`` to ``dtype`` (compress), runs ``hook`` on that copy,
    and once its Work completes casts the result back into the original buffer (decompress), as
    Horovod's ``Compressor.compress``/``decompress`` and torch's ``fp16_compress_wrapper`` do. A
    bucket already of ``dtype`` is passed through unchanged; a complex bucket is compressed as its
    real view (real and imaginary parts each cast to ``dtype``).

    Raises:
        TypeError: ``dtype`` is not a floating-point dtype.
    """
    if not dtype.is_floating_point:
        raise TypeError(f"compression dtype must be floating-point, got {dtype}")

    def compressed_hook(state: Any, bucket: GradBucket) -> Work:
        flat = bucket.buffer()
        # A complex bucket is compressed as its real view: casting it would drop the imaginary
        # parts (and a complex float16 is not what the transports reduce).
        source = torch.view_as_real(flat).view(-1) if flat.is_complex() else flat
        if source.dtype == dtype:
            return hook(state, bucket)
        wire = source.to(dtype)
        work = hook(state, bucket.with_buffer(wire))

        def decompress() -> None:
            source.copy_(wire)

        return _then(work, decompress)

    inner = getattr(hook, "__name__", "hook")
    # Named after what it does (the GradientReducer's cross-rank check compares hooks by name).
    compressed_hook.__name__ = compressed_hook.__qualname__ = (
        f"{inner}_{str(dtype).removeprefix('torch.')}"
    )
    compressed_hook.__doc__ = f"Run {inner} on a {dtype} copy of a bucket."
    return compressed_hook


def fp16_compress_wrapper(hook: CommHookFn) -> CommHookFn:
    """``compress_wrapper(hook, torch.float16)``: run ``hook`` on a float16 copy of the bucket."""
    return compress_wrapper(hook, torch.float16)


def bf16_compress_wrapper(hook: CommHookFn) -> CommHookFn:
    """``compress_wrapper(hook, torch.bfloat16)``: run ``hook`` on a bfloat16 copy of the bucket."""
    return compress_wrapper(hook, torch.bfloat16)


fp16_compress_hook: CommHookFn = fp16_compress_wrapper(allreduce_hook)
fp16_compress_hook.__name__ = fp16_compress_hook.__qualname__ = "fp16_compress_hook"
fp16_compress_hook.__doc__ = (
    "Cast the bucket to float16, all-reduce (SUM, accumulated in float16 on gloo), cast back."
)
bf16_compress_hook: CommHookFn = bf16_compress_wrapper(allreduce_hook)
bf16_compress_hook.__name__ = bf16_compress_hook.__qualname__ = "bf16_compress_hook"
bf16_compress_hook.__doc__ = (
    "Cast the bucket to bfloat16, all-reduce (SUM, accumulated in bfloat16 on gloo), cast back."
)

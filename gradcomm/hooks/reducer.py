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
   (one pass; an in-place gradient is divided where it lies) and marks it ready; gradients under
   16384 elements are only counted, and copied in together (one foreach copy, one division) when
   their bucket is sent, so that many small parameters cost little Python each. When every
   parameter of the lowest-index bucket not yet launched is ready, that bucket's comm hook (an
   async all-reduce by default) is started; buckets are launched strictly in index order, so
   every rank issues the same collectives in the same order. The last shared bucket (when there
   is no in-place one) is left to the end-of-backward callback, so that a backward that fails
   after its last parameter hook still has a bucket to send marked as failed.
3. The first hook of a backward pass queues one end-of-backward callback on the autograd engine. It
   launches the remaining buckets (parameters with no gradient on this rank count as zeros), waits
   for every bucket in order, post-divides and writes the averages back, so ``optimizer.step()``
   after ``loss.backward()`` sees averaged gradients.

Presence of gradients and failures: one small control tensor per backward pass (see
:mod:`._control`), summed after the last bucket -- within that bucket's all-reduce when the hook
is the default one, the bucket float32 or float64 and the ranks 2 -- carries one flag per
parameter (1 when this rank has a gradient for it; a rank without an in-place gradient sends zeros
in its place) and the failure signal. A parameter whose flags sum to 0 had no gradient on any
rank and keeps ``grad=None``; a step whose backward raised on some rank raises on every rank. The
comm hooks see only gradients.

:class:`GradientReducer` is a facade over its parts: :mod:`._options` (validation and
per-communicator defaults), :mod:`._buckets` (layout and storage), :mod:`._guard` (the model's
ownership and structure checks), :mod:`._backward` (the per-backward state machine) and
:mod:`._autograd` (the hooks torch calls).
"""

from __future__ import annotations

import contextlib
import logging
import math
import weakref
from collections.abc import Callable, Iterable, Iterator
from contextlib import AbstractContextManager
from typing import Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from ..comm.communicator import Communicator
from ..comm.errors import MESSAGE_LIMIT, brief
from ..comm.hierarchical import HierarchicalAllReduce
from ._autograd import refuse_recorded_graphs, remove_handles
from ._backward import BackwardPass, CommHookSlot, register_hooks
from ._bucket_plan import BucketInfo, assign_buckets, bucket_strides
from ._buckets import Bucket, InPlaceBucket, SharedBucket
from ._guard import (
    ModelGuard,
    claim_params,
    named_params,
    release_params,
    trainable_params,
)
from ._join import join_context
from ._options import (
    MIB,
    ReducerOptions,
    default_predivide_factor,
    resolve_first_bucket_cap_mb,
    resolve_in_place_min_mb,
)
from ._shard_grads import ShardedGrad
from ._sync import broadcast_tensors, check_fingerprint
from .choice import CommHook, default_hook_state, resolve_comm_hook
from .comm_hooks import CommHookFn, allreduce_hook, hierarchical_hook

__all__ = [
    "GradientReducer",
    "BucketInfo",
    "default_predivide_factor",
    "resolve_first_bucket_cap_mb",
    "resolve_in_place_min_mb",
]

logger = logging.getLogger("gradcomm.hooks")

# With the automatic defaults each rank derives first_bucket_cap_mb and in_place_min_mb from its
# own hardware, which can differ on uneven hosts (docs/failures.md).
_OPTIONS_ADVICE = "set them explicitly, the same on every rank"
_MODEL_FIX = "build the same model, with the same options, on every rank"


def _no_reducer() -> None:
    """What an unpickled :class:`GradientReducer` becomes (see ``GradientReducer.__reduce__``)."""
    return None


def _agree_on_model(comm: Communicator, module: nn.Module | None, named: list[tuple[str, Any]],
                    opts: ReducerOptions, resolved: tuple[float, float],
                    hook_fn: CommHookFn) -> list[RemovableHandle]:
    """Ranks agree on the options and the model (the first collective), then on its state.
    Returns the hooks refusing graphs recorded before (see :func:`refuse_recorded_graphs`),
    to remove at the module's first forward with gradients.

    Raises:
        ValueError: on every rank, naming the first entry that differs.
    """
    buffers = list(module.named_buffers()) if module is not None else []
    # The bucket layout decides which collectives run, so ranks must agree on it too (the
    # automatic first cap follows each rank's own background_progress). The options come
    # first: a rank with extra parameters then shows '<no such entry>' against them, not a
    # parameter against the options.
    entries = opts.fingerprint(*resolved, hook_fn)
    # The layout too: a shared bucket holds each gradient in its parameter's memory order,
    # so a channels_last weight on one rank against a contiguous one on another would sum
    # unrelated elements.
    entries += [f"param {n} {tuple(p.shape)} {p.dtype} requires_grad={p.requires_grad} "
                f"strides={bucket_strides(p)}" for n, p in named]
    entries += [f"buffer {n} {tuple(b.shape)} {b.dtype}" for n, b in buffers]
    try:
        check_fingerprint(comm, entries, fix=_MODEL_FIX)
    except ValueError as exc:
        if "GradientReducer option" not in str(exc):
            raise
        # Every rank saw every rank's entry, so every rank raises this same message; the options'
        # advice replaces the model's.
        base = brief(str(exc).removesuffix(f"; {_MODEL_FIX}"),
                     MESSAGE_LIMIT - len(_OPTIONS_ADVICE) - 2)
        raise ValueError(f"{base}; {_OPTIONS_ADVICE}") from None
    if not opts.broadcast_parameters:
        return []
    # A graph recorded before now saved the old values: every rank must refuse its backward
    # (rank 0's values did not change, but it would wait for the others in its first bucket).
    if module is None:
        # Nothing marks the first new graph: autograd refuses the old one ("modified by an
        # inplace operation"), on rank 0 too since its versions are bumped as the others' are.
        params = [p.detach() for _, p in named]
        broadcast_tensors(comm, params)
        if comm.rank == 0:
            torch.autograd.graph.increment_version(params)
        return []
    stale = refuse_recorded_graphs([p for _, p in named])
    # Through ``.data``, which keeps the version counters: autograd's own error would come
    # before the reducer's, and on the receiving ranks only.
    broadcast_tensors(comm, [p.data for _, p in named] + [b for _, b in buffers])
    return stale


def _make_buckets(opts: ReducerOptions, trainable: list[tuple[int, str, nn.Parameter]],
                  resolved: tuple[float, float], world_size: int) -> list[Bucket]:
    """The buckets, in launch order (see :func:`assign_buckets`)."""
    first_cap, in_place_mb = resolved
    in_place_bytes = None if math.isinf(in_place_mb) else int(in_place_mb * MIB)
    groups = assign_buckets(trainable, int(opts.bucket_cap_mb * MIB),
                            int(first_cap * MIB), in_place_bytes)
    ws, last = world_size, len(groups) - 1
    return [InPlaceBucket(i, g, opts.factors(ws, g[0][2].dtype), i == last) if ip
            else SharedBucket(i, g, opts.factors(ws, g[0][2].dtype), i == last,
                              opts.gradient_as_bucket_view)
            for i, (g, ip) in enumerate(groups)]


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
            over its memory for one more collective. Such a ``param.grad`` is never a
            bucket view: it stays the tensor autograd made. ``0``: every gradient;
            ``math.inf``: none. None (default): see :func:`resolve_in_place_min_mb` -- 2 MiB
            where collectives are cheap (MPI on host memory), else ``math.inf``. Ranks must
            resolve it alike (checked with the model).
        gradient_as_bucket_view: make each ``param.grad`` a view into its bucket (strides as the
            parameter's), so no gradient is copied out and no memory beyond the buckets is used.
            With ``optimizer.zero_grad(set_to_none=False)`` backward accumulates into the views in
            place; with ``set_to_none=True`` (torch's default) each fresh gradient is copied in,
            pre-divided, and freed (``param.grad`` reads None until its bucket is sent during
            backward, then is the view; a gradient under 16384 elements stays until the send,
            when its bucket's small gradients are copied in together).
        broadcast_buffers: also broadcast the module's buffers from rank 0 before every forward
            that runs with gradients enabled outside :meth:`no_sync` (as DDP: an evaluation
            under ``torch.no_grad()``, perhaps on rank 0 only, issues no collective).
        comm_hook: how a bucket is summed: a :class:`~gradcomm.hooks.CommHook`, its name
            (``"allreduce"``, ``"fp16_compress"``, ``"bf16_compress"``, ``"powersgd"``) or a
            callable ``hook(state, bucket) -> Work`` (see :mod:`gradcomm.hooks.comm_hooks`); its
            state: the communicator, or for ``"powersgd"`` a new
            :class:`~gradcomm.hooks.PowerSGDState` of default options (give one with options
            through :meth:`register_comm_hook`).
        gradient_predivide_factor: divide gradients by this before the sum and by
            ``world_size / factor`` after it, a number from 1 to ``world_size`` (so neither step
            multiplies); None: :func:`default_predivide_factor` per bucket dtype.
        overlap: launch buckets during backward as they fill (True) or all at its end (False, the
            old end-of-backward algorithm; same values, bit for bit).
        broadcast_parameters: broadcast parameters and buffers from rank 0 at construction.
        hierarchical: sum each bucket by a hierarchical all-reduce over ``comm.split_by_host()``
            (intra-host reduce_scatter, inter-host all_reduce, intra-host all_gather; see
            :mod:`gradcomm.comm.hierarchical`): bit-identical across ranks, equal to the flat sum
            up to rounding; each bucket's three steps complete before the hook returns. Needs
            the same number of ranks on every host; hosts come from ``GRADCOMM_HOST_ID`` or the
            hostname. Not with another ``comm_hook``.
        step_check: a rank that skipped a backward (counted: forwards with gradients enabled
            since the last synchronised backward) makes every rank raise RuntimeError before
            write-back, at no extra collective (docs/failures.md); False: no check.

    Raises:
        TypeError: bad argument types; a parameter that will produce sparse gradients
            (``nn.Embedding(sparse=True)``) -- named -- or is not a leaf tensor.
        ValueError: bad caps, or a factor outside [1, world_size]; parameters on a device the
            communicator does not serve; the model differs across ranks (raised on every rank,
            naming the first difference, before any other collective).
        RuntimeError: ``comm`` is closed; a parameter is reduced by another reducer that was not
            removed (``remove()``).

    Gradient hooks of your own that change ``param.grad`` (clipping, noise) must be registered
    before the reducer is constructed, so they run before its hook; one registered after it
    should only read (docs/reducer.md, "Gradient hooks of your own").

    The module is not wrapped: a copy of it (``copy.deepcopy``, ``torch.save`` of the whole module)
    is an ordinary local module whose gradients are not reduced, like the ``.module`` of a DDP
    wrapper.

    During backward it raises :class:`~gradcomm.CollectiveTimeoutError` naming the bucket when a
    collective times out (then RuntimeError from every later backward), ``TypeError`` naming a
    parameter whose gradient is sparse, and ``RuntimeError``: on every rank when the ranks are out
    of step (``step_check``) or a rank's backward of this step raised; naming the parameter or
    submodule replaced, deleted, added, unfrozen, frozen, converted or resized after wrapping (a
    reassigned buffer is picked up); when a gradient was accumulated again after its bucket was
    sent (reentrant checkpointing: use ``use_reentrant=False``). Details: docs/failures.md.

    The reducer owns the order of collectives on ``comm`` during backward: other collectives on the
    same communicator *inside* backward (a second reducer's buckets in the same backward, an
    all-reduce in an autograd function) can pair up out of order across ranks, since ranks may
    differ in which parameters get a gradient; give them a communicator of their own.
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
        hierarchical: bool = False,
        step_check: bool = True,
    ) -> None:
        resolved_hook = resolve_comm_hook(comm_hook)
        opts = ReducerOptions.checked(
            bucket_cap_mb=bucket_cap_mb, first_bucket_cap_mb=first_bucket_cap_mb,
            in_place_min_mb=in_place_min_mb, gradient_as_bucket_view=gradient_as_bucket_view,
            broadcast_buffers=broadcast_buffers,
            gradient_predivide_factor=gradient_predivide_factor, overlap=overlap,
            broadcast_parameters=broadcast_parameters, hierarchical=hierarchical,
            custom_hook=resolved_hook is not allreduce_hook, step_check=step_check)
        hook_fn = hierarchical_hook if opts.hierarchical else resolved_hook
        if comm is None:
            from ..comm import init

            comm = init()
        elif not isinstance(comm, Communicator):
            raise TypeError(f"comm must be a gradcomm Communicator, got {type(comm).__name__}")
        if comm.closed:  # at world_size 1 no collective would have noticed
            raise RuntimeError(f"{comm.backend} communicator is closed; build the reducer with an "
                               "open one (gradcomm.init())")
        opts.check_comm(comm)
        self._comm = comm
        self._module, named = named_params(module_or_params)
        trainable = trainable_params(self._module, named, comm)
        self._params = [p for _, _, p in trainable]
        self._names = [n for _, n, _ in trainable]
        self._guard = ModelGuard(self._module, self._params, self._names, named)
        claim_params(self._guard)  # before any collective: raised alike on every rank
        resolved = opts.resolved(comm)
        self._first_bucket_cap_mb, self._in_place_min_mb = resolved
        self._join_refused = ""  # why join() cannot be used (set by a ShardedOptimizer)
        try:
            self._stale_graphs = _agree_on_model(comm, self._module, named, opts, resolved,
                                                 hook_fn)
        except BaseException:
            release_params(self._guard)
            raise
        self._buckets = _make_buckets(opts, trainable, resolved, comm.world_size)
        self._watch = self._guard.watch
        if self._watch is not None:
            weakref.finalize(self, self._watch.close)
        state = (HierarchicalAllReduce(comm) if opts.hierarchical
                 else default_hook_state(hook_fn, comm))
        self._comm_hook = CommHookSlot(hook_fn, state)
        self._backward = BackwardPass(comm, self._buckets, self._guard, self._comm_hook, opts)
        self._handles = register_hooks(self._backward, self._params, self._module,
                                       self._on_forward, opts.gradient_as_bucket_view)
        logger.debug("GradientReducer: %d params in %d buckets on %s", len(self._params),
                     len(self._buckets), comm)

    def _on_forward(self, module: nn.Module) -> None:
        if self._stale_graphs and torch.is_grad_enabled():
            # Graphs recorded from now on are new (they may share the old graph's nodes).
            self._stale_graphs = remove_handles(self._stale_graphs)
        self._backward.on_forward(module)

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
        return tuple((b.pre, b.post) for b in self._buckets)

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Context in which backward passes only accumulate gradients locally.

        The first backward after the context reduces the accumulated sum (DDP's ``no_sync``). The
        backward must run inside the context for its gradients to stay local.
        """
        bw = self._backward
        old = bw.require_sync
        bw.require_sync = False
        try:
            yield
        finally:
            bw.require_sync = old

    def join(self, divide_by_initial_world_size: bool = False) -> AbstractContextManager[None]:
        """Context for uneven inputs: wrap the training loop in it on every rank (DDP's ``join()``).

        A rank whose loop ends first shadows the others' synchronised steps until every rank has
        left the block; then all get the model of a rank that ran every step (docs/reducer.md).
        ``divide_by_initial_world_size``: False averages a step over the ranks that contributed;
        True divides by ``world_size`` (DDP's default). The same on every rank.

        Raises:
            TypeError: ``divide_by_initial_world_size`` is not a bool.
            RuntimeError: on leaving the block inside :meth:`no_sync`, with a backward in
                flight, or after a failed backward pass; on entering it when a
                :class:`~gradcomm.hooks.ShardedOptimizer` steps this reducer's parameters.
            CollectiveTimeoutError: the other ranks ran no synchronised step within the timeout.
        """
        if self._join_refused:  # raised on entry, on every rank alike
            raise RuntimeError(self._join_refused)
        return join_context(self._backward, divide_by_initial_world_size)

    def register_comm_hook(self, hook: CommHook | str | CommHookFn, state: Any = None) -> None:
        """Replace how buckets are summed (see :mod:`gradcomm.hooks.comm_hooks`).

        Args:
            hook: a :class:`CommHook`, its name, or a callable ``hook(state, bucket) -> Work``.
            state: first argument of the hook; None: the communicator (for ``"powersgd"``, a
                new :class:`~gradcomm.hooks.PowerSGDState` of default options).

        Call it on every rank, before the first synchronised backward pass (as DDP requires).
        That backward checks, with one all-gather, that every rank uses the same hook (by its
        ``module.qualname``; the built-in ones by name), and raises ValueError on every rank if
        not; a hook that differed would pair different collectives across ranks (wrong values on
        MPI, an abort on gloo).

        Raises:
            ValueError: unknown hook name.
            TypeError: a hook that is neither a name, a CommHook nor a callable.
            RuntimeError: a backward is in flight, or the first synchronised backward pass has
                already run.
        """
        if self._backward.epoch_active:
            raise RuntimeError("cannot change the comm hook while a backward pass is being reduced")
        if self._comm_hook.agreed:
            raise RuntimeError(
                "register_comm_hook must run on every rank before the first synchronised "
                "backward pass; to change the hook, call reducer.remove() and build a new "
                "GradientReducer"
            )
        fn = resolve_comm_hook(hook)
        self._comm_hook.fn = fn
        self._comm_hook.state = default_hook_state(fn, self._comm) if state is None else state

    def synchronize(self) -> None:
        """Wait for every bucket in flight and write the averaged gradients back.

        ``loss.backward()`` already does this at its end; call it (as with Horovod) to be explicit
        before clipping. After a backward pass that raised, it sends the rest of that pass's
        buckets marked as failed -- the other ranks' backward of that step then raises -- and
        writes nothing back (the next forward or backward would do the same).
        """
        bw = self._backward
        bw.discard_if_stale()
        if bw.epoch_active:
            bw.finish()

    def remove(self) -> None:
        """Detach every hook; later backward passes leave gradients local. Idempotent.

        A stage-2 ShardedOptimizer's gradient stand-ins are cleared (``param.grad`` None), so the
        next backward stores local gradients."""
        self._handles = remove_handles(self._handles)
        for p in self._params:
            if type(p.grad) is ShardedGrad:
                p.grad = None
        self._stale_graphs = remove_handles(self._stale_graphs)
        if self._watch is not None:
            self._watch.close()
        self._backward.removed = True
        release_params(self._guard)

    # A copy of the module is an ordinary local one (see ForwardPreHook): a reference to the
    # reducer inside it -- apply_gradient_allreduce's ``module.gradient_reducer`` -- is copied and
    # pickled as None rather than trying to copy the live communicator (which cannot be).
    def __deepcopy__(self, memo: dict[int, Any]) -> None:
        return None

    def __reduce__(self) -> tuple[Callable[[], None], tuple[()]]:
        return (_no_reducer, ())

    def __repr__(self) -> str:
        return (f"<GradientReducer {len(self._params)} params in {len(self._buckets)} buckets, "
                f"{self._comm.backend} rank {self._comm.rank}/{self._comm.world_size}>")

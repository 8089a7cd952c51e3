"""The per-backward state machine of a reducer: ready, launch, poll, finish, abort.

One backward pass (an *epoch*) goes: the first gradient hook :meth:`BackwardPass.begin`\\ s it
(checks, and one end-of-backward callback queued on the autograd engine); each gradient marks its
parameter ready, and when every parameter of the lowest-index bucket not yet launched is ready that
bucket is launched through the comm hook -- strictly in index order, so every rank issues the same
collectives in the same order (torch DDP's reducer does the same); in-flight collectives are
polled from the hooks (a failed one is noticed early). At the end of backward :meth:`finish`
launches the rest (no gradient on this rank counts as zeros), waits for every bucket in order and
writes the averages back. Besides the buckets, every pass sends one small control tensor (see
:mod:`._control`: presence flags, the failure signal and each rank's step state, checked by
:mod:`._steps`), after the last bucket or within its all-reduce (:class:`._control.ControlCarrier`).
A pass that
raised is noticed at the next forward, backward or ``synchronize()``, and :meth:`abort` sends its
remaining buckets and the control tensor marked as failed, so that the other ranks' backward of
that step raises too instead of pairing collectives of different steps.

Nested backward passes (reentrant activation checkpointing) run their own autograd graph task; a
callback that fires at the end of such an inner task defers itself to the end of the outer one.

The autograd hooks that drive a pass are at the end of this module: a post-accumulate-grad hook
per parameter (:func:`on_grad_ready`) counts the gradient (and stages a large one) and launches
the buckets that became ready; the first one of a pass queues one end-of-backward callback
(:class:`BackwardEnd`). They only forward to the pass, so that torch's hooks hold nothing else.
"""

from __future__ import annotations

import logging
import operator
import weakref
from collections.abc import Callable
from functools import partial
from typing import Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from ..comm.communicator import Communicator
from ..comm.errors import MESSAGE_LIMIT, CollectiveTimeoutError, brief
from ..comm.work import Work
from ._autograd import ForwardPreHook, current_autograd_node, queue_engine_callback
from ._buckets import Bucket, dense_only
from ._control import CONTROL_LABEL, ControlCarrier, ControlTensor
from ._guard import ModelGuard
from ._options import ReducerOptions, qualified_name
from ._overlap import overlapping_grads
from ._steps import StepState, active_ranks, step_mismatch
from ._sync import broadcast_tensors, check_fingerprint
from .comm_hooks import CommHookFn, GradBucket

__all__ = ["BackwardPass", "CommHookSlot", "write_back"]

logger = logging.getLogger("gradcomm.hooks")
_grad_of = operator.attrgetter("grad")

def write_back(buckets: list[Bucket], spans: list[tuple[int, int]], control: ControlTensor,
               overlapping: frozenset[int], divide_by_initial_world_size: bool,
               sink: Callable[[Bucket, list[float]], None] | None = None,
               grads: list[torch.Tensor | None] | None = None) -> None:
    """Write the averages back: the sums divided by the number of ranks that contributed (all
    but the joined ones, see GradientReducer.join; or by world_size). A ``sink`` (a sharded
    optimizer's) takes each bucket, with its parameters' summed presence flags, instead.
    ``grads``: every parameter's ``.grad`` by index, if the caller read them since the hooks."""
    summed, steps = control.summed(), control.steps()
    n = len(steps) - steps.count(0.0)  # joined ranks send 0
    rescale = n != len(steps) and not divide_by_initial_world_size
    for b, (lo, hi) in zip(buckets, spans, strict=True):
        post = b.post
        if rescale:  # pre * post == number of contributing ranks for this step
            b.post = n / b.pre
        try:
            if sink is None:
                b.write_back(summed[lo:hi], overlapping, grads)
            else:
                sink(b, summed[lo:hi])
        finally:
            b.post = post


def _locations(buckets: list[Bucket], count: int) -> list[tuple[int, int]]:
    """``(bucket index, slot)`` of each of the ``count`` parameters, by parameter index."""
    loc = [(0, 0)] * count
    for b in buckets:
        for slot, pid in enumerate(b.param_ids):
            loc[pid] = (b.index, slot)
    return loc


def _succeeded(work: Work) -> bool:
    """Whether ``work`` completed without error. A failed one (its error is raised by the pass
    that waited on it, or being raised now) must not replace that error while resetting."""
    try:
        return work.is_completed()
    except RuntimeError:
        return False


class CommHookSlot:
    """The comm hook a reducer sends its buckets through, and whether ranks agreed on it."""

    def __init__(self, fn: CommHookFn, state: Any) -> None:
        self.fn = fn
        self.state = state
        # Set by the first synchronised backward, which checks that every rank uses one hook.
        self.agreed = False

    def agree(self, comm: Communicator) -> None:
        """Check, with one all-gather (none at world_size 1), that every rank uses this hook.

        Raises:
            ValueError: on every rank, when the ranks' hooks differ.
            CollectiveTimeoutError: a rank did not arrive.
        """
        check_fingerprint(
            comm, [f"GradientReducer comm_hook={qualified_name(self.fn)}"],
            problem="the comm hook differs across ranks",
            fix="register the same comm hook on every rank",
            entry="register_comm_hook",
        )
        self.agreed = True

    def send(self, b: Bucket, grad_bucket: GradBucket) -> None:
        """Start the reduction of ``grad_bucket`` (``b``'s buffer) and keep its Work in ``b``.

        Raises:
            TypeError: the hook returned something other than a gradcomm Work.
        """
        b.grad_bucket = grad_bucket
        work = self.fn(self.state, grad_bucket)
        if not isinstance(work, Work):
            raise TypeError(f"comm hook {getattr(self.fn, '__name__', self.fn)!r} returned "
                            f"{type(work).__name__}, not a gradcomm Work")
        b.work = work


class BackwardPass:
    """The reduction state of the current backward pass, and what runs it (see the module)."""

    def __init__(self, comm: Communicator, buckets: list[Bucket], guard: ModelGuard,
                 hook: CommHookSlot, options: ReducerOptions) -> None:
        self.comm = comm
        self.buckets = buckets
        self.guard = guard
        self.hook = hook
        self.params = guard.params
        self.names = guard.names
        self.view = options.gradient_as_bucket_view
        self.overlap = options.overlap
        self.broadcast_buffers = options.broadcast_buffers
        self.loc = _locations(buckets, len(self.params))
        self.in_place = [b for b in buckets if b.in_place]
        self._nbytes = [p.numel() * p.element_size() for p in self.params]  # = each grad's
        # Hooks launch the shared buckets below this index; at least one waits for the end of
        # backward, so a gradient accumulated again after its last hook (reentrant checkpointing
        # near the input) is staged again rather than refused.
        shared = len(buckets) - len(self.in_place)
        self.hook_launch_limit = shared if self.in_place else max(shared - 1, 0)
        self.control = ControlTensor(comm, [len(b.params) for b in buckets])
        self._spans: list[tuple[int, int]] = []  # each bucket's presence flags in the control
        offset = 0
        for b, flags in zip(buckets, self.control.flags, strict=True):
            b.flags = flags
            self._spans.append((offset, offset + len(b.params)))
            offset += len(b.params)
        self.carrier = ControlCarrier(comm, buckets, self.control)
        self.overlapping: frozenset[int] = frozenset()
        self.steps = StepState(options.step_check)
        # Ranks that contributed to the last reduced backward (all but the joined ones, see
        # GradientReducer.join); the same on every rank, as it is read from the control's sum.
        self.active: list[int] = list(range(comm.world_size))
        self.divide_by_initial_world_size = False  # set by join()
        self.require_sync = True
        self.epoch_active = False
        self.ready = [False] * len(self.params)
        self.next = 0  # next bucket to launch
        self.polled = 0  # buckets below this index have completed
        self.removed = False
        # Why reduction stopped for good (a collective of some backward pass failed or timed out).
        self.failed: str | None = None
        self.checked = False  # module checked for replaced params since the last backward
        # Takes each reduced bucket instead of its write_back (a ShardedOptimizer of stage 2 keeps
        # only this rank's shard): sink(bucket, summed presence flags of its parameters).
        self.sink: Callable[[Bucket, list[float]], None] | None = None
        self.token: weakref.ref[BackwardEnd] = weakref.ref(BackwardEnd(self))  # dead

    # ------------------------------------------------------------------ forward
    def on_forward(self, module: nn.Module) -> None:
        """Before a forward of the wrapped module: settle a failed pass, check the model, and
        broadcast the buffers if asked to."""
        self.discard_if_stale()
        self.guard.check()
        self.checked = True  # begin need not check again
        in_backward = current_autograd_node() is not None  # a recompute (checkpointing)
        if torch.is_grad_enabled() and not in_backward:
            self.steps.forwards += 1  # the step state (see _steps): no collective
        # Unlike DDP (which broadcasts before every forward), only a forward that will be followed
        # by a synchronised backward broadcasts, so an evaluation under torch.no_grad() on some
        # ranks only (or one inside no_sync) issues no collective, nor does a recompute.
        if (self.broadcast_buffers and self.require_sync and torch.is_grad_enabled()
                and not in_backward and self.failed is None):
            # From the lowest rank that contributed to the last step (rank 0 unless it joined).
            broadcast_tensors(self.comm, self.guard.buffers(), self.active[0])

    def discard_if_stale(self) -> None:
        """Abort a pass whose backward raised (see :meth:`abort`)."""
        # A backward pass that raised never runs its end-of-backward callback; the engine then
        # drops the callback, which is how we notice (the weak reference is dead).
        if self.epoch_active and self.token() is None:
            logger.warning("GradientReducer: the previous backward pass ended with an error; "
                           "discarding its partial reduction and sending the rest of its buckets "
                           "marked as failed, so that the other ranks' backward of that step "
                           "raises too")
            self.abort()

    # ------------------------------------------------------------------ backward
    def begin(self) -> None:
        """Start a pass (its first gradient hook): checks, then the end-of-backward callback.

        Raises:
            RuntimeError: an earlier pass failed; the model changed (see :class:`ModelGuard`).
            ValueError, CollectiveTimeoutError: the ranks' comm hooks differ, or their check
                timed out.
        """
        if self.failed is not None:
            raise RuntimeError(
                f"GradientReducer: an earlier backward pass failed ({brief(self.failed, 85)}); "
                "restart from a checkpoint with a new communicator and reducer"
            )
        if not self.hook.agreed:
            # register_comm_hook is a local call: before the first bucket is sent, every rank
            # checks that the others use the same hook (once per reducer).
            try:
                self.hook.agree(self.comm)
            except CollectiveTimeoutError as exc:
                self.mark_failed(f"checking the comm hook timed out: {exc}")
                what = "checking that every rank uses the same comm hook: "
                raise CollectiveTimeoutError(
                    what + brief(str(exc), MESSAGE_LIMIT - len(what))) from exc
        if not self.checked:
            self.guard.check()
        token = BackwardEnd(self)
        self.token = weakref.ref(token)
        self.epoch_active = True
        queue_engine_callback(token)

    def on_backward_end(self, token: BackwardEnd) -> None:
        """The end-of-backward callback: finish the pass (or wait for the outer backward)."""
        node = current_autograd_node()
        if node is not None:
            # End of a nested backward (reentrant checkpoint): run again when the outer node ends.
            handle: list[RemovableHandle] = []

            def requeue(*_: Any) -> None:
                handle[0].remove()
                queue_engine_callback(token)

            handle.append(node.register_hook(requeue))
            return
        if self.epoch_active:  # synchronize() may have finished it already
            self.finish()

    def launch_ready(self) -> None:
        """Launch, in index order, the buckets whose parameters are all ready (from the hooks)."""
        try:
            buckets = self.buckets
            while (self.next < self.hook_launch_limit
                   and buckets[self.next].pending == 0):  # the rest go at the end of backward
                self.launch(buckets[self.next])
                self.next += 1
        except BaseException as exc:
            if isinstance(exc, RuntimeError):  # the transport refused or failed a launch
                self.mark_failed(f"{type(exc).__name__}: {exc}")
            self.abort()
            raise

    def poll(self) -> None:
        """Note which in-flight collectives completed, in order; a failed one raises here."""
        while self.polled < self.next:
            b = self.buckets[self.polled]
            try:
                if b.work is None or not b.work.is_completed():
                    return
            except RuntimeError as exc:  # the transport failed (gloo: a peer closed or timed out)
                self.mark_failed(f"reducing {b.label()} failed: {exc}")
                raise
            self.polled += 1

    def mark_failed(self, why: str) -> None:
        """Refuse every later backward (see :meth:`begin`): after a collective failed or timed
        out on this rank, the ranks may disagree on which steps completed."""
        if self.failed is None:
            self.failed = why

    def launch(self, b: Bucket, grads: list[torch.Tensor | None] | None = None) -> None:
        """Stage what is missing (no gradient here: zeros) and send ``b`` (``grads``: see
        :func:`write_back`)."""
        if b.pending:  # flushed at the end of backward: large gradients not staged by a hook
            b.stage_missing(self.ready)
        b.stage_batched(grads)  # the small gradients, ready or not
        self.send(b, b.prepare(self.overlapping))

    def send(self, b: Bucket, grad_bucket: GradBucket) -> None:
        """Send bucket ``b`` (its buffer ``grad_bucket``): with the control values where it can
        carry them (see :class:`ControlCarrier`), else through the comm hook."""
        if not self.carrier.send(b, grad_bucket, self.hook.fn, self.hook.state, self.sink):
            self.hook.send(b, grad_bucket)

    def finish(self) -> None:
        """Launch the rest, wait for every bucket in order, and write the averages back.

        Raises:
            CollectiveTimeoutError: naming the bucket that timed out. RuntimeError: the transport
                failed, or another rank's backward of this step raised (nothing written back).
        """
        try:
            grads = None  # read once (after every hook) for the overlap check, sends, write-back
            if self.in_place or not self.view:  # view mode repoints every grad to its view
                grads = list(map(_grad_of, self.params))
                self.overlapping = overlapping_grads(grads, self._nbytes)
            control = self.control
            control.set_step(self.steps.value())  # before the last bucket, which may carry it
            while self.next < len(self.buckets):
                self.launch(self.buckets[self.next], grads)
                self.next += 1
            control.send()  # unless the last bucket carried it
            for b in self.buckets:
                assert b.work is not None  # every bucket was launched above
                self._wait(b.work, b.label())
            assert control.work is not None  # sent above
            self._wait(control.work, CONTROL_LABEL)
            failed_elsewhere = control.failed_elsewhere()
            out_of_step = None if failed_elsewhere else step_mismatch(control.steps())
            if not failed_elsewhere and out_of_step is None:
                write_back(self.buckets, self._spans, control, self.overlapping,
                           self.divide_by_initial_world_size, self.sink, grads)
        except BaseException as exc:
            if isinstance(exc, RuntimeError):  # a launch or a wait failed in the transport
                self.mark_failed(f"{type(exc).__name__}: {exc}")
            if self.epoch_active:
                self.abort()
            raise
        self._reset()
        observer = self.comm.profiler
        if observer is not None:
            observer.step()  # a profiled step ends when its backward's buckets are reduced
        if failed_elsewhere:
            raise RuntimeError(
                "GradientReducer: the backward pass of this step raised on another rank; no "
                "gradient of this step was written back; skip or redo this step alike on every "
                "rank"
            )
        if out_of_step is not None:
            raise RuntimeError(out_of_step)

    def _wait(self, work: Work, label: str) -> None:
        try:
            work.wait()
        except CollectiveTimeoutError as exc:
            self.mark_failed(f"reducing {label} timed out")
            self.abort(wait=False)
            what = f"reducing {label}: "
            raise CollectiveTimeoutError(
                what + brief(str(exc), MESSAGE_LIMIT - len(what))) from exc

    def _reset(self) -> None:
        control = self.control
        if control.work is not None and _succeeded(control.work):
            # Every rank reads the same sum, also for a step that raised: the buffer broadcast's
            # source (the lowest rank not joined) stays the same on every rank.
            steps = control.steps()
            if 0.0 in steps or len(self.active) != len(steps):
                self.active = active_ranks(steps) if 0.0 in steps else list(range(len(steps)))
        for b in self.buckets:
            b.reset()
        control.reset()
        self.ready = [False] * len(self.params)
        self.next = 0
        self.polled = 0
        self.epoch_active = False
        self.checked = False
        self.steps.forwards = 0

    def _send_rest_as_failed(self) -> None:
        """Send the buckets of this backward pass not sent yet and the control tensor, marked as
        failed (see :meth:`abort`): a rank that receives the mark raises instead of writing
        back."""
        try:
            with torch.no_grad():
                # Marked before the last bucket, which may carry the control values.
                if self.control.mark_failed():  # unless already sent (then it is too late)
                    self.control.set_step(self.steps.value())
                while self.next < len(self.buckets):
                    b = self.buckets[self.next]
                    if self.view:  # leave each .grad as every hook staging it would have
                        b.stage_ready(self.ready)
                    self.send(b, b.failed())
                    self.next += 1
                self.control.send()
        except Exception as exc:  # noqa: BLE001 - already failing; wait for what went out
            logger.warning("GradientReducer: sending the rest of a failed backward pass failed: "
                           "%s", exc)

    def abort(self, wait: bool = True) -> None:
        """End a pass that failed on this rank, so the next step starts clean on every rank."""
        # A backward pass that failed here (a user hook, a data-dependent error) may not have
        # failed on the other ranks: they wait for the buckets this rank has not sent yet. Send
        # them, and the control tensor marked as failed, so that the others' backward of this step
        # raises too instead of averaging partial gradients or pairing the next step's buckets
        # with these; then wait for what was sent, so the next step starts clean on every rank.
        # Not after a timeout or a transport failure, and not past the first failure: the buckets
        # behind a collective that timed out would each time out in turn (MPI cannot cancel
        # them), so a hang would take one full timeout per bucket in flight to surface instead
        # of one.
        failed_here = wait and self.failed is None
        if failed_here:
            self._send_rest_as_failed()
        if wait:
            works = [(b.work, b.label()) for b in self.buckets[: self.next]]
            works.append((self.control.work, CONTROL_LABEL))
            for work, label in works:
                if work is not None:
                    try:
                        work.wait()
                    except Exception as exc:  # noqa: BLE001 - already failing; keep the first
                        logger.warning("GradientReducer: %s failed while aborting: %s; not "
                                       "waiting for the buckets after it", label, exc)
                        break
        if failed_here and self.view:
            # The views are param.grad: what the pass's buckets hold now (partial sums of a failed
            # step) arrived after the error, perhaps after the caller's zero_grad(set_to_none=
            # False), and would be added to the next step's gradients. The step failed: zero them.
            for b in self.buckets:
                b.zero()
        self._reset()


# ----------------------------------------------------------------------------- autograd hooks
class BackwardEnd:
    """The end-of-backward callback of one backward pass (weakly referenced by its pass)."""

    __slots__ = ("__weakref__", "backward")

    def __init__(self, backward: BackwardPass) -> None:
        self.backward = backward

    def __call__(self) -> None:
        self.backward.on_backward_end(self)


#: How a parameter's gradient hook finds its backward pass (see :func:`on_grad_ready`).
PassRef = Callable[[], "BackwardPass | None"]


class StrongRef:
    """Called like a weak reference, but keeps the pass alive (see :func:`on_grad_ready`)."""

    __slots__ = ("_target",)

    def __init__(self, target: BackwardPass) -> None:
        self._target = target

    def __call__(self) -> BackwardPass:
        return self._target


def before_accumulate(ref: PassRef, grad: torch.Tensor) -> None:
    """Tensor hook (before accumulation) of a parameter-list reducer in view mode: send the rest
    of a failed backward pass before autograd adds the new gradient into a view (see the
    reducer's ``__init__``)."""
    bw = ref()
    if bw is not None and bw.epoch_active and bw.token() is None:
        bw.discard_if_stale()


def on_grad_ready(ref: PassRef, pid: int, param: torch.Tensor) -> None:
    """Post-accumulate-grad hook of parameter ``pid``: mark it ready (staging a large gradient;
    a small one is staged with its bucket, see ``SharedBucket.stage_batched``), launch ready
    buckets.

    ``ref()`` gives the backward pass: a weak reference when the reducer wraps a module (whose
    forward hook keeps the reducer, and so its pass, alive), because torch does not show a
    tensor's hooks to Python's garbage collector and a strong reference here would keep every
    reducer and module dropped without ``remove()`` alive for good; a :class:`StrongRef` when it
    was built from parameters (nothing else holds it). A function, not a method, so that the
    lookup costs no extra Python call on this path (it runs once per parameter per backward).
    """
    bw = ref()
    if bw is None or not bw.require_sync or bw.removed:
        return
    grad = param.grad
    if grad is not None and grad.layout is not torch.strided:
        raise dense_only(bw.names[pid], grad.layout)
    # Runs once per parameter per backward: the checks of discard_if_stale and poll are
    # inlined so that the common case calls nothing.
    if bw.epoch_active and bw.token() is None:
        bw.discard_if_stale()
    if not bw.epoch_active:
        bw.begin()
    bidx, slot = bw.loc[pid]
    bucket = bw.buckets[bidx]
    if bw.ready[pid]:
        if bucket.work is not None:
            bw.abort()
            raise RuntimeError(
                f"the gradient of {brief(bw.names[pid], 50)} was accumulated again after "
                f"{brief(bucket.label(), 40)} was sent; a parameter used inside and outside a "
                "reentrant checkpoint does this (use checkpoint(..., use_reentrant=False))"
            )
        if bucket.eager[slot]:  # accumulated again before the bucket left: copy again
            bucket.stage(slot)
        return
    bw.ready[pid] = True
    if bucket.eager[slot]:  # a small gradient is staged with its bucket, at the send
        bucket.stage(slot)
    bucket.pending -= 1
    if bw.overlap and bucket.pending == 0 and bidx == bw.next:
        bw.launch_ready()
    if bw.polled < bw.next:
        bw.poll()



def on_late_grad_ready(ref: PassRef, pid: int, param: torch.Tensor) -> None:
    """Post-accumulate-grad hook of a small gradient in a bucket that only the end of backward
    sends (see :func:`grad_hook_of`): once the pass has begun, only mark it ready -- that
    bucket's send stages it (checking that it is dense), and no hook launches it, so nothing
    counts its gradients. Otherwise (the pass's first gradient, or the first after a failed
    pass) as :func:`on_grad_ready`. The same checks, in fewer steps: one per parameter."""
    bw = ref()
    if bw is None or not bw.require_sync or bw.removed:
        return
    if not bw.epoch_active or bw.token() is None:
        on_grad_ready(ref, pid, param)
        return
    bw.ready[pid] = True
    if bw.polled < bw.next:
        bw.poll()


def grad_hook_of(bw: BackwardPass, pid: int) -> Callable[[PassRef, int, torch.Tensor], None]:
    """The gradient hook of parameter ``pid``: :func:`on_late_grad_ready` when its gradient is
    small (staged by its bucket's send) and its bucket is sent only at the end of backward, so
    that nothing needs to count it; else :func:`on_grad_ready`."""
    bidx, slot = bw.loc[pid]
    b = bw.buckets[bidx]
    late = not b.in_place and not b.eager[slot] and (
        not bw.overlap or bidx >= bw.hook_launch_limit)
    return on_late_grad_ready if late else on_grad_ready


def register_hooks(bw: BackwardPass, params: list[nn.Parameter], module: nn.Module | None,
                   on_forward: Callable[[nn.Module], None], view: bool) -> list[RemovableHandle]:
    """Register a reducer's hooks: :func:`grad_hook_of`'s on every parameter, and
    :class:`~gradcomm.hooks._autograd.ForwardPreHook` (calling ``on_forward``) on its module
    (without one, in view mode, :func:`before_accumulate` on every parameter); returns their
    handles."""
    ref: PassRef = StrongRef(bw) if module is None else weakref.ref(bw)
    handles = [p.register_post_accumulate_grad_hook(partial(grad_hook_of(bw, i), ref, i))
               for i, p in enumerate(params)]
    if module is not None:
        handles.append(module.register_forward_pre_hook(ForwardPreHook(on_forward)))
    elif view:
        # Without a module there is no forward hook to notice a failed backward before the
        # next one; in view mode autograd would then add the first new gradient into its view
        # before the reducer's hook sends the failed pass's rest and zeroes the views (with
        # zero_grad(set_to_none=False) the gradients are the views). A hook that runs before
        # accumulation notices it first.
        handles += [p.register_hook(partial(before_accumulate, ref)) for p in params]
    return handles

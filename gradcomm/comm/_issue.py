"""The one path every public collective takes from checked arguments to a backend hook.

:class:`IssuePath` is the base of :class:`~gradcomm.comm.Communicator` and of its collective
mixins (:mod:`~gradcomm.comm._shard_ops`, :mod:`~gradcomm.comm._rooted_ops`,
:mod:`~gradcomm.comm._object_ops`): a collective checks its arguments on every rank
(:mod:`~gradcomm.comm._validation`), then calls :meth:`IssuePath._issue`, which compares the
call across ranks where the debug level asks for it (:mod:`~gradcomm.comm._consistency`), tells
the profiler, starts the hook, copies a contiguous stand-in back into the caller's tensor on
completion, binds the :class:`~gradcomm.comm.Work` to the stall guard
(:mod:`~gradcomm.comm._stalls`) and waits unless ``async_op``.

The short path: the common call -- nothing closed, stalled, profiled or compared across ranks,
non-empty contiguous plain tensors on the communicator's device, of a dtype checked before --
passes every check and needs no copy, so a collective or transfer may call its hook and
:meth:`IssuePath._complete` directly once :meth:`IssuePath._fast_tail` and
:meth:`IssuePath._plain_tail` have vouched for its tensors and its own cheap checks (root, peer,
tag, sizes: :meth:`IssuePath._chunks_fit`) pass. Every other call takes
the general path, which raises what it raises. With a transport call of tens of microseconds
(MPI on 1 MiB) the ten or so nested checks of the general path are a visible share of the call.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import ClassVar, TypeGuard

import torch

from ._consistency import ConsistencyCheck, DebugLevel
from ._group import GroupMember
from ._stalls import StallGuard
from ._tensors import overlap
from ._validation import TensorChecks, TensorKind
from .observer import CollectiveObserver
from .types import Collective, ReduceOp, Support
from .work import DescriptionLike, Work

_TENSOR = torch.Tensor
_PARAMETER = torch.nn.Parameter

__all__ = ["IssuePath"]


class IssuePath(GroupMember):
    """Checks of state and tensors, and the issue of one collective (see the module docstring).

    The attributes are set by :class:`~gradcomm.comm.Communicator`'s constructor.
    """

    backend: ClassVar[str] = "abstract"
    native_reduce_ops: ClassVar[frozenset[ReduceOp]] = frozenset()
    profiler: CollectiveObserver | None
    _closed: bool
    _seq: itertools.count[int]
    _p2p_seq: itertools.count[int]
    _stalls: StallGuard
    _stall_note: Callable[[Work], None]
    _checks: TensorChecks
    _consistency: ConsistencyCheck
    _kinds: dict[tuple[torch.dtype, torch.device], TensorKind]
    _plain_kinds: dict[torch.dtype, str]  # TensorChecks.plain
    _on_cpu: bool  # the communicator's device is the CPU
    _cached_checks: bool  # world_size > 1, debug OFF, no backend tensor checks (DebugSetting)

    def _supports(self, dtype: torch.dtype, device: torch.device | str | None) -> Support:
        """The backend's answer for ``supports`` (``dtype`` is a torch.dtype)."""
        raise NotImplementedError  # pragma: no cover - Communicator declares it abstract

    def _supports_collective(self, collective: Collective, dtype: torch.dtype,
                             device: torch.device | None, base: Support) -> Support:
        """The backend's answer for ``supports(dtype, device, collective)``, given ``base`` (the
        dtype's reduction answer for reductions, NATIVE for data movement on the right device
        type). This default returns ``base``; a backend that emulates an op says so here."""
        return base

    def _check_tensor(self, tensor: object, opname: str, *, reduction: bool = True) -> str:
        """Raise on a tensor this communicator cannot take (:meth:`TensorChecks.check`); return
        its description tail. A backend with more conditions (one CUDA device) extends it."""
        return self._checks.check(tensor, opname, reduction=reduction)

    def _check_open(self) -> None:  # closed, or a timed-out collective still pending
        if self._closed:
            raise RuntimeError(f"{self.backend} communicator is closed")
        if self._stalls.stalled is not None:
            self._stalls.check()

    def _fast_tail(self, tensor: object, async_op: object) -> str | None:
        """``tensor``'s description tail when this call may take the short path (see the module
        docstring), else None: the communicator open, not stalled, unprofiled, at debug OFF,
        with more than one rank and only the base class's tensor checks, ``async_op`` a bool,
        and ``tensor`` as :meth:`_plain_tail` wants it."""
        if (self._cached_checks and async_op.__class__ is bool and self.profiler is None
                and not self._closed and self._stalls.stalled is None):
            return self._plain_tail(tensor)
        return None

    def _plain_tail(self, tensor: object) -> str | None:
        """``tensor``'s description tail if it is a plain ``torch.Tensor`` or ``Parameter`` (a
        subclass may answer ``device`` and the rest its own way: general path) on this
        communicator's device, non-empty, dense and contiguous, without a negative bit (``plain``
        returns it as it is), of a real dtype that :meth:`_check_tensor` passed before for every
        collective (reductions too); else None.

        Each torch attribute read costs about a microsecond when a large transfer has just left
        the caches cold, so the dtype is looked up alone and the device asked as ``is_cpu``."""
        cls = tensor.__class__
        if cls is _TENSOR or cls is _PARAMETER:
            t: torch.Tensor = tensor  # type: ignore[assignment]  # narrowed by the class test
            tail = self._plain_kinds.get(t.dtype)
            if (tail is not None and (t.is_cpu if self._on_cpu else t.device == self._device)
                    and t.layout is torch.strided and t.is_contiguous() and not t.is_neg()
                    and t.numel()):
                return tail
        return None

    def _chunks_fit(self, buffer: object, chunk: torch.Tensor) -> TypeGuard[torch.Tensor]:
        """Whether ``buffer`` may take the short path as the buffer of ``world_size`` chunks of
        ``chunk`` (all_gather's output, reduce_scatter's input, the root's buffer of gather and
        scatter): a tensor of ``chunk``'s dtype, ``world_size`` times its elements, apart from it
        in memory. The caller has vouched for both with :meth:`_plain_tail`."""
        return (isinstance(buffer, torch.Tensor) and buffer.dtype is chunk.dtype
                and buffer.numel() == self._world_size * chunk.numel()
                and not overlap(buffer, chunk))

    def _plain_op(self, op: object) -> TypeGuard[ReduceOp]:
        """Whether ``op`` is a ReduceOp other than AVG that the transport runs itself (AVG is
        checked against the dtype and may be emulated: general path)."""
        return (op is ReduceOp.SUM
                or (op.__class__ is ReduceOp and op is not ReduceOp.AVG)) and (
            op in self.native_reduce_ops)

    def _issue(self, opname: str, hook: Callable[..., Work], args: tuple[object, ...],
               description: DescriptionLike, target: torch.Tensor | None,
               buf: torch.Tensor | None, label: str | None, async_op: bool) -> Work:
        """Check it across ranks (:attr:`debug`), start ``hook(*args, description)`` on ``buf``,
        profiled; copy back into ``target``."""
        consistency = self._consistency
        if consistency.level is not DebugLevel.OFF and consistency.wants(opname):
            consistency.check(opname, description, buf)
        profiler = self.profiler
        done = (None if profiler is None
                else profiler.collective_started(opname, buf, label, async_op))
        work = hook(*args, description)
        if done is not None:
            work.add_callback(done)
        if buf is not target and buf is not None and target is not None:
            dst, src = target, buf
            work.add_callback(lambda: dst.copy_(src))
        return self._complete(work, async_op, target)

    def _complete(self, work: Work, async_op: bool, target: torch.Tensor | None) -> Work:
        """Bind ``work`` to ``target`` and the stall guard (see Work.bind); wait unless async."""
        work.bind(target, self._stall_note)
        if not async_op:
            work.wait()
        return work

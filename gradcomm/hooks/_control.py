"""The reducer's control tensor: what ranks must agree on besides the gradients, in one collective.

Comm hooks see only gradients (``GradBucket.buffer()`` is exactly a bucket's flat gradients), so the
reducer's own state travels in a small tensor of its own, summed once per synchronised backward
pass after the last bucket: by an all-reduce of its own, or -- with the default ``"allreduce"``
hook, a float32 or float64 last bucket and 2 ranks -- as extra elements of the last bucket's
all-reduce (:meth:`ControlTensor.send_in`), so that a step sends no more collectives than DDP's
reducer:

* one presence flag per reduced parameter, in bucket order (1 where this rank has a gradient for
  it): a parameter whose flags sum to 0 had no gradient on any rank and keeps ``grad=None``;
* the failure signal: the number of ranks whose backward pass of this step raised. A rank whose
  backward failed sends the rest of its buckets (their contents do not matter) and this tensor with
  its failure slot set, so the other ranks raise instead of writing back;
* one step slot per rank (see :mod:`._steps`): rank ``r`` writes its step value into slot ``r``
  and leaves the others 0, so the sum gives every rank's value -- the number of forwards with
  gradients enabled since the last reduced backward, plus 1; 0 for a rank that has joined
  (:meth:`~gradcomm.hooks.GradientReducer.join`) and only shadows the others' collectives.

float32, which every transport reduces natively and which counts ranks and forwards exactly (up to
2**24), on the communicator's device.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ..comm.communicator import Communicator
from ..comm.types import ReduceOp
from ..comm.work import Work
from ._buckets import Bucket, SharedBucket
from .comm_hooks import GradBucket, allreduce_hook

# Bucket dtypes that can carry the control values (small counts, exact in either).
_CARRIER_DTYPES = (torch.float32, torch.float64)

__all__ = ["ControlCarrier", "ControlTensor", "CONTROL_LABEL"]

CONTROL_LABEL = "control tensor (presence flags, failure signal, step state)"


class ControlTensor:
    """The per-backward control tensor of a reducer (see the module).

    Args:
        comm: the communicator it is summed over; the tensor lives on ``comm.device``.
        counts: the number of parameters of each bucket, in bucket order.

    ``flags[k]`` is bucket ``k``'s view of its presence flags (1-D float32, ``counts[k]``
    elements), which the bucket fills before it is sent.
    """

    def __init__(self, comm: Communicator, counts: list[int]) -> None:
        self.comm = comm
        n = sum(counts)
        self._failed_slot = n
        self._steps_at = n + 1
        self._step_slot = n + 1 + comm.rank
        self.tensor = torch.zeros(n + 1 + comm.world_size, dtype=torch.float32,
                                  device=comm.device)
        self.flags: list[torch.Tensor] = []
        offset = 0
        for c in counts:
            self.flags.append(self.tensor[offset : offset + c])
            offset += c
        self.work: Work | None = None
        self._summed: list[float] | None = None
        self._source = self.tensor  # where the sum lands (see send_in)

    def mark_failed(self) -> bool:
        """Set this rank's failure signal; False when the tensor was already sent (too late)."""
        if self.work is not None:
            return False
        self.tensor[self._failed_slot] = 1.0
        return True

    def set_step(self, value: float) -> None:
        """Write this rank's step value (see the module) before :meth:`send`."""
        self.tensor[self._step_slot] = value

    def send(self) -> None:
        """Post the all-reduce (SUM), once per backward pass."""
        if self.work is None:
            self.work = self.comm.all_reduce(self.tensor, ReduceOp.SUM, async_op=True,
                                             label=CONTROL_LABEL)

    def send_in(self, tail: torch.Tensor, start: Callable[[], Work]) -> Work:
        """Post the sum as part of a bucket's all-reduce instead of one of its own.

        Copies the values into ``tail`` (as many elements as :attr:`tensor`, float32 or float64,
        which count exactly up to 2**24; right after the bucket's gradients), calls ``start`` to
        post the all-reduce (SUM) of both, and reads the sum back from ``tail``. Once per
        backward pass, instead of :meth:`send`; returns the Work, which becomes :attr:`work`.
        """
        tail.copy_(self.tensor)
        self.work = start()
        self._source = tail
        return self.work

    def summed(self) -> list[float]:
        """The summed tensor as floats (one device-to-host copy), after :attr:`work` completed."""
        if self._summed is None:
            self._summed = self._source.tolist()
        return self._summed

    def failed_elsewhere(self) -> bool:
        """Whether some rank sent this step as failed (after :attr:`work` completed)."""
        return self.summed()[self._failed_slot] != 0.0

    def steps(self) -> list[float]:
        """Every rank's step value, in rank order (after :attr:`work` completed)."""
        return self.summed()[self._steps_at :]

    def reset(self) -> None:
        """Forget this backward pass: no work in flight, the failure and step slots 0 again
        (they hold the last sum). The presence flags are rewritten by every launch."""
        self.tensor[self._failed_slot :] = 0.0
        self.work = None
        self._summed = None
        self._source = self.tensor


class ControlCarrier:
    """The last bucket, when its all-reduce can carry the control values (see the module).

    Chosen once: a shared (not in-place) float32 or float64 bucket on ``comm.device``, and at most
    2 ranks. There every transport adds the two ranks' values alike whatever the length (a + b
    == b + a, bit for bit); with more, ring and reduce-scatter algorithms split the buffer by its
    length, and a longer one would regroup some gradients' additions (last-bit differences from
    the same model reduced without the control values). The bucket gets a tail for them.
    """

    def __init__(self, comm: Communicator, buckets: list[Bucket], control: ControlTensor) -> None:
        self.comm = comm
        self.control = control
        last = buckets[-1] if buckets else None
        self.bucket: SharedBucket | None = None
        self.label = ""
        if (isinstance(last, SharedBucket) and last.dtype in _CARRIER_DTYPES
                and last.device == comm.device and comm.world_size <= 2):
            last.set_tail(control.tensor.numel())
            self.bucket = last
            assert last.grad_bucket is not None  # made with the buffer
            self.label = f"{last.grad_bucket.label()} with the control values"

    def send(self, b: Bucket, grad_bucket: GradBucket, hook: object, state: object,
             sink: object) -> bool:
        """Send bucket ``b`` (its buffer ``grad_bucket``) with the control values, whose values
        must be final (step set, failure marked), and return True -- when ``b`` is the carrier,
        the comm hook the default all-reduce on the reducer's communicator and nothing pads the
        buffer (no ``sink``: a reduce-scatter of stage 2 has its own hook). Else send nothing and
        return False: the caller sends ``b`` through the hook, the control values alone."""
        carrier = self.bucket
        if (b is not carrier or hook is not allreduce_hook or state is not self.comm
                or carrier.wire is None or sink is not None):
            return False
        wire, label = carrier.wire, self.label
        carrier.grad_bucket = grad_bucket
        carrier.work = self.control.send_in(carrier.tail, lambda: self.comm.all_reduce(
            wire, ReduceOp.SUM, async_op=True, label=label))
        return True

"""The reducer's control tensor: what ranks must agree on besides the gradients, in one collective.

Comm hooks see only gradients (``GradBucket.buffer()`` is exactly a bucket's flat gradients), so the
reducer's own state travels in a small tensor of its own, summed by one all-reduce per synchronised
backward pass, posted after the last bucket:

* one presence flag per reduced parameter, in bucket order (1 where this rank has a gradient for
  it): a parameter whose flags sum to 0 had no gradient on any rank and keeps ``grad=None``;
* the failure signal: the number of ranks whose backward pass of this step raised. A rank whose
  backward failed sends the rest of its buckets (their contents do not matter) and this tensor with
  its failure slot set, so the other ranks raise instead of writing back;
* one slot reserved for a step-consistency value (always 0 for now), so that adding one later does
  not change the layout ranks exchange.

float32, which every transport reduces natively and which counts ranks exactly (up to 2**24), on
the communicator's device.
"""

from __future__ import annotations

import torch

from ..comm.communicator import Communicator
from ..comm.types import ReduceOp
from ..comm.work import Work

__all__ = ["ControlTensor", "CONTROL_LABEL"]

CONTROL_LABEL = "control tensor (presence flags, failure signal)"


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
        self.tensor = torch.zeros(n + 2, dtype=torch.float32, device=comm.device)
        self.flags: list[torch.Tensor] = []
        offset = 0
        for c in counts:
            self.flags.append(self.tensor[offset : offset + c])
            offset += c
        self.work: Work | None = None
        self._summed: list[float] | None = None

    def mark_failed(self) -> bool:
        """Set this rank's failure signal; False when the tensor was already sent (too late)."""
        if self.work is not None:
            return False
        self.tensor[self._failed_slot] = 1.0
        return True

    def send(self) -> None:
        """Post the all-reduce (SUM), once per backward pass."""
        if self.work is None:
            self.work = self.comm.all_reduce(self.tensor, ReduceOp.SUM, async_op=True,
                                             label=CONTROL_LABEL)

    def summed(self) -> list[float]:
        """The summed tensor as floats (one device-to-host copy), after :attr:`work` completed."""
        if self._summed is None:
            self._summed = self.tensor.tolist()
        return self._summed

    def failed_elsewhere(self) -> bool:
        """Whether some rank sent this step as failed (after :attr:`work` completed)."""
        return self.summed()[self._failed_slot] != 0.0

    def reset(self) -> None:
        """Forget this backward pass: no work in flight, the failure and reserved slots 0 again
        (they hold the last sum). The presence flags are rewritten by every launch."""
        self.tensor[self._failed_slot :] = 0.0
        self.work = None
        self._summed = None

"""Step consistency: each rank's step state, carried in the control tensor, and the check on it.

A rank that skipped a backward the others ran (a loss that was NaN on that rank only) sends its
next backward's buckets against the others' current ones: counting backward passes cannot see it,
since that rank's next backward pairs with the others' next. What differs is the number of
forwards of the wrapped module run with gradients enabled since the last reduced backward: the
skipping rank ran one more. Each rank counts them in the reducer's forward pre-hook (a forward
recomputed inside backward, by activation checkpointing, is not counted; nor is a forward under
``torch.no_grad()``, so evaluating on some ranks only is fine) and sends the count in its slot of
the control tensor (:mod:`._control`), which every synchronised backward all-reduces anyway: the
check costs no collective. When the active ranks' counts differ, every rank sees the same sums
and raises the same RuntimeError before anything is written back.

The same slot says whether a rank has joined (:meth:`~gradcomm.hooks.GradientReducer.join`):
joined ranks send 0 and are left out of the check and of the divisor of the average.

A reducer built from parameters has no forward hook: its ranks send equal values and the check
sees nothing (documented in docs/failures.md).
"""

from __future__ import annotations

from ..comm.errors import MESSAGE_LIMIT, brief

__all__ = ["StepState", "active_ranks", "step_mismatch"]


class StepState:
    """This rank's step state: forwards with gradients enabled since the last reduced backward.

    Args:
        enabled: the reducer's ``step_check`` option; False sends a constant (no check).
    """

    __slots__ = ("enabled", "forwards", "joined")

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self.forwards = 0
        self.joined = False

    def value(self) -> float:
        """What this rank writes into its step slot: 0 when joined, else forwards + 1."""
        if self.joined:
            return 0.0
        return float(self.forwards + 1) if self.enabled else 1.0


def active_ranks(steps: list[float]) -> list[int]:
    """The ranks that contributed gradients to a reduced backward (step value not 0)."""
    return [r for r, v in enumerate(steps) if v != 0.0]


def step_mismatch(steps: list[float]) -> str | None:
    """The error message when the active ranks' step values differ, else None.

    ``steps`` is every rank's value (see :class:`StepState`). The message names each distinct
    count and the ranks that had it (most common count first), within the message limit.
    """
    values = set(steps)  # C speed: this runs at every synchronised backward
    values.discard(0.0)
    if len(values) <= 1:
        return None
    by_value: dict[float, list[int]] = {}
    for r, v in enumerate(steps):
        if v != 0.0:
            by_value.setdefault(v, []).append(r)
    if len(by_value) <= 1:
        return None
    groups = sorted(by_value.items(), key=lambda kv: (-len(kv[1]), kv[0]))
    parts = []
    for v, ranks in groups:
        shown = ", ".join(map(str, ranks[:4])) + (f" +{len(ranks) - 4}" if len(ranks) > 4 else "")
        parts.append(f"{int(v) - 1} on rank{'s' if len(ranks) > 1 else ''} {shown}")
    head = "GradientReducer: ranks out of step (forwards with grad since the last synced backward: "
    tail = "): a rank skipped a backward; nothing written back (docs/failures.md)"
    counts = brief("; ".join(parts), MESSAGE_LIMIT - len(head) - len(tail))
    return head + counts + tail

"""Refusing new collectives while one whose wait timed out is still pending.

No transport can cancel a started collective, and one issued behind a stalled one would wait for
it, so a :class:`~gradcomm.comm.Communicator` refuses every new collective while the stalled one
is pending. A late peer that catches up completes it and makes the communicator usable again; a
stalled collective that then fails leaves it unusable for good.
"""

from __future__ import annotations

from .errors import brief
from .work import Work

__all__ = ["StallGuard"]


class StallGuard:
    """The timed-out collective of one communicator, if any.

    Args:
        backend: the communicator's backend name, for error messages.

    A communicator hands :meth:`note` to each :class:`~gradcomm.comm.Work` it returns (see
    :meth:`Work.bind`) and calls :meth:`check` before each new collective while :attr:`stalled`
    is set.
    """

    __slots__ = ("_backend", "stalled")

    def __init__(self, backend: str) -> None:
        self._backend = backend
        #: The first collective whose wait timed out and that has not completed since (or None).
        self.stalled: Work | None = None

    def note(self, work: Work) -> None:
        """Called by ``work`` when a wait on it times out."""
        if self.stalled is None:
            self.stalled = work

    def check(self) -> None:
        """Forget the stalled collective once it has completed (running its callbacks).

        Raises:
            RuntimeError: it is still pending, or it failed after timing out.
        """
        stalled = self.stalled
        if stalled is None:
            return
        try:
            done = stalled.is_completed()
        except RuntimeError as exc:
            raise RuntimeError(
                f"{self._backend} communicator is unusable: {stalled.description}, which timed "
                f"out, then failed: {exc}"
            ) from exc
        if not done:
            raise RuntimeError(
                f"{self._backend} communicator is unusable while "
                f"{brief(str(stalled.description), 70)}, which timed out, is still pending; "
                "wait() on its Work again"
            )
        self.stalled = None

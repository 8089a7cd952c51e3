"""Exceptions and warnings raised by gradcomm's communication layer."""

from __future__ import annotations

__all__ = ["CollectiveTimeoutError", "SlowPathWarning", "BackendUnavailableError"]


class CollectiveTimeoutError(RuntimeError):
    """A collective did not complete within the communicator's timeout.

    Usually another rank died, stopped calling collectives, or issued a different sequence of them.
    The message names the operation (and the bucket, when raised by the gradient hook manager).
    """


class BackendUnavailableError(RuntimeError):
    """A known backend was selected, but this machine cannot run it (no CUDA device, no NCCL).

    A missing Python package raises :class:`ImportError` instead, naming the pip command.
    """


class SlowPathWarning(UserWarning):
    """A collective took a slow path (e.g. fp16 over gloo or MPI); filter it with :mod:`warnings`.

    Issued once per (backend, dtype, device).
    """


#: Longest error message gradcomm raises; the longer explanations are in docs/failures.md.
MESSAGE_LIMIT = 200


def brief(text: str, width: int) -> str:
    """``text`` cut to at most ``width`` characters, so a message that quotes another (a name, a
    transport's error) stays within :data:`MESSAGE_LIMIT`. The middle goes: a name's start and
    end, and a quoted error's subject and verdict ("... did not complete within 2.0 s"), stay."""
    if len(text) <= width:
        return text
    if width < 8:
        return text[: max(width - 3, 0)] + "..."
    head = (width - 3) // 2
    return text[:head] + "..." + text[len(text) - (width - 3 - head):]

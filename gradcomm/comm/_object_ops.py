"""Collectives on picklable Python objects: ``broadcast_object`` and ``all_gather_object``.

A mixin of :class:`~gradcomm.comm.Communicator`, as torch.distributed's ``broadcast_object_list``
and ``all_gather_object``: each object is pickled into a uint8 tensor on the communicator's
device, the sizes are exchanged first, then the bytes (all_gather pads every rank's bytes to the
largest). Both are built on :meth:`broadcast` and :meth:`all_gather`, so they take the common path
(checks, profiler, timeout). A rank whose object cannot be pickled tells the others through the
size exchange (size -1), so every rank raises instead of waiting. Unpickling runs code chosen by
the sender: use these only among ranks of one job, as with torch.distributed.
"""

from __future__ import annotations

import pickle
from typing import TYPE_CHECKING

import torch

from ._issue import IssuePath
from ._validation import check_rank_arg

if TYPE_CHECKING:  # pragma: no cover
    from .work import Work

__all__ = ["ObjectOps"]


def _pickled(obj: object) -> tuple[bytes, str]:
    """``obj``'s pickle and no error, or no bytes and the error's text."""
    try:
        return pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL), ""
    except Exception as exc:  # noqa: BLE001 - every rank must learn of the failure
        return b"", f"{type(exc).__name__}: {exc}"[:120]


class ObjectOps(IssuePath):
    """``broadcast_object`` and ``all_gather_object`` (see the module docstring)."""

    if TYPE_CHECKING:  # Communicator's collectives
        def broadcast(self, tensor: torch.Tensor, src: int = 0, *,
                      async_op: bool = False) -> Work: ...
        def all_gather(self, output: torch.Tensor, input: torch.Tensor, *,
                       async_op: bool = False) -> Work: ...

    def broadcast_object(self, obj: object, src: int = 0) -> object:
        """Return rank ``src``'s ``obj`` on every rank (``obj`` is ignored on the others).

        Raises:
            TypeError: ``src`` not an int; on every rank, ``src``'s object cannot be pickled
                (the message names its error).
            ValueError: ``src`` out of range.
            RuntimeError: the communicator is closed.
            CollectiveTimeoutError: a rank did not take part within the timeout.
        """
        check_rank_arg("src", src, self._world_size)
        self._check_open()
        if self._world_size == 1:
            data, error = _pickled(obj)
            if error:
                raise TypeError(f"broadcast_object: rank {src}'s object cannot be pickled: {error}")
            return pickle.loads(data)
        data, error = _pickled(obj) if self._rank == src else (b"", "")
        size = torch.tensor([-1 if error else len(data)], dtype=torch.int64, device=self._device)
        self.broadcast(size, src)
        n = int(size.item())
        if n < 0:
            why = f": {error}" if error else ""
            raise TypeError(f"broadcast_object: rank {src}'s object cannot be pickled{why}")
        payload = (torch.frombuffer(bytearray(data), dtype=torch.uint8).to(self._device)
                   if self._rank == src else torch.empty(n, dtype=torch.uint8, device=self._device))
        self.broadcast(payload, src)
        return obj if self._rank == src else pickle.loads(payload.cpu().numpy().tobytes())

    def all_gather_object(self, obj: object) -> list[object]:
        """Return every rank's ``obj``, in rank order (this rank's is a copy, via pickle).

        Raises:
            TypeError: on every rank, some rank's object cannot be pickled (the message names
                the first such rank).
            RuntimeError: the communicator is closed; a rank's size exchange shows that it
                called another collective (seen when what it sent is not a size).
            CollectiveTimeoutError: a rank did not take part within the timeout.
        """
        self._check_open()
        w = self._world_size
        data, error = _pickled(obj)
        mine = torch.tensor([-1 if error else len(data)], dtype=torch.int64, device=self._device)
        sizes = torch.empty(w, dtype=torch.int64, device=self._device)
        self.all_gather(sizes, mine)
        counts = [int(n) for n in sizes.tolist()]
        if min(counts) < 0:
            bad = next(r for r, n in enumerate(counts) if n < 0)
            if counts[bad] != -1:  # not a size: that rank called another collective
                raise RuntimeError(f"all_gather_object: rank {bad} sent no object size; ranks "
                                   "called different collectives (GRADCOMM_DEBUG=detail names it)")
            why = f": {error}" if error else ""
            raise TypeError(f"all_gather_object: rank {bad}'s object cannot be pickled{why}")
        width = max(counts)
        padded = torch.zeros(width, dtype=torch.uint8)
        if data:
            padded[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        out = torch.empty(w * width, dtype=torch.uint8, device=self._device)
        self.all_gather(out, padded.to(self._device))
        raw = out.cpu().numpy().tobytes()
        return [pickle.loads(raw[r * width:r * width + n]) for r, n in enumerate(counts)]

"""Views of tensors' memory that transports can read and write as it lies.

A :class:`~gradcomm.comm.Communicator` hands its backend hooks contiguous tensors only: a tensor
whose memory a transport cannot use directly goes as a contiguous copy (:func:`plain`) that is
written back on completion.
"""

from __future__ import annotations

import torch

from ._validation import check_writable

__all__ = ["flat", "flat_bytes", "plain", "overlap"]


def flat(tensor: torch.Tensor) -> torch.Tensor:
    """A contiguous ``tensor`` as 1-D (``(numel,)``, no copy): itself when already 1-D.

    ``view(-1)`` makes a new tensor object, about a microsecond, which a collective on a small
    or medium buffer pays on every call; a 1-D tensor needs none.
    """
    return tensor if tensor.dim() == 1 else tensor.view(-1)


def flat_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """The memory of a contiguous ``tensor`` as a 1-D uint8 view (no copy).

    Shape ``(tensor.numel() * tensor.element_size(),)``. A one-element tensor counts as contiguous
    whatever its stride (``torch.zeros(2)[::2]`` has stride 2), which ``Tensor.view(torch.uint8)``
    rejects, so it is viewed with stride 1 first (the same single element).
    """
    flat = tensor if tensor.dim() == 1 else tensor.reshape(-1)  # each new tensor costs ~1 us
    if flat.numel() == 1 and flat.stride(0) != 1:
        flat = flat.as_strided((1,), (1,))
    return flat if flat.dtype is torch.uint8 else flat.view(torch.uint8)


def plain(tensor: torch.Tensor, written_by: str | None = None) -> torch.Tensor:
    """``tensor`` itself when a transport can use its memory as it is; else a contiguous copy.

    A copy is made for non-contiguous tensors and for the lazy negative and conjugate views
    (``t.conj().imag``, ``torch.Tensor.conj()``), which keep their sign in a bit of the tensor,
    not in memory: a transport reading raw memory would reduce the wrong values (MIN and MAX
    swapped). Callers copy the result back into ``tensor``, which honours the bits.

    Raises:
        ValueError: from :func:`~gradcomm.comm._validation.check_writable` when ``written_by``
            (the collective's name) is given, i.e. the result will be written into ``tensor``.
    """
    if tensor.is_contiguous() and not tensor.is_neg() and not tensor.is_conj():
        return tensor
    if written_by is not None:
        check_writable(tensor, written_by)
    return tensor.resolve_conj().resolve_neg().contiguous()


def overlap(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether the memory of two contiguous tensors overlaps (by address, so also for separate
    storages over one buffer, e.g. two ``torch.from_numpy`` views of one array)."""
    a0, b0 = a.data_ptr(), b.data_ptr()
    return a0 < b0 + b.nbytes and b0 < a0 + a.nbytes

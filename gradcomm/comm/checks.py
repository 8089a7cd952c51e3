"""Argument checks of the collectives, run on every rank before any transport call, and the
views of tensors' memory that transports use.

Every rank runs the same checks on the same kind of arguments, so bad input raises the same error
everywhere instead of leaving the other ranks waiting in a collective. :class:`TensorChecks`
caches its verdict per (dtype, device), so the checks of a collective's tensor cost one dict
lookup once its kind has been seen.

A :class:`~gradcomm.comm.Communicator` hands its backend hooks contiguous tensors only: a tensor
whose memory a transport cannot use directly goes as a contiguous copy (:func:`plain`) that is
written back on completion.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from .errors import brief
from .types import ReduceOp, Support

__all__ = [
    "TensorKind",
    "TensorChecks",
    "check_call_args",
    "check_writable",
    "check_supports_args",
    "check_avg",
    "check_src",
    "check_all_gather",
    "check_same_dtype",
    "check_reduce_scatter",
    "check_rank_arg",
    "check_splits",
    "displacements",
    "flat",
    "flat_bytes",
    "plain",
    "overlap",
]

#: The verdict on one (dtype, device): the error class to raise for it (None: none), the reason,
#: and the tail of the descriptions of collectives on it (dtype, device and group).
TensorKind = tuple[type[Exception] | None, str, str]


def check_call_args(async_op: object, label: object = None) -> None:
    """TypeError unless ``async_op`` is a bool and ``label`` a str or None (a truthy string such as
    ``"no"`` would otherwise silently make the call asynchronous)."""
    if async_op.__class__ is not bool:
        kind = type(async_op)  # numpy.bool prints as "bool": name its module too
        name = (kind.__name__ if kind.__module__ == "builtins"
                else f"{kind.__module__}.{kind.__name__}")
        raise TypeError(f"async_op must be a Python bool (True or False), got {name} {async_op!r}")
    if label is not None and not isinstance(label, str):
        raise TypeError(f"label must be a str or None, got {type(label).__name__}")


def check_writable(tensor: torch.Tensor, opname: str) -> None:
    """Raise ValueError if some elements of ``tensor`` share one memory location (an
    ``expand()``-ed view, stride 0): a collective's result cannot be written into it (``copy_``
    would refuse after the transfer), so it is refused before, at every world size."""
    if tensor.numel() and not tensor.is_contiguous() and any(
        st == 0 and n > 1 for n, st in zip(tensor.shape, tensor.stride(), strict=True)
    ):
        raise ValueError(
            f"{opname}: the tensor has several elements at one memory location (stride 0, e.g. "
            f"from expand(); shape {tuple(tensor.shape)}, stride {tensor.stride()}); pass a "
            ".clone()"
        )


def check_supports_args(dtype: object, device: object) -> torch.device | None:
    """The arguments of :meth:`~gradcomm.comm.Communicator.supports`, checked; ``device`` as a
    :class:`torch.device` (None stays None).

    Raises:
        TypeError: ``dtype`` is not a torch.dtype, or ``device`` not None, a str or a device.
        ValueError: ``device`` is a string torch does not know.
    """
    if not isinstance(dtype, torch.dtype):
        raise TypeError(f"supports() takes a torch.dtype, got {type(dtype).__name__} "
                        f"{dtype!r} (e.g. torch.float32)")
    if device is None or isinstance(device, torch.device):
        return device
    if not isinstance(device, str):
        raise TypeError(f"supports() takes a device as a str or torch.device, got "
                        f"{type(device).__name__} {device!r}")
    try:
        return torch.device(device)
    except RuntimeError as exc:  # torch's message lists the device types it knows
        raise ValueError(f"device {brief(repr(device), 40)} is not a torch device: "
                         f"{brief(str(exc), 110)}") from None


def check_avg(tensor: torch.Tensor, op: ReduceOp) -> None:
    """TypeError for ``ReduceOp.AVG`` on a tensor that is neither floating point nor complex."""
    if op is ReduceOp.AVG and not (tensor.is_floating_point() or tensor.is_complex()):
        raise TypeError(
            f"ReduceOp.AVG needs a floating-point tensor, got {tensor.dtype}; "
            "use ReduceOp.SUM and divide, or cast first"
        )


def check_src(src: object, world_size: int) -> None:
    """TypeError unless ``src`` is an int (not a bool); ValueError unless it is a rank."""
    if isinstance(src, bool) or not isinstance(src, int):
        raise TypeError(f"src must be an int rank, got {type(src).__name__}")
    if not 0 <= src < world_size:
        raise ValueError(f"src must be in [0, {world_size}), got {src}")


def check_all_gather(output: torch.Tensor, input: torch.Tensor, world_size: int) -> None:
    """TypeError if the dtypes differ; ValueError unless ``output`` holds ``world_size`` inputs."""
    if output.dtype != input.dtype:
        raise TypeError(f"all_gather output dtype {output.dtype} != input dtype {input.dtype}")
    if output.numel() != world_size * input.numel():
        raise ValueError(
            f"all_gather output must hold world_size * input.numel() = "
            f"{world_size} * {input.numel()} elements, got {output.numel()}"
        )


def check_same_dtype(opname: str, output: torch.Tensor, input: torch.Tensor) -> None:
    """TypeError if ``output`` and ``input`` differ in dtype."""
    if output.dtype != input.dtype:
        raise TypeError(f"{opname} output dtype {output.dtype} != input dtype {input.dtype}")


def check_reduce_scatter(output: torch.Tensor, input: torch.Tensor, world_size: int) -> None:
    """TypeError if the dtypes differ; ValueError unless ``input`` holds ``world_size`` outputs."""
    check_same_dtype("reduce_scatter", output, input)
    if input.numel() != world_size * output.numel():
        raise ValueError(
            f"reduce_scatter input must hold world_size * output.numel() = "
            f"{world_size} * {output.numel()} elements, got {input.numel()}"
        )


def check_rank_arg(name: str, value: object, world_size: int) -> int:
    """TypeError unless ``value`` is an int (not a bool); ValueError unless it is a rank."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int rank, got {type(value).__name__}")
    if not 0 <= value < world_size:
        raise ValueError(f"{name} must be in [0, {world_size}), got {value}")
    return value


def check_splits(opname: str, name: str, splits: object, tensor: torch.Tensor,
                 world_size: int) -> list[int]:
    """The rows (dim 0 slices) of ``tensor`` per rank: ``splits`` checked, or equal splits.

    Raises:
        TypeError: ``splits`` is not None or a sequence of ints.
        ValueError: ``tensor`` is 0-d; ``splits`` has not ``world_size`` entries, has a negative
            one, or does not sum to ``tensor.shape[0]``; with ``splits`` None, ``tensor.shape[0]``
            is not a multiple of ``world_size``.
    """
    if tensor.dim() == 0:
        raise ValueError(f"{opname}: {name} needs a tensor with a first dimension, got 0-d")
    rows = tensor.shape[0]
    if splits is None:
        if rows % world_size:
            raise ValueError(f"{opname}: {name} is None, so dim 0 ({rows}) must divide into "
                             f"world_size={world_size} equal parts")
        return [rows // world_size] * world_size
    if isinstance(splits, torch.Tensor):
        splits = splits.tolist()
    if not isinstance(splits, (list, tuple)) or any(
        isinstance(n, bool) or not isinstance(n, int) for n in splits
    ):
        raise TypeError(f"{opname}: {name} must be None or a sequence of ints")
    if len(splits) != world_size:
        raise ValueError(f"{opname}: {name} needs world_size={world_size} entries, got "
                         f"{len(splits)}")
    if min(splits) < 0 or sum(splits) != rows:
        raise ValueError(f"{opname}: {name} {list(splits)} must be >= 0 and sum to dim 0 of "
                         f"its tensor ({rows})")
    return list(splits)


class TensorChecks:
    """The checks of one communicator's tensors, cached per (dtype, device).

    Args:
        backend: the backend's name, for messages and descriptions.
        device: the communicator's device (tensors must be of its device type).
        group: ``"rank r/w"``, for descriptions.
        supports: the backend's :meth:`~gradcomm.comm.Communicator._supports`, asked once per
            (dtype, device) whether reductions of it are possible.
        exact_device: tensors must be on ``device`` itself, not just of its type (NCCL: one GPU
            per communicator).
    """

    __slots__ = ("_backend", "_cpu_kinds", "_device", "_exact", "_group", "_supports", "kinds")

    def __init__(
        self,
        backend: str,
        device: torch.device,
        group: str,
        supports: Callable[[torch.dtype, torch.device], Support],
        exact_device: bool = False,
    ) -> None:
        self._backend = backend
        self._device = device
        self._exact = exact_device
        self._group = group
        self._supports = supports
        #: The verdicts so far: a hit costs one dict lookup. CPU tensors' are keyed by dtype
        #: alone (``tensor.device`` builds a new object per read).
        self.kinds: dict[tuple[torch.dtype, torch.device], TensorKind] = {}
        self._cpu_kinds: dict[torch.dtype, TensorKind] = {}

    def check(self, tensor: object, opname: str, *, reduction: bool = True) -> str:
        """Raise on a tensor the communicator cannot take; return its description tail.

        Raises:
            TypeError: not a tensor, not dense, or (``reduction`` only) a dtype the backend
                cannot reduce.
            ValueError: a device type other than the communicator's.
        """
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"{opname} expects a torch.Tensor, got {type(tensor).__name__}")
        if tensor.layout is not torch.strided:
            raise TypeError(
                f"{opname} expects a dense (strided) tensor, got layout {tensor.layout}"
            )
        kind = (self._cpu_kinds.get(tensor.dtype) if tensor.is_cpu
                else self.kinds.get((tensor.dtype, tensor.device)))
        if kind is None:
            kind = self.classify(tensor)
        error, reason, tail = kind
        if error is not None and (reduction or error is ValueError):
            raise error(f"{opname}: {reason}")
        return tail

    def classify(self, tensor: torch.Tensor) -> TensorKind:
        """Classify (and cache) ``tensor``'s (dtype, device).

        ValueError: a device type other than the communicator's, or with ``exact_device`` another
        device (raised for every collective);
        TypeError: a dtype the backend's ``_supports`` calls unsupported (raised for reductions
        only; complex dtypes land here, and :meth:`Communicator.all_reduce` reduces their real
        view instead).
        """
        dtype, device = tensor.dtype, tensor.device
        tail = f" {dtype} on {device} ({self._backend}, {self._group})"
        error: type[Exception] | None = None
        if device.type != self._device.type:
            error = ValueError
            reason = (f"tensor is on {device}, but this {self._backend} communicator works on "
                      f"{self._device}")
        elif self._exact and device != self._device:
            error = ValueError
            reason = f"tensor is on {device}, but this communicator's GPU is {self._device}"
        else:
            support = self._supports(dtype, device)
            reason = support.reason
            if not support.is_supported:
                error = TypeError
        kind = self.kinds[(dtype, device)] = (error, reason, tail)
        if device.type == "cpu":
            self._cpu_kinds[dtype] = kind
        return kind

def flat(tensor: torch.Tensor) -> torch.Tensor:
    """A contiguous ``tensor`` as 1-D (``(numel,)``, no copy): itself when already 1-D.

    ``view(-1)`` makes a new tensor object, which every call would pay; a 1-D tensor needs none.
    """
    return tensor if tensor.dim() == 1 else tensor.view(-1)


def flat_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """The memory of a contiguous ``tensor`` as a 1-D uint8 view (no copy).

    Shape ``(tensor.numel() * tensor.element_size(),)``. A one-element tensor counts as contiguous
    whatever its stride (``torch.zeros(2)[::2]`` has stride 2), which ``Tensor.view(torch.uint8)``
    rejects, so it is viewed with stride 1 first (the same single element).
    """
    flat = tensor if tensor.dim() == 1 else tensor.reshape(-1)
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
        ValueError: from :func:`check_writable` when ``written_by``
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


def displacements(counts: list[int]) -> list[int]:
    """Offsets of consecutive pieces of ``counts`` elements: ``[0, c0, c0 + c1, ...]``."""
    out, at = [], 0
    for c in counts:
        out.append(at)
        at += c
    return out

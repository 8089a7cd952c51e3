"""A fake accelerator for CPU-only CI: tensors that report a non-CPU device but hold CPU data.

:class:`FakeDeviceTensor` is a wrapper subclass (``__torch_dispatch__``): its ``device`` is
:data:`FAKE` while its values live in a CPU tensor (``_data``), so every operation really runs
and every value can be compared bit for bit with a CPU run. :class:`FakeDeviceMode` makes factory
calls with ``device=FAKE`` (``torch.zeros(n, device=comm.device)``) produce such tensors, and
refuses what CUDA refuses: an operation that mixes a fake-device tensor with a CPU tensor that
is not a 0-dim scalar (copies between devices are allowed, as on CUDA), raising torch's
"Expected all tensors to be on the same device" RuntimeError. :class:`FakeDeviceCommunicator`
puts a real CPU transport (gloo, mpi) under a communicator whose ``device`` is :data:`FAKE`, so the
base class's device check refuses a CPU tensor exactly as a CUDA communicator does.

Why ``meta`` and not ``cuda:N``: a CPU build of torch cannot run autograd on a tensor that reports
a CUDA device (the engine asks CUDA's device guard for a stream and aborts the process with
"PyTorch is not linked with support for cuda devices"), and factory calls with
``device="cuda"`` initialise CUDA before any dispatch mode sees them. ``meta`` has a device guard
in every build, and autograd runs it on the calling thread. Code that branches on
``device.type == "cuda"`` (stream synchronisation) is therefore not reached here; it is tested
with fake CUDA modules (tests/test_gpu_streams.py) and by ``scripts/gpu_check.sh``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any
from unittest import mock

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map

from gradcomm.comm import Communicator
from gradcomm.comm.types import ReduceOp, Support, SupportLevel
from gradcomm.comm.work import CompletedWork, DescriptionLike, Work

__all__ = [
    "FAKE",
    "FakeDeviceCommunicator",
    "FakeDeviceMode",
    "FakeDeviceTensor",
    "fake_device",
    "to_cpu",
    "to_fake",
    "to_fake_module",
]

#: The device fake tensors report.
FAKE = torch.device("meta")

_aten = torch.ops.aten
# Operations CUDA allows between devices: copies (``copy_``, ``.to``) and metadata only.
_CROSS_DEVICE_OK = frozenset({_aten.copy_.default, _aten._to_copy.default})


class FakeDeviceTensor(torch.Tensor):
    """A tensor that reports :data:`FAKE` as its device; its values are the CPU tensor ``_data``."""

    _data: torch.Tensor

    @staticmethod
    def __new__(cls, data: torch.Tensor, device: torch.device | str = FAKE) -> FakeDeviceTensor:
        """``device``: what the tensor reports. Default :data:`FAKE`; ``cuda:N`` works too on a
        CPU build for code without autograd and without CUDA factory calls (fake CUDA modules,
        tests/fake_cuda.py)."""
        if data.device.type != "cpu" or isinstance(data, FakeDeviceTensor):
            raise TypeError(f"FakeDeviceTensor wraps a plain CPU tensor, got {data.device}")
        out = torch.Tensor._make_wrapper_subclass(
            cls, data.size(), strides=data.stride(), storage_offset=data.storage_offset(),
            dtype=data.dtype, device=torch.device(device), requires_grad=data.requires_grad,
        )
        out._data = data
        return out

    def data_ptr(self) -> int:  # type: ignore[override]
        # The reducer and the communicator compare addresses (aliasing checks); a wrapper has no
        # storage of its own, so report the CPU data's, as a CUDA tensor reports its own memory.
        return self._data.data_ptr()

    def copy_(self, src: torch.Tensor, non_blocking: bool = False) -> FakeDeviceTensor:  # type: ignore[override]
        # Tensor.copy_'s Python binding takes a device guard first, which a CPU build has only
        # for cpu and meta; the dispatcher's copy_ is the same operation without it.
        torch.ops.aten.copy_.default(self, src, non_blocking)
        return self

    def tolist(self) -> Any:  # type: ignore[override]
        # torch refuses tolist() on subclasses; a CUDA tensor copies to the host and converts.
        return self._data.tolist()

    def __repr__(self) -> str:  # type: ignore[override]
        return f"FakeDeviceTensor({self._data!r})"

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        return _dispatch(func, args, kwargs or {})


def _is_fake_device(value: object) -> bool:
    if isinstance(value, str):
        value = torch.device(value)
    return isinstance(value, torch.device) and value.type == FAKE.type


def _dispatch(func: Any, args: Any, kwargs: dict[str, Any]) -> Any:
    leaves, _ = tree_flatten((args, kwargs))
    fakes = [x for x in leaves if isinstance(x, FakeDeviceTensor)]
    plain = [x for x in leaves
             if isinstance(x, torch.Tensor) and not isinstance(x, FakeDeviceTensor)]
    to_fake_dev = _is_fake_device(kwargs.get("device"))
    if not fakes and not to_fake_dev:
        return func(*args, **kwargs)
    device = fakes[0].device if fakes else FAKE
    if func not in _CROSS_DEVICE_OK:
        mixed = [t for t in plain if t.dim() > 0]  # CUDA takes 0-dim CPU tensors as scalars
        mixed += [t for t in fakes if t.device != device]
        if fakes and mixed:
            raise RuntimeError(
                f"Expected all tensors to be on the same device, but found at least two devices, "
                f"{device} and {mixed[0].device}! (fake device, in {func})"
            )
    originals = {id(t._data): t for t in fakes}
    unwrapped_args = tree_map(lambda x: x._data if isinstance(x, FakeDeviceTensor) else x, args)
    unwrapped_kwargs = tree_map(lambda x: x._data if isinstance(x, FakeDeviceTensor) else x, kwargs)
    if to_fake_dev:
        unwrapped_kwargs["device"] = torch.device("cpu")
    out_on_fake = True
    if func is _aten._to_copy.default and "device" in kwargs:
        out_on_fake = to_fake_dev
    result = func(*unwrapped_args, **unwrapped_kwargs)

    def wrap(x: Any) -> Any:
        if not isinstance(x, torch.Tensor) or isinstance(x, FakeDeviceTensor):
            return x
        if id(x) in originals:  # an in-place op or out=: the caller's own tensor
            return originals[id(x)]
        return FakeDeviceTensor(x, device) if out_on_fake else x

    return tree_map(wrap, result)


class FakeDeviceMode(TorchDispatchMode):
    """Inside it, factories with ``device=FAKE`` make :class:`FakeDeviceTensor` objects."""

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        return _dispatch(func, args, kwargs or {})


_real_tensor = torch.tensor


def _tensor(data: Any, *args: Any, device: Any = None, requires_grad: bool = False,
            **kwargs: Any) -> torch.Tensor:
    """``torch.tensor`` that honours ``device=FAKE``: torch.tensor builds its result below the
    dispatcher, so no mode sees it (it would be a real meta tensor, without data)."""
    if device is None or not _is_fake_device(device):
        return _real_tensor(data, *args, device=device, requires_grad=requires_grad, **kwargs)
    return FakeDeviceTensor(_real_tensor(data, *args, **kwargs)).requires_grad_(requires_grad)


@contextlib.contextmanager
def fake_device() -> Iterator[None]:
    """:class:`FakeDeviceMode`, with autograd on the calling thread (as ``meta`` runs anyway),
    and ``torch.tensor(..., device=FAKE)`` making fake-device tensors."""
    with mock.patch.object(torch, "tensor", _tensor), FakeDeviceMode(), \
            torch.autograd.set_multithreading_enabled(False):
        yield


def to_fake(t: torch.Tensor) -> FakeDeviceTensor:
    """A fake-device copy of CPU tensor ``t`` (same values, strides and dtype)."""
    return FakeDeviceTensor(t.detach().clone(memory_format=torch.preserve_format))


def to_cpu(t: torch.Tensor) -> torch.Tensor:
    """A CPU copy of a fake-device or CPU tensor (a copy also of a CPU tensor: a gradient that is a
    bucket view changes with the bucket)."""
    if isinstance(t, FakeDeviceTensor):
        return t._data.clone(memory_format=torch.preserve_format)
    if t.device.type != "cpu":
        raise TypeError(f"expected a fake-device or CPU tensor, got one on {t.device}")
    return t.detach().clone(memory_format=torch.preserve_format)


def to_fake_module(module: nn.Module) -> nn.Module:
    """Move ``module``'s parameters and buffers to the fake device, in place (tied stay tied)."""
    moved: dict[int, nn.Parameter] = {}
    for mod in module.modules():
        for name, p in list(mod._parameters.items()):
            if p is None:
                continue
            if id(p) not in moved:
                moved[id(p)] = nn.Parameter(to_fake(p), requires_grad=p.requires_grad)
            mod._parameters[name] = moved[id(p)]
        for name, b in list(mod._buffers.items()):
            if b is not None:
                mod._buffers[name] = to_fake(b)
    return module


class FakeDeviceCommunicator(Communicator):
    """A communicator on :data:`FAKE` over a real CPU communicator ``inner`` (gloo, mpi, ...).

    The public methods (argument checks, device check, AVG emulation, copy-in/copy-out, profiler)
    are the base class's, run on fake-device tensors; only the transport hooks unwrap the CPU data
    and hand it to ``inner``'s collectives. A CPU tensor is refused with ValueError, as a CUDA
    communicator refuses one.
    """

    def __init__(self, inner: Communicator) -> None:
        # Named per instance before the base class builds its checks, which quote the name.
        self.backend = f"fake-{inner.backend}"  # type: ignore[misc]
        self.native_reduce_ops = inner.native_reduce_ops  # type: ignore[misc]
        super().__init__(rank=inner.rank, world_size=inner.world_size,
                         local_rank=inner.local_rank, device=FAKE, timeout=inner.timeout)
        self.inner = inner

    @property
    def background_progress(self) -> bool:
        return self.inner.background_progress

    @property
    def cheap_collectives(self) -> bool:
        return self.inner.cheap_collectives

    def _supports(self, dtype: torch.dtype, device: torch.device | str | None) -> Support:
        dev = self.device if device is None else torch.device(device)
        if dev.type != FAKE.type:
            return Support(SupportLevel.UNSUPPORTED, f"{self.backend} works on {FAKE}, not {dev}")
        return self.inner.supports(dtype)

    @staticmethod
    def _data(t: torch.Tensor) -> torch.Tensor:
        if not isinstance(t, FakeDeviceTensor):
            raise TypeError(f"a fake-device transport got a {type(t).__name__} on {t.device}")
        return t._data

    def _all_reduce(self, tensor: torch.Tensor, op: ReduceOp, description: DescriptionLike) -> Work:
        return self.inner.all_reduce(self._data(tensor), op, async_op=True)

    def _broadcast(self, tensor: torch.Tensor, src: int, description: DescriptionLike) -> Work:
        return self.inner.broadcast(self._data(tensor), src, async_op=True)

    def _all_gather(self, output: torch.Tensor, input: torch.Tensor,
                    description: DescriptionLike) -> Work:
        return self.inner.all_gather(self._data(output), self._data(input), async_op=True)

    def _reduce_scatter(self, output: torch.Tensor, input: torch.Tensor, op: ReduceOp,
                        description: DescriptionLike) -> Work:
        return self.inner.reduce_scatter(self._data(output), self._data(input), op,
                                         async_op=True)

    def _all_to_all(self, output: torch.Tensor, input: torch.Tensor, output_counts: list[int],
                    input_counts: list[int], description: DescriptionLike) -> Work:
        # 1-D tensors here: element counts are the split sizes
        return self.inner.all_to_all(self._data(output), self._data(input), output_counts,
                                     input_counts, async_op=True)

    def _reduce(self, tensor: torch.Tensor, dst: int, op: ReduceOp,
                description: DescriptionLike) -> Work:
        return self.inner.reduce(self._data(tensor), dst, op, async_op=True)

    def _gather(self, output: torch.Tensor | None, input: torch.Tensor, dst: int,
                description: DescriptionLike) -> Work:
        out = None if output is None else self._data(output)
        return self.inner.gather(out, self._data(input), dst, async_op=True)

    def _scatter(self, output: torch.Tensor, input: torch.Tensor | None, src: int,
                 description: DescriptionLike) -> Work:
        inp = None if input is None else self._data(input)
        return self.inner.scatter(self._data(output), inp, src, async_op=True)

    def _barrier(self, description: DescriptionLike) -> Work:
        self.inner.barrier()
        return CompletedWork(str(description))

    def _close(self) -> None:
        self.inner.close()

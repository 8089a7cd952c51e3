"""Device-buffer adapters that take the MPI backend through its device path without a GPU.

:class:`FakeAdapter` has the interface of
``gradcomm.comm.backends.mpi.device.DeviceBufferAdapter``: ``zero-copy`` hands MPI a
:class:`FakeDeviceArray` (``__cuda_array_interface__`` over the tensor's host memory, mpi4py's
own test trick); ``staged`` hands MPI a separate host copy, so results are right only if
``finish()`` runs after completion and before the caller sees the tensor.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch


class FakeDeviceArray:
    """Host memory presented through ``__cuda_array_interface__`` (version 3)."""

    def __init__(self, array: np.ndarray) -> None:
        self._array = array  # keeps the memory alive
        self.__cuda_array_interface__ = {
            "shape": array.shape,
            "typestr": array.dtype.str,
            "data": (array.ctypes.data, False),
            "strides": None,
            "version": 3,
            "stream": None,
        }


class FakeAdapter:
    """Records prepare/finish calls; ``staged`` copies through a separate host buffer."""

    def __init__(self, staged: bool) -> None:
        self.staged = staged
        self.events: list[str] = []

    def prepare(
        self, tensor: torch.Tensor, *, read: bool = True, write: bool = True
    ) -> tuple[object, Callable[[], None]]:
        assert tensor.is_contiguous(), "prepare() got a non-contiguous tensor"
        self.events.append(f"prepare {tensor.dtype}")
        if not self.staged:
            return FakeDeviceArray(tensor.numpy()), lambda: self.events.append("finish")
        host = tensor.numpy().copy() if read else np.zeros_like(tensor.numpy())

        def finish() -> None:
            self.events.append("finish")
            if write:
                tensor.copy_(torch.from_numpy(host))

        return host, finish


def device_adapters() -> list[object]:
    """The adapters the collective and point-to-point suites run through on MPI: the staged
    :class:`FakeAdapter`, and the real ``DeviceBufferAdapter`` staging through host memory."""
    from gradcomm.comm.backends.mpi.device import DeviceBufferAdapter

    return [FakeAdapter(staged=True), DeviceBufferAdapter(False, synchronize=lambda: None)]

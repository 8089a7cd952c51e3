"""Run under ``mpiexec -n N``: the device-buffer path of the MPI backend, without a GPU.

No GPU is needed: a CPU communicator is given an adapter with the interface of
``gradcomm.comm.backends.mpi.device.DeviceBufferAdapter``. ``zero-copy`` mode hands MPI an object
exposing ``__cuda_array_interface__`` over the tensor's host memory (mpi4py's own test trick);
``staged`` mode hands MPI a separate host copy, so results are right only if ``finish()`` runs
after completion and before the caller sees the tensor. Prints ``RESULT staging <mode> ok`` per
mode, exits non-zero on a wrong value or a wrong call order. Then the real
``DeviceBufferAdapter`` (both modes, on CPU tensors) is plugged in: ``RESULT staging real-adapter``.
"""

from __future__ import annotations

import sys
from collections.abc import Callable

import numpy as np
import torch

import gradcomm
from gradcomm.comm.backends.mpi.communicator import MPICommunicator


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
        if not tensor.is_contiguous():
            sys.exit("prepare() got a non-contiguous tensor")
        self.events.append(f"prepare {tensor.dtype}")
        if not self.staged:
            return FakeDeviceArray(tensor.numpy()), lambda: self.events.append("finish")
        host = tensor.numpy().copy() if read else np.zeros_like(tensor.numpy())

        def finish() -> None:
            self.events.append("finish")
            if write:
                tensor.copy_(torch.from_numpy(host))

        return host, finish


def check(comm: gradcomm.Communicator, adapter: FakeAdapter) -> None:
    rank, world = comm.rank, comm.world_size
    total = float(sum(range(1, world + 1)))
    t = torch.full((1000,), float(rank + 1))
    comm.all_reduce(t)
    if not bool((t == total).all()):
        sys.exit(f"{adapter.staged=}: float32 all_reduce gave {t[:4]}")
    if adapter.events != ["prepare torch.float32", "finish"]:
        sys.exit(f"float32 all_reduce: wrong call order {adapter.events}")
    adapter.events.clear()

    h = torch.full((300,), float(rank + 1), dtype=torch.bfloat16)
    work = comm.all_reduce(h, "avg", async_op=True)
    work.wait()
    if not bool((h.float() == total / world).all()):
        sys.exit(f"{adapter.staged=}: bfloat16 avg gave {h[:4]}")
    # fp16/bf16 are upcast on the torch side first: the adapter sees float32.
    if adapter.events != ["prepare torch.float32", "finish"]:
        sys.exit(f"bfloat16 all_reduce: wrong call order {adapter.events}")
    adapter.events.clear()

    b = torch.full((7,), float(rank))
    comm.broadcast(b, src=world - 1)
    if not bool((b == world - 1).all()):
        sys.exit(f"{adapter.staged=}: broadcast gave {b}")

    out = torch.empty(world, 3, dtype=torch.int64)
    comm.all_gather(out, torch.full((3,), rank, dtype=torch.int64))
    if out[:, 0].tolist() != list(range(world)):
        sys.exit(f"{adapter.staged=}: all_gather gave {out}")
    if adapter.events.count("finish") != 3:  # broadcast 1, all_gather 2
        sys.exit(f"broadcast/all_gather: expected 3 finish calls, got {adapter.events}")


def check_real_adapter(comm: MPICommunicator, cuda_aware: bool) -> None:
    """The real DeviceBufferAdapter on CPU tensors: fake device arrays, or host staging."""
    import warnings

    from gradcomm.comm.backends.mpi.device import DeviceBufferAdapter

    syncs: list[int] = []
    adapter = DeviceBufferAdapter(
        cuda_aware,
        synchronize=lambda: syncs.append(1),
        to_array=lambda wire: FakeDeviceArray(wire.numpy()),
    )
    comm._adapter = adapter
    rank, world = comm.rank, comm.world_size
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", gradcomm.SlowPathWarning)
        t = torch.full((5000,), float(rank + 1))
        comm.all_reduce(t, "max")
        h = torch.full((33,), float(rank + 1), dtype=torch.bfloat16)
        comm.all_reduce(h, "sum")
        b = torch.arange(10) * (rank + 1)
        comm.broadcast(b, src=world - 1)
        out = torch.empty(world, 4, dtype=torch.float16)
        comm.all_gather(out, torch.full((4,), float(rank), dtype=torch.float16))
    total = world * (world + 1) / 2
    if not (bool((t == world).all()) and bool((h.float() == total).all())
            and torch.equal(b, torch.arange(10) * world)
            and out[:, 0].tolist() == [float(r) for r in range(world)]):
        sys.exit(f"real adapter (cuda_aware={cuda_aware}) gave wrong values: {t[:2]} {h[:2]} "
                 f"{b} {out}")
    if len(syncs) != 5:  # one synchronize per prepared buffer (all_gather prepares two)
        sys.exit(f"real adapter: expected 5 synchronize calls, got {len(syncs)}")


def main() -> None:
    comm = gradcomm.init("mpi", timeout=30)
    if not isinstance(comm, MPICommunicator):
        sys.exit(f"expected an MPICommunicator, got {type(comm).__name__}")
    for staged in (False, True):
        adapter = FakeAdapter(staged)
        comm._adapter = adapter  # the device-buffer path, without a GPU
        check(comm, adapter)
        print(f"RESULT staging {'staged' if staged else 'zero-copy'} ok rank={comm.rank}",
              flush=True)
    try:
        from gradcomm.comm.backends.mpi import device as mpi_device  # noqa: F401
    except ImportError:
        print("RESULT staging real-adapter skipped (no mpi_device module)", flush=True)
    else:
        for cuda_aware in (True, False):
            check_real_adapter(comm, cuda_aware)
        print(f"RESULT staging real-adapter ok rank={comm.rank}", flush=True)
    comm.close()


if __name__ == "__main__":
    main()

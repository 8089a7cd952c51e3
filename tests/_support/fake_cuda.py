"""Fake CUDA, CuPy and NCCL for CPU-only CI: what the GPU backends call, recorded in order.

:func:`install` (a pytest fixture helper) makes ``torch.cuda`` report one or more devices and
replaces the stream, event and device-context API the backends use with :class:`FakeStream` and
:class:`FakeEvent`, and ``Tensor.record_stream`` with a recorder; :func:`install_cupy` puts a fake
``cupy``/``cupy.cuda``/``cupy.cuda.nccl`` in :data:`sys.modules`. Every call lands in one
:class:`Log`, so a test can assert the order ProcessGroupNCCL uses: the side stream waits for the
current stream, NCCL is given the side stream, the tensors are recorded on it, an event is recorded
after it, and a wait makes the current stream wait for that event.

The fake NCCL communicator reduces for real, as if every rank held the same data (SUM multiplies
by ``world_size`` in the tensor's dtype, as NCCL's float16 sum rounds; AVG then divides), reading
and writing the tensor's memory by address (``numpy`` over ``ctypes``), so values are checked too.
"""

from __future__ import annotations

import contextlib
import ctypes
import importlib.machinery
import itertools
import sys
import types
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pytest
import torch

__all__ = ["FakeEvent", "FakeStream", "Log", "install", "install_cupy"]

_handles = itertools.count(0x1000)


@dataclass
class Log:
    """Calls in order, as tuples whose first item names the call."""

    calls: list[tuple[Any, ...]] = field(default_factory=list)

    def add(self, *call: Any) -> None:
        self.calls.append(call)

    def names(self) -> list[str]:
        return [c[0] for c in self.calls]


class FakeStream:
    """A CUDA stream: ``cuda_stream`` is a distinct integer handle; waits are logged."""

    def __init__(self, log: Log, name: str, device: Any = None) -> None:
        self.log, self.name, self.device = log, name, device
        self.cuda_stream = next(_handles)

    def wait_stream(self, other: FakeStream) -> None:
        self.log.add("wait_stream", self.name, other.name)

    def wait_event(self, event: FakeEvent) -> None:
        self.log.add("wait_event", self.name, event.name)

    def synchronize(self) -> None:
        self.log.add("synchronize", self.name)

    def __repr__(self) -> str:
        return f"<FakeStream {self.name}>"


class FakeEvent:
    """A CUDA event; ``query()`` is True once ``done`` is set (tests set it, or ``auto``)."""

    count = itertools.count()

    def __init__(self, log: Log, auto: bool) -> None:
        self.log, self.done = log, auto
        self.name = f"event{next(self.count)}"

    def record(self, stream: FakeStream) -> None:
        self.log.add("event.record", self.name, stream.name)

    def query(self) -> bool:
        return self.done


@dataclass
class FakeCuda:
    """What :func:`install` set up: the log, the current stream, and the events made."""

    log: Log
    current: FakeStream
    events: list[FakeEvent]
    side_streams: list[FakeStream]
    devices_set: list[torch.device]
    events_complete: bool = True


def install(monkeypatch: pytest.MonkeyPatch, device_count: int = 1,
            events_complete: bool = True) -> FakeCuda:
    """Make ``torch.cuda`` look present with ``device_count`` GPUs (see the module docstring)."""
    log = Log()
    fake = FakeCuda(log, FakeStream(log, "current"), [], [], [])
    fake.events_complete = events_complete

    def make_stream(device: Any = None, *args: Any, **kwargs: Any) -> FakeStream:
        stream = FakeStream(log, f"side{len(fake.side_streams)}", device)
        fake.side_streams.append(stream)
        return stream

    def make_event(*args: Any, **kwargs: Any) -> FakeEvent:
        event = FakeEvent(log, fake.events_complete)
        fake.events.append(event)
        return event

    def record_stream(self: torch.Tensor, stream: FakeStream) -> None:
        log.add("record_stream", self.data_ptr(), stream.name)

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: device_count)
    monkeypatch.setattr(torch.cuda, "set_device",
                        lambda d: fake.devices_set.append(torch.device(d)))
    monkeypatch.setattr(torch.cuda, "Stream", make_stream)
    monkeypatch.setattr(torch.cuda, "Event", make_event)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: fake.current)
    monkeypatch.setattr(torch.cuda, "device", lambda d: contextlib.nullcontext())
    monkeypatch.setattr(torch.Tensor, "record_stream", record_stream)
    return fake


# nccl.h's ncclDataType_t codes -> numpy dtypes (float16 reduced in float16, as NCCL does).
_NP = {0: np.int8, 1: np.uint8, 2: np.int32, 4: np.int64, 6: np.float16, 7: np.float32,
       8: np.float64}


def _view(ptr: int, count: int, code: int) -> np.ndarray:
    dtype = np.dtype(_NP[code])
    raw = (ctypes.c_char * (count * dtype.itemsize)).from_address(ptr)
    return np.frombuffer(raw, dtype=dtype, count=count)


class FakeNcclCommunicator:
    """``cupy.cuda.nccl.NcclCommunicator`` whose peers all hold the same data as this rank."""

    def __init__(self, log: Log, world_size: int, uid: Any, rank: int) -> None:
        self.log, self.world_size, self.rank = log, world_size, rank
        self.aborted = self.destroyed = False
        log.add("NcclCommunicator", world_size, rank)

    def allReduce(self, send: int, recv: int, count: int, dtype: int, op: int,
                  stream: int) -> None:
        self.log.add("allReduce", recv, count, dtype, op, stream)
        data = _view(recv, count, dtype)
        if op in (0, 4):  # sum, avg
            # Rounded in the dtype, as NCCL's float16 sum is (80000 overflows to inf).
            data[:] = (data * data.dtype.type(self.world_size)).astype(data.dtype)
            if op == 4:
                data[:] = (data / data.dtype.type(self.world_size)).astype(data.dtype)

    def broadcast(self, send: int, recv: int, count: int, dtype: int, root: int,
                  stream: int) -> None:
        self.log.add("broadcast", recv, count, dtype, root, stream)

    def allGather(self, send: int, recv: int, count: int, dtype: int,
                  stream: int) -> None:
        self.log.add("allGather", send, recv, count, dtype, stream)
        if send != recv:  # every peer sent what this rank sent (count: elements per rank)
            mine = _view(send, count, dtype).copy()
            _view(recv, count * self.world_size, dtype)[:] = np.tile(mine, self.world_size)

    def reduceScatter(self, send: int, recv: int, count: int, dtype: int, op: int,
                      stream: int) -> None:
        self.log.add("reduceScatter", send, recv, count, dtype, op, stream)
        data = _view(send, count * self.world_size, dtype)[self.rank * count:
                                                            (self.rank + 1) * count]
        out = _view(recv, count, dtype)
        if op in (0, 4):  # every peer holds this rank's data: the sum is world_size times it
            out[:] = (data * data.dtype.type(self.world_size)).astype(data.dtype)
            if op == 4:
                out[:] = (out / out.dtype.type(self.world_size)).astype(out.dtype)

    def reduce(self, send: int, recv: int, count: int, dtype: int, op: int, root: int,
               stream: int) -> None:
        self.log.add("reduce", recv, count, dtype, op, root, stream)

    def send(self, buf: int, count: int, dtype: int, peer: int, stream: int) -> None:
        self.log.add("send", buf, count, dtype, peer, stream)

    def recv(self, buf: int, count: int, dtype: int, peer: int, stream: int) -> None:
        self.log.add("recv", buf, count, dtype, peer, stream)

    def check_async_error(self) -> None:
        self.log.add("check_async_error")

    def abort(self) -> None:
        self.aborted = True
        self.log.add("abort")

    def destroy(self) -> None:
        self.destroyed = True
        self.log.add("destroy")


def install_cupy(monkeypatch: pytest.MonkeyPatch, log: Log, nccl_version: int = 22000) -> Any:
    """Put a fake ``cupy`` with ``cupy.cuda.nccl`` (version code ``nccl_version``) in
    :data:`sys.modules`; returns the fake nccl module (its ``comms`` lists the communicators)."""
    cupy = types.ModuleType("cupy")
    cupy.__spec__ = importlib.machinery.ModuleSpec("cupy", None)
    cuda = types.ModuleType("cupy.cuda")
    nccl = types.ModuleType("cupy.cuda.nccl")
    nccl.available = True  # type: ignore[attr-defined]
    nccl.comms = []  # type: ignore[attr-defined]
    for name, code in (("NCCL_INT8", 0), ("NCCL_UINT8", 1), ("NCCL_INT32", 2), ("NCCL_INT64", 4),
                       ("NCCL_FLOAT16", 6), ("NCCL_FLOAT32", 7), ("NCCL_FLOAT64", 8),
                       ("NCCL_SUM", 0), ("NCCL_PROD", 1), ("NCCL_MAX", 2), ("NCCL_MIN", 3)):
        setattr(nccl, name, code)
    nccl.groupStart = lambda: log.add("groupStart")  # type: ignore[attr-defined]
    nccl.groupEnd = lambda: log.add("groupEnd")  # type: ignore[attr-defined]
    nccl.get_version = lambda: nccl_version  # type: ignore[attr-defined]
    nccl.get_unique_id = lambda: b"fake-unique-id"  # type: ignore[attr-defined]

    def make_comm(world_size: int, uid: Any, rank: int) -> FakeNcclCommunicator:
        comm = FakeNcclCommunicator(log, world_size, uid, rank)
        nccl.comms.append(comm)  # type: ignore[attr-defined]
        return comm

    nccl.NcclCommunicator = make_comm  # type: ignore[attr-defined]
    current: list[int] = [0]

    @contextlib.contextmanager
    def device(index: int) -> Iterator[None]:
        old, current[0] = current[0], index
        log.add("cupy.Device", index)
        try:
            yield
        finally:
            current[0] = old

    def asarray(obj: Any) -> Any:
        log.add("cupy.asarray", current[0])
        return obj

    cuda.Device = device  # type: ignore[attr-defined]
    cuda.nccl = nccl  # type: ignore[attr-defined]
    cupy.cuda = cuda  # type: ignore[attr-defined]
    cupy.asarray = asarray  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "cupy", cupy)
    monkeypatch.setitem(sys.modules, "cupy.cuda", cuda)
    monkeypatch.setitem(sys.modules, "cupy.cuda.nccl", nccl)
    return nccl

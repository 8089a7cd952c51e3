"""CUDA tensors as MPI buffers: CUDA-awareness detection and the device-buffer adapter.

Used by the mpi backend (:mod:`gradcomm.comm.backends.mpi`) when its device is CUDA. Two paths:

* **CUDA-aware MPI** (Open MPI built with CUDA, MVAPICH2-GDR, Cray MPICH with GPU support, MPICH
  built with CUDA): the tensor's memory goes to mpi4py as a zero-copy CuPy array (through the
  tensor's ``__cuda_array_interface__``; bfloat16, which has no CUDA-array type string, travels as
  an int16 view of the same bytes). MPI does not know about CUDA streams, so the stream that
  produced the tensor (torch's current stream) is synchronised before MPI reads the buffer, as
  ChainerMN does before handing a device pointer to MPI.
* **Not CUDA-aware, or awareness cannot be confirmed** (e.g. ``pip install mpich``): the tensor is
  copied into a pinned host buffer (kept in a pool and reused), MPI works on a numpy view of it,
  and ``finish()`` copies the result back to the device. One :class:`~gradcomm.SlowPathWarning` per
  process says so.

``GRADCOMM_MPI_CUDA_AWARE=1`` (or ``0``) overrides the detection. Forcing ``1`` with an MPI that is
not CUDA-aware makes MPI dereference device pointers on the host: expect a crash, not an error.

The conversion from tensor to device array and the stream synchronisation are injectable, so the
CUDA-aware path is tested on machines without a GPU with a fake array that exposes
``__cuda_array_interface__`` over host memory (mpi4py's own test trick).
"""

from __future__ import annotations

import ctypes
import logging
import os
import threading
import warnings
from collections.abc import Callable, Mapping
from typing import Any

import torch

from ...errors import SlowPathWarning
from ...launch.env import env_flag
from ..cuda_packages import cupy_pip

__all__ = [
    "CUDA_AWARE_ENV",
    "DeviceBufferAdapter",
    "cuda_aware_mpi",
    "cupy_array",
    "wire_view",
]

log = logging.getLogger("gradcomm.comm.mpi.device")

#: Environment variable that overrides the CUDA-awareness detection (``0`` or ``1``).
CUDA_AWARE_ENV = "GRADCOMM_MPI_CUDA_AWARE"

# Shared-library names of MPI implementations, tried when /proc/self/maps cannot be read.
_LIBMPI_NAMES = ("libmpi.so.40", "libmpi.so.12", "libmpi.so", "libmpi_ibm.so", "libmpich.so")


# ----------------------------------------------------------------------------- detection
def _loaded_libmpi_paths() -> list[str]:
    """Paths or sonames of the MPI libraries already loaded into this process (Linux first)."""
    found: list[str] = []
    try:
        with open("/proc/self/maps", encoding="utf-8", errors="replace") as maps:
            for line in maps:
                path = line.split()[-1] if line.strip() else ""
                base = os.path.basename(path)
                wanted = base.startswith(("libmpi.so", "libmpi_ibm.so", "libmpich.so"))
                if wanted and path not in found:
                    found.append(path)
    except OSError:
        pass
    return found + [name for name in _LIBMPI_NAMES if name not in found]


def _query_cuda_support() -> tuple[int | None, str]:
    """Call ``MPIX_Query_cuda_support()`` in the MPI library mpi4py loaded, if it has one.

    Open MPI (>= 2.0) and MPICH (>= 4.0) export this extension; it returns 1 when the library was
    built with CUDA and its runtime supports CUDA buffers. It must be called after MPI_Init.
    ``RTLD_NOLOAD`` makes sure no second MPI library is loaded by the probe.
    """
    mode = getattr(os, "RTLD_NOLOAD", 0) | getattr(os, "RTLD_LOCAL", 0)
    for name in _loaded_libmpi_paths():
        try:
            lib = ctypes.CDLL(name, mode=mode)
        except OSError:
            continue
        func = getattr(lib, "MPIX_Query_cuda_support", None)
        if func is None:
            continue
        func.restype = ctypes.c_int
        func.argtypes = []
        return int(func()), os.path.basename(name)
    return None, ""


def cuda_aware_mpi(env: Mapping[str, str] | None = None) -> tuple[bool, str]:
    """Say whether the MPI library under mpi4py can take CUDA device pointers, and why.

    Order, first answer wins:

    1. ``GRADCOMM_MPI_CUDA_AWARE`` = ``1``/``0`` (also true/false/yes/no/on/off).
    2. MPICH's ``MPIR_CVAR_ENABLE_GPU=0`` (GPU support switched off at run time) -> False.
    3. ``MPIX_Query_cuda_support()`` of the loaded MPI library (Open MPI, MPICH >= 4), found with
       :mod:`ctypes` among the libraries mpi4py already loaded; called only after MPI_Init.
    4. The library's version text (:func:`mpi4py.MPI.Get_library_version`): MVAPICH2-GDR with
       ``MV2_USE_CUDA=1``, Cray MPICH with ``MPICH_GPU_SUPPORT_ENABLED=1``.
    5. Otherwise False: awareness could not be confirmed, so the safe (staging) path is used.

    Imports mpi4py (which initialises MPI); call it only where MPI is used anyway.

    Args:
        env: environment to read (default :data:`os.environ`).

    Returns:
        ``(aware, reason)``; ``reason`` is one sentence naming the evidence.

    Raises:
        ValueError: ``GRADCOMM_MPI_CUDA_AWARE`` is set to something other than 0/1 (or synonyms).
    """
    env = os.environ if env is None else env
    forced = env_flag(CUDA_AWARE_ENV, None, env)
    if forced is not None:
        raw = env[CUDA_AWARE_ENV].strip()
        if forced:
            return True, f"{CUDA_AWARE_ENV}={raw} forces the CUDA-aware path"
        return False, f"{CUDA_AWARE_ENV}={raw} forces staging through host memory"
    if env.get("MPIR_CVAR_ENABLE_GPU", "").strip() == "0":
        return False, "MPIR_CVAR_ENABLE_GPU=0 switches MPICH's GPU support off"
    try:
        from mpi4py import MPI
    except ImportError:
        return False, "mpi4py is not installed (pip install mpi4py), so CUDA-awareness is unknown"
    if MPI.Is_initialized() and not MPI.Is_finalized():
        value, lib = _query_cuda_support()
        if value is not None:
            if value:
                return True, f"MPIX_Query_cuda_support() of {lib} returned 1"
            return False, (
                f"MPIX_Query_cuda_support() of {lib} returned 0 (built without CUDA, or CUDA "
                "support off at run time)"
            )
    version = MPI.Get_library_version()
    if "MVAPICH2-GDR" in version and env.get("MV2_USE_CUDA", "").strip() == "1":
        return True, "MVAPICH2-GDR with MV2_USE_CUDA=1"
    if "CRAY MPICH" in version.upper() and env.get("MPICH_GPU_SUPPORT_ENABLED", "") == "1":
        return True, "Cray MPICH with MPICH_GPU_SUPPORT_ENABLED=1"
    first = " ".join(version.strip().splitlines()[0].split()) if version.strip() else "this MPI"
    return False, f"could not confirm that {first} is CUDA-aware; set {CUDA_AWARE_ENV}=1 if it is"


# ----------------------------------------------------------------------------- buffers
def wire_view(tensor: torch.Tensor) -> torch.Tensor:
    """The 1-D view of a contiguous tensor that MPI buffers are made from (no copy).

    bfloat16 has no type string in the CUDA array interface or numpy, so it becomes an int16 view
    of the same bytes; every other dtype keeps its dtype. The result is detached (torch refuses
    ``__cuda_array_interface__`` on tensors that require grad).
    """
    flat = tensor.detach().view(-1)
    return flat.view(torch.int16) if flat.dtype == torch.bfloat16 else flat


def cupy_array(tensor: torch.Tensor) -> Any:
    """Zero-copy CuPy array over a contiguous CUDA tensor (1-D; bfloat16 as int16).

    Goes through the tensor's ``__cuda_array_interface__``: the array shares the tensor's memory
    and keeps the tensor alive.

    Raises:
        ImportError: CuPy is missing (the message names the CuPy of torch's CUDA major).
    """
    try:
        import cupy  # type: ignore[import-not-found, unused-ignore]
    except ImportError as exc:
        raise ImportError(
            f"passing CUDA tensors to a CUDA-aware MPI needs CuPy: {cupy_pip()} "
            f"(or set {CUDA_AWARE_ENV}=0 to stage through host memory)"
        ) from exc
    index = tensor.device.index
    # CuPy makes the array (and any context it needs) on its current device, which is 0 unless
    # set: the tensor's own device, so rank r's buffers stay on GPU r.
    with cupy.cuda.Device(0 if index is None else index):
        return cupy.asarray(wire_view(tensor))


_warn_lock = threading.Lock()
_warned: set[str] = set()


def _warn_once(key: str, message: str) -> None:
    with _warn_lock:
        if key in _warned:
            return
        _warned.add(key)
    log.warning(message)
    warnings.warn(message, SlowPathWarning, stacklevel=4)


def _default_synchronize(tensor: torch.Tensor) -> None:
    if tensor.is_cuda:
        torch.cuda.current_stream(tensor.device).synchronize()


def _noop() -> None:
    return None


class DeviceBufferAdapter:
    """Turns a contiguous device tensor into a buffer mpi4py can use, and back.

    Args:
        cuda_aware: whether MPI takes device pointers (see :func:`cuda_aware_mpi`).
        synchronize: called with no arguments before MPI may read a buffer; default
            ``torch.cuda.current_stream(tensor.device).synchronize()`` (nothing for CPU tensors).
        to_array: CUDA-aware path only: ``to_array(wire) -> array`` exposing
            ``__cuda_array_interface__`` over the memory of ``wire`` (the tensor's
            :func:`wire_view`: 1-D, bfloat16 as int16); default :func:`cupy_array`. Tests pass a
            fake array over host memory.

    Protocol, per collective: ``buf, finish = adapter.prepare(tensor)``; start the MPI operation on
    ``buf``; after it completes (``Wait``), call ``finish()`` exactly once before the tensor is
    read.
    ``prepare`` has already synchronised the producing stream when it returns. Several buffers may
    be prepared and in flight at once (each staging buffer belongs to one ``prepare`` until its
    ``finish``). Thread-safe.
    """

    def __init__(
        self,
        cuda_aware: bool,
        *,
        synchronize: Callable[[], None] | None = None,
        to_array: Callable[[torch.Tensor], Any] | None = None,
    ) -> None:
        self._cuda_aware = bool(cuda_aware)
        self._synchronize = synchronize
        self._to_array = cupy_array if to_array is None else to_array
        self._lock = threading.Lock()
        self._free: dict[tuple[int, bool], list[torch.Tensor]] = {}

    @property
    def cuda_aware(self) -> bool:
        """True when buffers are handed to MPI as device arrays, False when staged on the host."""
        return self._cuda_aware

    def prepare(
        self, tensor: torch.Tensor, *, read: bool = True, write: bool = True
    ) -> tuple[Any, Callable[[], None]]:
        """Return ``(buffer, finish)`` for one MPI operation on ``tensor``.

        Args:
            tensor: contiguous; any dtype with a numpy equivalent, or bfloat16 (sent as int16).
            read: MPI reads the tensor's current values (False for a pure output buffer, e.g.
                all_gather's output: the staging path then skips the device-to-host copy).
            write: MPI writes results into it (False for a pure input: ``finish`` copies nothing).

        Returns:
            CUDA-aware: a 1-D zero-copy device array (``to_array``) and a ``finish`` that does
            nothing. Staging: a 1-D numpy view of a pinned host buffer with the tensor's values
            and a ``finish`` that copies the buffer back into the tensor (when ``write``) and
            returns the buffer to the pool. In both, ``synchronize`` ran before this returns.

        Raises:
            TypeError: ``tensor`` is not a torch.Tensor.
            ValueError: ``tensor`` is not contiguous.
            ImportError: CUDA-aware path without CuPy (default ``to_array``).
        """
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"prepare expects a torch.Tensor, got {type(tensor).__name__}")
        if not tensor.is_contiguous():
            raise ValueError("prepare expects a contiguous tensor (copy it first)")
        self._sync(tensor)
        if self._cuda_aware:
            return self._to_array(wire_view(tensor)), _noop
        return self._stage(tensor, read=read, write=write)

    def _sync(self, tensor: torch.Tensor) -> None:
        if self._synchronize is None:
            _default_synchronize(tensor)
        else:
            self._synchronize()

    def _stage(
        self, tensor: torch.Tensor, *, read: bool, write: bool
    ) -> tuple[Any, Callable[[], None]]:
        _warn_once(
            "mpi-staging",
            "MPI is not CUDA-aware (or that could not be confirmed): CUDA tensors are staged "
            f"through pinned host memory, which is slow; set {CUDA_AWARE_ENV}=1 if your MPI is "
            "CUDA-aware",
        )
        wire = wire_view(tensor)
        nbytes = wire.numel() * wire.element_size()
        raw = self._take(nbytes, tensor.is_cuda)
        host = raw.view(wire.dtype)
        if read:
            host.copy_(wire)
        done = False

        def finish() -> None:
            nonlocal done
            if done:
                raise RuntimeError("finish() of a staged MPI buffer was called twice")
            done = True
            if write:
                wire.copy_(host)
            self._give(raw, tensor.is_cuda)

        return host.numpy(), finish

    def _take(self, nbytes: int, pinned: bool) -> torch.Tensor:
        with self._lock:
            free = self._free.get((nbytes, pinned))
            if free:
                return free.pop()
        # Pinned memory needs CUDA; a CPU tensor (tests, or a CPU fallback) stages in plain memory.
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=pinned)

    def _give(self, raw: torch.Tensor, pinned: bool) -> None:
        with self._lock:
            self._free.setdefault((raw.numel(), pinned), []).append(raw)

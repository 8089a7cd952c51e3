"""The mpi backend's compiled calls: checks, post and poll of its common calls in C++.

A blocking collective on the Python path (``comm.all_reduce(t)`` with ``async_op=False``) checks
its tensors, posts the non-blocking MPI call, builds an ``MPIWork`` and polls it: some thirty
Python steps. Each costs about a microsecond when the transfer before it has left the caches
cold, which at 1 MiB is 10-40 % of the MPI call itself. ``_compiled_*.cpp`` make the same checks
on the tensors' C++ side, post the same MPI call and poll it with ``Test()``, in one call from
Python; ``batch_isend_irecv`` posts its transfers and makes their works there too.

When it is used: CPU tensors of a dtype MPI sums natively (float32/64, int8-int64, uint8) that
an earlier call checked, in a blocking all_reduce, reduce_scatter, all_gather, all_to_all (equal
splits), broadcast, reduce, gather or scatter, with ``ReduceOp.SUM`` for the reductions, or in a
``batch_isend_irecv``, on a communicator with nothing pending, no profiler and debug ``OFF``.
Every other call, and every call whose arguments the compiled checks decline (anything the
Python short path would not take), takes the Python path unchanged, which raises what it
raises. A collective still pending after :data:`BUDGET_S` becomes a pending ``MPIWork`` in the
communicator (timeout, signals, stall handling as on the Python path).

How it is built: on the first communicator with more than one rank, with
:func:`torch.utils.cpp_extension.load` (a C++ compiler and ``ninja``; 20-120 s once, then cached
in :func:`build_directory`). It does not link MPI: it finds the MPI functions in the library
mpi4py loaded, and uses the MPICH ABI (MPICH >= 3.1, Intel MPI, MVAPICH, Cray MPICH: every
handle an int), so it is used only when mpi4py runs on that ABI and has
``MPI.Request.fromhandle`` (mpi4py >= 4). ``GRADCOMM_MPI_COMPILED=0`` turns it off, ``=1`` makes
a communicator raise when it cannot be used; unset, it is used where it can be, and a
:class:`~gradcomm.SlowPathWarning` says why when it cannot.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import logging
import os
import re
import sys
import time
import warnings
from pathlib import Path
from types import MethodType, ModuleType
from typing import Any

import torch
from mpi4py import MPI

from ..._env_flag import env_flag
from ..._p2p import TAG_LIMIT, P2PKind, P2POp, PointToPoint
from ...errors import SlowPathWarning
from ...types import ReduceOp
from ...work import CompletedWork, Description, Work
from .dtypes import SUM_FAST, predefined_datatype
from .work import MPIWork

__all__ = ["BUDGET_S", "ENV", "STALE_LOCK_S", "bind_batch", "build_directory", "calls", "load",
           "unavailable_reason", "wait_for_lock"]

logger = logging.getLogger("gradcomm.comm.mpi")

#: The environment variable that turns the compiled calls off (0) or makes them required (1).
ENV = "GRADCOMM_MPI_COMPILED"
#: Seconds a compiled call polls before it hands a pending collective back to Python (which
#: then waits out the communicator's timeout, answering signals meanwhile).
BUDGET_S = 0.1
_SOURCES = [str(Path(__file__).with_name(f"_compiled_{part}.cpp"))
            for part in ("module", "state", "collectives", "transfers", "transfer_work")
            ]  # and _compiled.h
#: Seconds after which a build lock is taken to be left by a killed build (a build takes less).
STALE_LOCK_S = 300.0
#: MPI_COMM_WORLD's handle in the MPICH ABI.
_MPICH_COMM_WORLD = 0x44000000
#: Names of the MPICH-ABI library mpi4py may have loaded, most common first.
_LIBRARIES = ("libmpi.so.12", "libmpi_cray.so.12", "libmpi.so")


def _module_name() -> str:
    """One name per torch build: an extension built against another torch must not be loaded."""
    return "gradcomm_mpi_compiled_" + re.sub(r"\W", "_", torch.__version__)


@functools.cache
def _load() -> tuple[ModuleType | None, str]:
    """Build (once) and bind the extension; (module, "") or (None, why not)."""
    if MPI.COMM_WORLD.handle & 0xFFFFFFFF != _MPICH_COMM_WORLD:
        return None, f"MPI library is not of the MPICH ABI ({MPI.Get_library_version()[:40]!r})"
    if not hasattr(MPI.Request, "fromhandle"):
        return None, f"mpi4py {MPI.Get_version()} lacks Request.fromhandle (needs mpi4py >= 4)"
    try:
        module = _build()
    except Exception as exc:  # noqa: BLE001 - any build failure means the Python path
        return None, f"the C++ build failed: {_first_error(str(exc))}"
    for name in _LIBRARIES:
        try:
            module.bind(name, MPI.SUM.handle, MPI.BYTE.handle)
            break
        except OSError:
            continue
    else:
        return None, "no MPICH-ABI libmpi is loaded in this process"
    module.set_datatypes({d: predefined_datatype(d).handle for d in SUM_FAST})
    module.set_types(CompletedWork, MPIWork, Description, P2POp, P2PKind.SEND, P2PKind.RECV,
                     ReduceOp.SUM, MPI.Request.fromhandle, TAG_LIMIT,
                     _transfer_work_class(module), Work.wait, BUDGET_S,
                     PointToPoint.batch_isend_irecv)
    return module, ""


def _transfer_work_class(module: ModuleType) -> type[MPIWork]:
    """The class of the works a compiled ``batch_isend_irecv`` returns: an :class:`MPIWork`
    whose state is in slots, which the compiled code reads and writes at their offsets (it sets
    every one when it makes a work); whose request is an MPI handle (``_handle``, None once
    complete); whose description is built from its parts (``_said``) when first read; and whose
    ``wait``, ``_wait`` and ``_test`` are ``module``'s (``_compiled_transfer_work.cpp``). A wait
    runs no Python code unless it has a timeout argument or callbacks, or the transfer is still
    pending after :data:`BUDGET_S`, when ``Work.wait`` takes over."""
    namespace = {"__module__": __name__, "__doc__": _transfer_work_class.__doc__,
                 "__slots__": _TRANSFER_SLOTS, "_description": property(_described),
                 **module.transfer_methods}
    return type("TransferWork", (MPIWork,), namespace)


#: The slots of a compiled transfer's work (see _transfer_work_class and set_types).
_TRANSFER_SLOTS = ("_said", "_handle", "_polling", "timeout", "_keepalive", "_inflight",
                   "_on_timeout", "_target", "_expect_bytes", "_done", "_failure", "_callbacks",
                   "_error", "_running")


def _described(work: Any) -> Description:
    """A compiled transfer work's Description, made from its parts when first read."""
    said = work._said
    if said.__class__ is tuple:
        said = work._said = Description(*said)
    return said  # type: ignore[no-any-return]


def build_directory() -> Path:
    """Where the extension is built and cached: ``TORCH_EXTENSIONS_DIR`` (default
    ``~/.cache/torch_extensions``) ``/gradcomm-py<version>/<name>``, one per Python and torch."""
    from torch.utils import cpp_extension

    root = os.environ.get("TORCH_EXTENSIONS_DIR") or cpp_extension.get_default_build_root()
    return Path(root, f"gradcomm-py{sys.version_info[0]}{sys.version_info[1]}", _module_name())


def _build() -> ModuleType:
    """``torch.utils.cpp_extension.load`` of the sources, with this environment's ninja first on
    PATH (another ninja reads the cached build as stale and rebuilds it) after a stale lock of a
    killed build is cleared (:func:`wait_for_lock`)."""
    from torch.utils import cpp_extension

    directory = build_directory()
    directory.mkdir(parents=True, exist_ok=True)
    wait_for_lock(directory / "lock")
    path = os.environ.get("PATH", "")
    bins = [str(Path(sys.executable).parent)]
    with contextlib.suppress(ImportError, AttributeError):  # the PyPI package the extra brings
        bins.insert(0, str(importlib.import_module("ninja").BIN_DIR))
    os.environ["PATH"] = os.pathsep.join([*bins, path])
    start = time.monotonic()
    logger.info("building or loading the compiled MPI calls in %s (a first build takes "
                "20-120 s)", directory)
    try:
        cpp_extension.verify_ninja_availability()
        module: ModuleType = cpp_extension.load(
            _module_name(), _SOURCES, extra_cflags=["-O2"], build_directory=str(directory),
            verbose=False)
    finally:
        os.environ["PATH"] = path
    logger.info("compiled MPI calls ready in %.1f s", time.monotonic() - start)
    return module


def wait_for_lock(lock: Path, stale_s: float = STALE_LOCK_S, poll_s: float = 0.5) -> None:
    """Return once no build holds ``lock`` (torch's build lock file). A lock older than
    ``stale_s`` seconds is left by a build that was killed (SIGTERM from ``timeout`` or a job
    scheduler skips its clean-up) and would make torch wait for ever: it is removed, with a
    warning."""
    warned = False
    while True:
        try:
            age = time.time() - lock.stat().st_mtime
        except FileNotFoundError:
            return
        if age > stale_s:
            logger.warning("removing %s, a build lock %.0f s old (a killed build left it)", lock,
                           age)
            lock.unlink(missing_ok=True)
            return
        if not warned:
            logger.warning("waiting for another process's build of the compiled MPI calls (%s; "
                           "removed as stale after %.0f s)", lock, stale_s)
            warned = True
        time.sleep(poll_s)


def _first_error(text: str) -> str:
    """The line of a build failure that says what went wrong (the first naming an error, else the
    last), at most 200 characters."""
    lines = [line.strip() for line in text.strip().splitlines() if line.strip()] or ["no output"]
    named = [line for line in lines if "error" in line.lower()]
    return (named[0] if named else lines[-1])[:200]


def unavailable_reason() -> str:
    """Why the compiled calls cannot be used in this process ("" when they can; builds them)."""
    setting = env_flag(ENV, None)
    if setting is False:
        return f"{ENV}=0"
    return _load()[1]


def load() -> ModuleType | None:
    """The extension module, or None when it is off or cannot be used (a warning, once, says
    why).

    Raises:
        ValueError: ``GRADCOMM_MPI_COMPILED`` is not an on/off word.
        RuntimeError: ``GRADCOMM_MPI_COMPILED=1`` and it cannot be used.
    """
    setting = env_flag(ENV, None)
    if setting is False:
        return None
    module, reason = _load()
    if module is None:
        if setting:
            raise RuntimeError(f"{ENV}=1 but the compiled MPI calls cannot be used: {reason}")
        _warn_once(reason)
    return module


@functools.cache
def _warn_once(reason: str) -> None:
    text = (f"compiled MPI calls off ({reason}): blocking collectives take the Python path, "
            f"slower by 5-60 % at 1 MiB; set {ENV}=0 to silence this")
    logger.warning(text)
    warnings.warn(text, SlowPathWarning, stacklevel=2)


def calls(owner: Any, comm: Any, size: int, rank: int, wanted: bool) -> Any:
    """The compiled calls of communicator ``owner`` on ``comm`` (its ``MPI.Intracomm`` of ``size``
    ranks), or None: off, or not ``wanted`` (one rank, device memory). They read ``owner``'s
    state on each call (closed, debug, profiler, pending works, device adapter, stall, cached
    dtypes: see ``enter`` and ``plain`` in ``_compiled_state.cpp``) and hold it weakly.

    Raises:
        ValueError: ``GRADCOMM_MPI_COMPILED`` is not an on/off word (whatever ``wanted``).
        RuntimeError: ``GRADCOMM_MPI_COMPILED=1``, ``wanted`` and they cannot be used.
    """
    if not wanted or size < 2:
        env_flag(ENV, None)  # a typo raises on every rank, also where nothing is built
        return None
    module = load()  # reads and checks the variable
    return None if module is None else module.Calls(owner, comm.handle, size, rank, BUDGET_S)


def bind_batch(comm: Any) -> None:
    """Make ``comm.batch_isend_irecv`` the compiled one, bound to ``comm`` (it holds ``comm`` as a
    bound method does), when ``comm``'s class has :meth:`PointToPoint.batch_isend_irecv` (a
    subclass's override is left alone): a ring exchange then runs no Python frame of gradcomm's.
    It uses ``comm``'s compiled calls (``comm._compiled``), or that method for a batch they
    decline. If the class's method is replaced later (a patch), it unbinds itself and calls the
    replacement, as Python's lookup finds it. ``comm``'s ``close()`` unbinds it."""
    module, _ = _load()
    if module is not None and type(comm).batch_isend_irecv is PointToPoint.batch_isend_irecv:
        vars(comm)["batch_isend_irecv"] = MethodType(module.batch_isend_irecv, comm)

"""Blocking MPI collectives in one compiled call: the checks, the post and the poll in C++.

A blocking collective on the Python path (``comm.all_reduce(t)`` with ``async_op=False``) checks
its tensors, posts the non-blocking MPI call, builds an :class:`~gradcomm.comm.MPIWork` and polls
it: some thirty Python steps. Each costs about a microsecond when the transfer before it has
left the caches cold, which at 1 MiB is 10-40 % of the MPI call itself. ``_compiled_*.cpp`` make
the same checks on the tensors' C++ side, posts the same MPI call and polls it with ``Test()``,
in one call from Python.

When it is used: CPU tensors of a dtype MPI sums natively (float32/64, int8-int64, uint8), in a
blocking call of all_reduce, reduce_scatter, all_gather, all_to_all (equal splits), broadcast,
reduce, gather or scatter, with ``ReduceOp.SUM`` for the reductions, on a communicator with
nothing pending, no profiler and debug ``OFF``. Every other call, and every call whose
arguments the compiled checks decline (anything the Python short path would not take), takes
the Python path unchanged, which raises what it raises. A collective still pending after
:data:`BUDGET_S` is handed back to the Python path as an ``MPIWork`` (timeout, signals, stall
handling as usual).

How it is built: on first use in a process, with :func:`torch.utils.cpp_extension.load` (a C++
compiler and ``ninja``; about 20-60 s once, then cached under ``TORCH_EXTENSIONS_DIR``, by
default ``~/.cache/torch_extensions``). It does not link MPI: it finds the MPI functions in the
library mpi4py loaded, and uses the MPICH ABI (MPICH >= 3.1, Intel MPI, MVAPICH, Cray MPICH:
every handle an int), so it is used only when mpi4py runs on that ABI and has
``MPI.Request.fromhandle`` (mpi4py >= 4). ``GRADCOMM_MPI_COMPILED=0`` turns it off, ``=1``
makes a communicator raise when it cannot be used; unset, it is used where it can be and a
warning on the ``gradcomm.comm.mpi`` logger says why when it cannot.
"""

from __future__ import annotations

import functools
import logging
import re
from pathlib import Path
from types import ModuleType
from typing import Any

import torch
from mpi4py import MPI

from ..._env_flag import env_flag
from ..._p2p import TAG_LIMIT, P2PKind, P2POp
from ...types import ReduceOp
from ...work import CompletedWork, Description
from .dtypes import SUM_FAST, predefined_datatype
from .work import MPIWork

__all__ = ["BUDGET_S", "ENV", "load", "unavailable_reason"]

logger = logging.getLogger("gradcomm.comm.mpi")

#: The environment variable that turns the compiled calls off (0) or makes them required (1).
ENV = "GRADCOMM_MPI_COMPILED"
#: Seconds a compiled call polls before it hands a pending collective back to Python (which
#: then waits out the communicator's timeout, answering signals meanwhile).
BUDGET_S = 0.1
_SOURCES = [str(Path(__file__).with_name(f"_compiled_{part}.cpp"))
            for part in ("module", "state", "collectives", "transfers")]  # and _compiled.h
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
        from torch.utils import cpp_extension

        cpp_extension.verify_ninja_availability()
        module = cpp_extension.load(_module_name(), _SOURCES, extra_cflags=["-O2"],
                                    verbose=False)
    except Exception as exc:  # noqa: BLE001 - any build failure means the Python path
        return None, f"the C++ build failed: {str(exc).strip().splitlines()[-1][:120]}"
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
                     ReduceOp.SUM, MPI.Request.fromhandle, MPI.Status, TAG_LIMIT)
    return module, ""


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
    logger.warning("compiled MPI calls off (%s): blocking collectives take the Python path; "
                   "set %s=0 to silence this", reason, ENV)


def calls(owner: Any, comm: Any, size: int, rank: int) -> Any:
    """The compiled calls of communicator ``owner`` on ``comm`` (its ``MPI.Intracomm`` of
    ``size`` >= 2 ranks), or None. They read ``owner``'s state on each call (closed, debug,
    profiler, pending works, device adapter, stall, cached dtypes: see ``enter`` and ``plain``
    in ``_compiled_state.cpp``) and hold it weakly."""
    module = load()
    return None if module is None else module.Calls(owner, comm.handle, size, rank, BUDGET_S)

"""The MPI backend: collectives over mpi4py (see :mod:`.communicator` for its capability table).

One concept per module: :mod:`.communicator` (the :class:`MPICommunicator`), :mod:`.work`
(request handles and how waiting polls MPI), :mod:`.ops16` (16-bit user-defined reduction ops),
:mod:`.scratch` (float32 upcast buffers), :mod:`.dtypes` (dtype and op maps), :mod:`.support`
(the capability answers).
"""

from __future__ import annotations

from ..._mpi_defaults import apply_mpich_defaults

# Before MPI starts (importing mpi4py.MPI starts it): MPICH reads its variables in MPI_Init, so
# the imports below come after this call.
apply_mpich_defaults()

try:
    from mpi4py import MPI  # noqa: F401 - imported first, for this error message
    from mpi4py.util import dtlib  # noqa: F401
except ImportError as _exc:  # pragma: no cover - exercised by a subprocess test
    raise ImportError(
        "the mpi backend needs the mpi4py package and an MPI library: pip install mpi4py mpich"
    ) from _exc

from ..._mpi_abort import (  # noqa: E402
    ABORT_ENV_VAR,
    abort_on_error_enabled,
    install_abort_hook,
)
from .communicator import MPICommunicator  # noqa: E402
from .work import MPIWork  # noqa: E402

__all__ = [
    "MPICommunicator",
    "MPIWork",
    "install_abort_hook",
    "abort_on_error_enabled",
    "ABORT_ENV_VAR",
]

"""Defaults for MPICH's choice of collective algorithms, set before MPI starts if the user set none.

gradcomm's mpi backend posts only non-blocking collectives (a wait on one can time out; a
blocking MPI call cannot), and MPICH chooses their algorithms apart from the blocking ones'. For
``MPI_Ireduce_scatter_block`` its automatic choice measured several times slower than the
blocking ``MPI_Reduce_scatter_block`` from 1 MiB up (MPICH 5.0.2, 2 ranks on one host: 1 MiB
about 1.0-3.3 ms against 0.16 ms, docs/bench.md), while its pairwise exchange
(``sched_pairwise``, one of the values MPICH documents for
``MPIR_CVAR_IREDUCE_SCATTER_BLOCK_INTRA_ALGORITHM``) took the blocking call's time at every size
measured (8 KiB to 4 MiB). MPICH falls back to its own choice where a forced algorithm does not
apply.

MPICH reads these variables once, in ``MPI_Init``, which importing ``mpi4py.MPI`` calls; so
:func:`apply_mpich_defaults` runs before gradcomm first imports it (in :func:`gradcomm.init` and
when the mpi backend is imported) and changes nothing once ``mpi4py.MPI`` is imported. A variable
already in the environment, whatever its value, is left as it is (``auto`` restores MPICH's own
choice). Other MPI libraries ignore ``MPIR_CVAR_*`` variables.
"""

from __future__ import annotations

import os
import sys
from collections.abc import MutableMapping

__all__ = ["MPICH_DEFAULTS", "apply_mpich_defaults", "applied_defaults"]

#: Variable -> value set when the variable is unset (see the module docstring).
MPICH_DEFAULTS: dict[str, str] = {
    "MPIR_CVAR_IREDUCE_SCATTER_BLOCK_INTRA_ALGORITHM": "sched_pairwise",
}


def apply_mpich_defaults(env: MutableMapping[str, str] | None = None) -> dict[str, str]:
    """Set each of :data:`MPICH_DEFAULTS` that ``env`` (default ``os.environ``) lacks, unless
    ``mpi4py.MPI`` is imported already (MPI started: too late to matter).

    Returns:
        The variables set, with their values (empty when none was).
    """
    if "mpi4py.MPI" in sys.modules:
        return {}
    process = env is None
    env = os.environ if env is None else env
    applied = {name: value for name, value in MPICH_DEFAULTS.items() if name not in env}
    env.update(applied)
    if process:
        _applied.update(applied)
    return applied


def applied_defaults() -> dict[str, str]:
    """The variables :func:`apply_mpich_defaults` set in ``os.environ`` in this process."""
    return dict(_applied)


_applied: dict[str, str] = {}

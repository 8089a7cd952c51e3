"""Run under ``mpiexec -n 2`` with ``GRADCOMM_MPI_COMPILED=1`` and a ``TORCH_EXTENSIONS_DIR`` that
cannot be created: ``gradcomm.init("mpi")`` must raise RuntimeError on every rank. Prints
``RESULT required raised rank=<r> <message>`` (or ``RESULT required returned``)."""

from __future__ import annotations

from mpi4py import MPI

import gradcomm

try:
    gradcomm.init("mpi").close()
    print("RESULT required returned", flush=True)
except RuntimeError as exc:
    print(f"RESULT required raised rank={MPI.COMM_WORLD.Get_rank()} {exc}", flush=True)

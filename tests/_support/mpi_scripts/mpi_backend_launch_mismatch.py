"""Explicit ``rank``/``world_size`` that disagree with MPI's raise on *every* rank, not only on the
ranks whose values are wrong.

Usage: ``mpiexec -n N python mpi_backend_launch_mismatch.py CASE``. ``same``: every rank passes
``rank=0`` (rank 0's values match MPI's, so before the check agreed across ranks, rank 0 went on
into ``MPI_Comm_dup`` and waited forever for the rank that raised). ``size``: every rank passes its
own rank but a world size one too big. Prints ``RESULT mismatch rank=<r> <TypeName>: <message>``.
"""

from __future__ import annotations

import sys

from mpi4py import MPI

import gradcomm


def main() -> None:
    case = sys.argv[1]
    world = MPI.COMM_WORLD
    rank, size = world.Get_rank(), world.Get_size()
    explicit = {"same": (0, size), "size": (rank, size + 1)}[case]
    try:
        gradcomm.init("mpi", timeout=10, rank=explicit[0], world_size=explicit[1])
        print(f"RESULT mismatch rank={rank} no error", flush=True)
    except Exception as exc:  # noqa: BLE001 - the test checks type and message
        print(f"RESULT mismatch rank={rank} {type(exc).__name__}: {exc}", flush=True)


if __name__ == "__main__":
    main()

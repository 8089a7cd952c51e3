"""Run under ``mpiexec -n N``: the failure-case matrix of issue 5 on the MPI backend.

Usage: ``python failure_values.py CASE [CASE ...]`` (names from ``failure_common.CASES``). Every
rank runs the cases over ``gradcomm.init("mpi")``; rank 0 gathers the results (mpi4py's pickle
gather: test plumbing only) and verifies them with the same code as the gloo tests, printing
``RESULT case=<name> ok`` or ``RESULT case=<name> problems=<list>`` per case.
"""

from __future__ import annotations

import sys

import torch
from failure_common import run_cases, verify_case
from mpi4py import MPI

import gradcomm


def main() -> None:
    names = sys.argv[1:]
    torch.set_num_threads(1)  # two cores shared by every rank
    comm = gradcomm.init("mpi", timeout=60)
    out = run_cases(comm, names)
    comm.barrier()
    gathered = MPI.COMM_WORLD.gather(out, root=0)
    if comm.rank == 0:
        assert gathered is not None
        for name in names:
            problems = verify_case(name, gathered, comm.world_size)
            status = "ok" if not problems else f"problems={problems}"
            print(f"RESULT case={name} world={comm.world_size} {status}", flush=True)
    comm.close()


if __name__ == "__main__":
    main()

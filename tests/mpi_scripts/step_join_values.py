"""Run under ``mpiexec -n N``: the step-check and join cases of ``step_join_common.py`` on MPI.

Usage: ``python step_join_values.py CASE [CASE ...]``. Every rank runs the cases over
``gradcomm.init("mpi")``; rank 0 gathers the results (mpi4py's pickle gather: test plumbing only)
and verifies them with the same code as the gloo tests, printing one
``RESULT case=<name> world=<n> ok`` or ``... problems=<list>`` line per case.
"""

from __future__ import annotations

import sys

import torch
from mpi4py import MPI
from step_join_common import run_cases, verify_case

import gradcomm


def main() -> None:
    names = sys.argv[1:]
    torch.set_num_threads(1)  # the machine's cores are shared by every rank
    comm = gradcomm.init("mpi", timeout=60)
    out = run_cases(comm, names)
    comm.barrier()
    gathered = MPI.COMM_WORLD.gather(out, root=0)
    if comm.rank == 0:
        assert gathered is not None
        lines = []
        for name in names:
            problems = verify_case(name, gathered, comm.world_size)
            status = "ok" if not problems else f"problems={problems}"
            lines.append(f"RESULT case={name} world={comm.world_size} {status}\n")
        sys.stdout.write("".join(lines))
        sys.stdout.flush()
    comm.close()


if __name__ == "__main__":
    main()

"""Run under ``mpiexec -n N``: the cross-rank collective check's cases on one backend.

Usage: ``python consistency_job.py BACKEND CASE [CASE ...]`` (names from
``consistency_cases.CASES``). Every rank runs the cases over ``gradcomm.init(BACKEND)``; rank 0
gathers the outcomes (mpi4py's pickle gather: test plumbing only), verifies them and prints
``RESULT case=<name> world=<n> ok`` or ``... problems=<list>`` per case.
"""

from __future__ import annotations

import sys

import torch
from consistency_cases import run_cases, verify
from mpi4py import MPI

import gradcomm


def main() -> None:
    backend, names = sys.argv[1], sys.argv[2:]
    torch.set_num_threads(1)  # two cores shared by every rank
    comm = gradcomm.init(backend, timeout=60)
    out = run_cases(comm, names)
    gathered = MPI.COMM_WORLD.gather(out, root=0)
    if comm.rank == 0:
        assert gathered is not None
        for i, name in enumerate(names):
            problems = verify(name, [rank_out[i] for rank_out in gathered], comm.world_size)
            status = "ok" if not problems else f"problems={problems}"
            print(f"RESULT case={name} world={comm.world_size} {status}", flush=True)
    comm.close()


if __name__ == "__main__":
    main()

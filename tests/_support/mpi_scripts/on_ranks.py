"""Run under ``mpiexec -n N`` by ``ranks.RankRunner``: one case function on every rank.

Usage: ``python on_ranks.py JOB_DIR``. ``JOB_DIR/case.pkl`` holds ``(case, args, comm_timeout)``
(the case pickled by module and name, so the repository root must be on PYTHONPATH); every rank
calls ``case(comm, *args)`` over ``gradcomm.init("mpi")`` and writes ``torch.save`` of its result
to ``JOB_DIR/rank<r>.pt``. A rank that raises prints its traceback and aborts the whole job.
"""

from __future__ import annotations

import pickle
import sys
import traceback
from pathlib import Path

import torch

import gradcomm


def main(job: Path) -> None:
    case, args, comm_timeout = pickle.loads((job / "case.pkl").read_bytes())
    torch.set_num_threads(1)  # every rank shares the machine's cores
    with gradcomm.init("mpi", timeout=comm_timeout) as comm:
        result = case(comm, *args)
        torch.save(result, job / f"rank{comm.rank}.pt")


if __name__ == "__main__":
    try:
        main(Path(sys.argv[1]))
    except BaseException:  # noqa: BLE001 - one failing rank must end the whole job
        traceback.print_exc()
        sys.stdout.flush()
        from mpi4py import MPI

        MPI.COMM_WORLD.Abort(1)

"""Run under ``mpiexec -n 2``: rank 1 skips an all_reduce (and then hangs); rank 0 must time out.

argv: [limit seconds (2), backend (mpi)]. Rank 0 prints ``RESULT timeout elapsed=<s> limit=<s>``
after catching CollectiveTimeoutError; with the mpi backend it also checks that a later collective
raises RuntimeError (the communicator is broken). Then it re-raises: the abort hook ends the job
(rank 1 included) with a non-zero exit. With gloo the hook comes from the rendezvous through MPI,
which initialised MPI: without it, rank 0 would hang in MPI_Finalize at exit.
"""

from __future__ import annotations

import sys
import time

import torch

import gradcomm

LIMIT = float(sys.argv[1]) if len(sys.argv) > 1 else 2.0
BACKEND = sys.argv[2] if len(sys.argv) > 2 else "mpi"


def main() -> None:
    comm = gradcomm.init(BACKEND, timeout=LIMIT)
    comm.barrier()
    if comm.rank == 1:
        time.sleep(600)  # stopped calling collectives; only an abort ends this rank early
        return
    start = time.monotonic()
    try:
        comm.all_reduce(torch.ones(8), label="bucket 0")
    except gradcomm.CollectiveTimeoutError as exc:
        elapsed = time.monotonic() - start
        print(f"RESULT timeout elapsed={elapsed:.2f} limit={LIMIT} message={exc}", flush=True)
        if BACKEND != "mpi":
            raise
        try:
            comm.all_reduce(torch.ones(8))
        except RuntimeError as again:
            print(f"RESULT broken {again}", flush=True)
        raise
    sys.exit("rank 0: all_reduce completed although rank 1 never called it")


if __name__ == "__main__":
    main()

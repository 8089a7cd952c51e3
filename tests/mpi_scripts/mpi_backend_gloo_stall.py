"""Run under ``mpiexec -n 2`` with the gloo backend (rendezvous through MPI): rank 1 stalls.

Rank 0's all_reduce times out and the CollectiveTimeoutError is left uncaught. Because the gloo
rendezvous initialised MPI, the exit would otherwise hang in MPI_Finalize waiting for the stalled
rank; the abort hook installed by the rendezvous ends the whole job instead.
Prints ``RESULT gloo-timeout elapsed=<s>`` on rank 0 before re-raising.
"""

from __future__ import annotations

import sys
import time

import torch

import gradcomm

LIMIT = float(sys.argv[1]) if len(sys.argv) > 1 else 2.0


def main() -> None:
    comm = gradcomm.init("gloo", timeout=LIMIT)
    comm.barrier()
    if comm.rank == 1:
        time.sleep(600)  # stopped calling collectives; only an abort ends this rank early
        return
    start = time.monotonic()
    try:
        comm.all_reduce(torch.ones(8), label="bucket 0")
    except gradcomm.CollectiveTimeoutError:
        print(f"RESULT gloo-timeout elapsed={time.monotonic() - start:.2f}", flush=True)
        raise
    sys.exit("rank 0: all_reduce completed although rank 1 never called it")


if __name__ == "__main__":
    main()

"""Run under ``mpiexec -n 2``: rank 1 raises; rank 0 waits in a barrier with a long timeout.

With the abort hook (default) the job ends at once with a non-zero exit. With
``GRADCOMM_MPI_ABORT_ON_ERROR=0`` rank 0 is left waiting until its timeout (argv[1] seconds) and
prints ``RESULT barrier-timeout``.
"""

from __future__ import annotations

import sys

import gradcomm

LIMIT = float(sys.argv[1]) if len(sys.argv) > 1 else 300.0


def main() -> None:
    comm = gradcomm.init("mpi", timeout=LIMIT)
    comm.barrier()
    print(f"RESULT started rank={comm.rank}", flush=True)
    if comm.rank == 1:
        raise ValueError("deliberate failure on rank 1")
    try:
        comm.barrier()
    except gradcomm.CollectiveTimeoutError:
        print("RESULT barrier-timeout", flush=True)
        raise
    sys.exit("rank 0: barrier completed although rank 1 failed")


if __name__ == "__main__":
    main()

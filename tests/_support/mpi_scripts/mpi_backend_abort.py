"""Run under ``mpiexec -n 2``: rank 1 raises; rank 0 waits in a barrier with a long timeout.

With the abort hook (default) the job ends at once with a non-zero exit, rank 1's traceback
printed. With argv[2] ``torch``, the ranks use ``init_process_group("gradcomm")`` over the mpi
transport instead (torch's own excepthook then wraps gradcomm's). With
``GRADCOMM_MPI_ABORT_ON_ERROR=0`` rank 0 is left waiting until its timeout (argv[1] seconds) and
prints ``RESULT barrier-timeout``.
"""

from __future__ import annotations

import sys

import gradcomm

LIMIT = float(sys.argv[1]) if len(sys.argv) > 1 else 300.0
THROUGH_TORCH = sys.argv[2:] == ["torch"]


def main() -> None:
    if THROUGH_TORCH:
        _through_torch()
        return
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


def _through_torch() -> None:
    import datetime

    import torch.distributed as dist

    dist.init_process_group("gradcomm", timeout=datetime.timedelta(seconds=LIMIT))
    dist.barrier()
    print(f"RESULT started rank={dist.get_rank()}", flush=True)
    if dist.get_rank() == 1:
        raise ValueError("deliberate failure on rank 1")
    dist.barrier()
    sys.exit("rank 0: barrier completed although rank 1 failed")


if __name__ == "__main__":
    main()

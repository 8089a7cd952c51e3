"""Run under ``mpiexec -n 2`` (argv: backend, a scratch directory): a rank late by more than the
timeout mid-training.

Step 0 runs normally. In step 1 rank 1 arrives 3 s late with a 1.5 s timeout: rank 0's
``backward()`` raises CollectiveTimeoutError. On MPI, the collective rank 0 posted can still be
completed by rank 1 when it arrives, as long as rank 0 keeps calling into MPI; without the
reducer's refusal, rank 0's retries do, rank 1's step 1 succeeds, and from then on the ranks
average different steps' gradients without an error. Both ranks run four more steps, catching
every error, as a training loop that retries would. No rank may report a successful step after
its first failure: rank 0's reducer refuses (RuntimeError) without touching the communicator, and
rank 1's collectives then find no partner and time out.

Prints ``RESULT late rank=<r> steps=<outcome,...>`` per rank. The ranks then meet through files
in the scratch directory (their communicator cannot be trusted any more) and end with
``os._exit(0)``, because a collective that never found a partner would make MPI_Finalize wait for
it, and a rank that exits first makes mpiexec end the other.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import gradcomm
from gradcomm.hooks import GradientReducer

from tests._support.reducer_common import batch, eval_bn, loss_fn, make_model


def main() -> None:
    comm = gradcomm.init(sys.argv[1], timeout=1.5)
    model = eval_bn(make_model())
    GradientReducer(model, comm)
    outcomes = []
    for step in range(6):
        if step == 1 and comm.rank == 1:
            time.sleep(3.0)
        try:
            loss_fn(model, *batch(comm.rank, seed=step)).backward()
            outcomes.append("ok")
        except gradcomm.CollectiveTimeoutError:
            outcomes.append("timeout")
        except RuntimeError as exc:
            outcomes.append("refused" if "earlier backward pass failed" in str(exc) else "error")
        model.zero_grad()
        time.sleep(0.3)  # as a retrying loop would (its MPI calls drive the pending collective)
    print(f"RESULT late rank={comm.rank} steps={','.join(outcomes)}", flush=True)
    scratch = Path(sys.argv[2])
    (scratch / f"done.{comm.rank}").touch()
    deadline = time.monotonic() + 60
    while (len(list(scratch.glob("done.*"))) < comm.world_size
           and time.monotonic() < deadline):
        time.sleep(0.05)
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main()

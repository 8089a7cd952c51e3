"""One rank fails mid-backward; the others must end, with an error, within the timeout.

Usage: ``python failure_kill.py MODE SOURCE`` on every rank (under mpiexec, or with torchrun's
variables), MODE ``kill`` (the last rank SIGKILLs itself inside a gradient hook), ``raise`` (an
uncaught ValueError leaves that hook) or ``stall`` (it sleeps there for 10 minutes: stopped
calling collectives), SOURCE ``arg`` (``gradcomm.init(
timeout=argv[3])``) or ``env`` (``GRADCOMM_TIMEOUT``). Backend from ``GRADCOMM_BACKEND``.

Prints, flushed, ``RESULT step0 ok rank=<r>`` after a normal step, ``RESULT victim t=<epoch s>``
just before the victim fails, and on each survivor ``RESULT error rank=<r> type=<name>
elapsed=<s> message=<text>`` before re-raising (so the process exits non-zero; under mpiexec the
abort hook then ends the whole job).
"""

from __future__ import annotations

import os
import signal
import sys
import time

import torch

import gradcomm
from gradcomm.hooks import GradientReducer

from tests._support.reducer_common import batch, eval_bn, loss_fn, make_model


def main() -> None:
    mode, source = sys.argv[1], sys.argv[2]
    torch.set_num_threads(1)
    comm = gradcomm.init(timeout=float(sys.argv[3]) if source == "arg" else None)
    rank, victim = comm.rank, comm.world_size - 1
    model = eval_bn(make_model())
    GradientReducer(model, comm, bucket_cap_mb=0.002, first_bucket_cap_mb=0.0005)
    loss_fn(model, *batch(rank)).backward()
    print(f"RESULT step0 ok rank={rank} timeout={comm.timeout}", flush=True)

    if rank == victim:
        def fail(_: torch.Tensor) -> None:
            print(f"RESULT victim t={time.time():.3f}", flush=True)
            if mode == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            if mode == "raise":
                raise ValueError(f"deliberate failure on rank {rank} mid-backward")
            time.sleep(600)

        # fc1's gradient arrives mid-backward: the buckets of the heads and fc2 are already sent
        model.fc1.weight.register_post_accumulate_grad_hook(fail)
    model.zero_grad()
    start = time.monotonic()
    try:
        loss_fn(model, *batch(rank, seed=2)).backward()
    except RuntimeError as exc:  # the victim's ValueError is not caught: it exits non-zero
        text = " ".join(str(exc).split())
        print(f"RESULT error rank={rank} type={type(exc).__name__} "
              f"elapsed={time.monotonic() - start:.2f} message={text}", flush=True)
        raise
    sys.exit(f"rank {rank}: the backward pass completed although rank {victim} failed")


if __name__ == "__main__":
    main()

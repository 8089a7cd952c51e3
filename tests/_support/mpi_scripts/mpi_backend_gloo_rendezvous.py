"""Run under ``mpiexec -n N`` without MASTER_ADDR/MASTER_PORT: gloo rendezvouses through MPI.

Prints ``RESULT gloo rank=<r> world=<n> sum=<value>``; exits non-zero on a wrong value.
"""

from __future__ import annotations

import os
import sys

import torch

import gradcomm


def main() -> None:
    for key in ("MASTER_ADDR", "MASTER_PORT"):
        if key in os.environ:
            sys.exit(f"{key} is set; this script tests the rendezvous through MPI")
    comm = gradcomm.init(timeout=30)  # GRADCOMM_BACKEND=gloo from the environment
    if comm.backend != "gloo":
        sys.exit(f"expected the gloo backend from GRADCOMM_BACKEND, got {comm.backend}")
    t = torch.arange(6, dtype=torch.float32) + comm.rank
    comm.all_reduce(t)
    world = comm.world_size
    expect = torch.arange(6, dtype=torch.float32) * world + sum(range(world))
    if not torch.equal(t, expect):
        sys.exit(f"rank {comm.rank}: gloo all_reduce gave {t.tolist()}, expected {expect.tolist()}")
    comm.close()
    print(f"RESULT gloo rank={comm.rank} world={world} sum={t.sum().item()}", flush=True)


if __name__ == "__main__":
    main()

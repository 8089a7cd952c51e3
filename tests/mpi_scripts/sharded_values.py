"""Run under ``mpiexec -n N``: ShardedOptimizer (stages 1 and 2) equals unsharded training on the
backend of ``GRADCOMM_BACKEND`` (the test sets ``mpi``), bit-identical across ranks, and bad input
raises on every rank (see sharded_checks.py). Prints ``RESULT ok rank=<r> world=<n> cases=<k>``;
a wrong value raises AssertionError naming the case (non-zero exit)."""

from __future__ import annotations

import torch
from sharded_checks import bad_input_cases, value_cases

import gradcomm


def main() -> None:
    torch.set_num_threads(1)
    with gradcomm.init() as comm:
        done = value_cases(comm) + bad_input_cases(comm)
        print(f"RESULT ok rank={comm.rank} world={comm.world_size} cases={len(done)} "
              f"backend={comm.backend} {' '.join(done)}", flush=True)


if __name__ == "__main__":
    main()

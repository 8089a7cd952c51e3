"""Run under ``mpiexec -n N``: the collectives beyond all_reduce against the torch reference.

Runs every case of tests/coll_cases.py on the mpi backend; prints ``RESULT ok rank=<r>
world=<n> <counts>`` on success (a wrong value raises, and the abort hook ends the job non-zero).
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # tests/: the shared cases

from coll_cases import FLOATS, HALF, INTS, run_all

import gradcomm

with gradcomm.init("mpi", timeout=60) as comm:
    counts = run_all(comm, FLOATS + INTS + HALF + [torch.int16, torch.bool])
    line = " ".join(f"{k}={v}" for k, v in sorted(counts.items()))
    print(f"RESULT ok rank={comm.rank} world={comm.world_size} {line}", flush=True)

"""Run :func:`fake_device_checks.run_device_checks` on every rank of an MPI job.

``mpiexec -n N python tests/mpi_scripts/fake_device.py``; prints one line per rank and exits 1
(after every rank has printed) when anything differed between the CPU and the fake device.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: the harness modules

import torch
from fake_device_checks import run_device_checks

import gradcomm

torch.set_num_threads(1)
with gradcomm.init("mpi", timeout=120) as comm:
    result = run_device_checks(comm)
    bad = {k: v for k, v in result.items() if v}
    if bad:
        print(f"fake-device rank {comm.rank}: differs: {bad}", flush=True)
    else:
        print(f"fake-device rank {comm.rank}: {len(result)} checks, all equal", flush=True)
    comm.barrier()
sys.exit(1 if bad else 0)

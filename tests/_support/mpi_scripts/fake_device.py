"""Run :func:`fake_device_checks.run_device_checks` on every rank of an MPI job.

``mpiexec -n N python tests/_support/mpi_scripts/fake_device.py`` (the repository root on
PYTHONPATH); prints one line per rank and exits 1 (after every rank has printed) when anything
differed between the CPU and the fake device.
"""

from __future__ import annotations

import sys

import torch

import gradcomm

from tests._support.fake_device_checks import run_device_checks

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

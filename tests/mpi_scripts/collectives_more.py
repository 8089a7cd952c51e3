"""Run under ``mpiexec -n N``: the collectives beyond all_reduce against the torch reference.

Runs every case of tests/coll_cases.py on the mpi backend, then again through the device-buffer
path without a GPU (mpi_backend_staging.py's staged fake adapter, and the real
``DeviceBufferAdapter`` staging through host memory), on fewer dtypes. Prints ``RESULT ok
rank=<r> world=<n> <counts>`` on success (a wrong value raises, and the abort hook ends the job
non-zero).
"""

from __future__ import annotations

import sys
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # tests/: the shared cases

from coll_cases import FLOATS, HALF, INTS, run_all
from mpi_backend_staging import FakeAdapter

import gradcomm
from gradcomm.comm.backends.mpi_device import DeviceBufferAdapter

with gradcomm.init("mpi", timeout=60) as comm:
    counts = run_all(comm, FLOATS + INTS + HALF + [torch.int16, torch.bool])
    few = [torch.float32, torch.int32, torch.bfloat16]
    warnings.simplefilter("ignore", gradcomm.SlowPathWarning)  # the staging path says it is slow
    for adapter in (FakeAdapter(staged=True), DeviceBufferAdapter(False, synchronize=lambda: None)):
        comm._adapter = adapter  # the device-buffer path (CuPy or staging), without a GPU
        staged = run_all(comm, few)
        counts["device_path"] = counts.get("device_path", 0) + sum(staged.values())
    comm._adapter = None
    line = " ".join(f"{k}={v}" for k, v in sorted(counts.items()))
    print(f"RESULT ok rank={comm.rank} world={comm.world_size} {line}", flush=True)

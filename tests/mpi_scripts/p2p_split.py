"""Run under ``mpiexec -n N``: send/recv/batch_isend_irecv, split/split_by_host and the
hierarchical all-reduce on the MPI backend against a single-process reference
(``tests/p2p_split_checks.py``).

Prints ``RESULT p2p_split ok rank=<r> world=<n> checks=<k>``; a wrong value raises
AssertionError naming the case (the abort hook then ends the job non-zero).
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # tests/: the shared checks

from mpi_backend_staging import FakeAdapter
from p2p_split_checks import (
    check_children_closed,
    expect_error,
    run_hierarchical_checks,
    run_p2p_checks,
    run_split_checks,
)

import gradcomm
from gradcomm.comm.backends.mpi_device import DeviceBufferAdapter


def main() -> None:
    comm = gradcomm.init("mpi", timeout=60)
    checks = run_p2p_checks(comm) + run_split_checks(comm) + run_hierarchical_checks(comm)
    if comm.world_size > 1:  # MPI accepts a shorter message; the receive checks the count
        if comm.rank == 0:
            comm.send(torch.zeros(3), 1)
        elif comm.rank == 1:
            work = comm.recv(torch.zeros(4), 0, async_op=True)
            expect_error(RuntimeError, work.wait, "received 12 bytes")
        checks += 1
    # the device-buffer path (CuPy views or host staging) without a GPU, as collectives_more.py
    for adapter in (FakeAdapter(staged=True), DeviceBufferAdapter(False, synchronize=lambda: None)):
        comm._adapter = adapter
        checks += run_p2p_checks(comm)
    comm._adapter = None
    rank, size = comm.rank, comm.world_size
    checks += check_children_closed(comm)
    sys.stdout.write(f"RESULT p2p_split ok rank={rank} world={size} checks={checks}\n")
    sys.stdout.flush()


if __name__ == "__main__":
    main()

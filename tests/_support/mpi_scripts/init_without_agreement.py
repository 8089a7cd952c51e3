"""Where ``gradcomm.init`` must NOT run its MPI settings agreement (or must survive mpi4py being
imported without MPI_Init), under an MPI launcher, in a process of its own. (A process-local
communicator on one rank, and a placement given on one rank only, are tests of the module tier:
``tests/comm/suite_init.py``.)

Usage: ``mpiexec -n N python init_without_agreement.py CASE``, except ``torchrun_inside``,
which is started as ``mpiexec -n 1 torchrun --nproc-per-node 2 ... init_without_agreement.py
torchrun_inside``. Prints ``RESULT noagree <case> rank=<r> <value>``.

* ``torchrun_inside``: torchrun started by mpiexec; torchrun's variables win, and the workers,
  which MPI did not start, must not initialise MPI (PMI_Init fails there).
* ``local_vs_global``: rank 1 builds a process-local communicator (an ``env`` without the
  launcher's variables) while rank 0 builds a job-wide one: rank 0 raises CollectiveTimeoutError
  after its 1.5 s timeout instead of waiting forever.
* ``retry_after_timeout``: rank 1 arrives 3 s late; rank 0's check times out after 1 s, and its
  second ``init`` is refused (its first request is still pending; before, the retry paired with
  rank 1's late check and read garbage sizes); rank 1's check times out too.
* ``info_first``: ``gradcomm.info.collect_info()`` (imports mpi4py without initialising MPI),
  then ``gradcomm.init("gloo")`` with a store address: the agreement initialises MPI itself.
"""

from __future__ import annotations

import os
import sys
import time

import torch

import gradcomm


def main() -> None:
    case = sys.argv[1]
    if case == "torchrun_inside":
        with gradcomm.init("gloo", timeout=30) as comm:
            t = torch.full((3,), float(comm.rank + 1))
            comm.all_reduce(t)
            mpi = "mpi4py" in sys.modules
            print(f"RESULT noagree {case} rank={comm.rank} {t.tolist()} mpi4py={mpi}", flush=True)
        return
    if case == "info_first":
        from gradcomm.info import collect_info

        collect_info()
        os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", sys.argv[2]
        with gradcomm.init("gloo", timeout=30) as comm:
            t = torch.full((3,), float(comm.rank + 1))
            comm.all_reduce(t)
            print(f"RESULT noagree {case} rank={comm.rank} {t.tolist()}", flush=True)
        return
    if case == "local_vs_global":  # rank 1 builds a process-local communicator, rank 0 waits
        from mpi4py import MPI  # every rank initialises MPI (else rank 0 waits in MPI_Init)

        rank = MPI.COMM_WORLD.Get_rank()
        try:
            if rank == 1:
                comm = gradcomm.init(env={"GRADCOMM_BACKEND": "gloo"})
            else:
                comm = gradcomm.init("gloo", timeout=1.5)
            print(f"RESULT noagree {case} rank={rank} world={comm.world_size}", flush=True)
            comm.close()
        except Exception as exc:  # noqa: BLE001 - the test checks type and message
            print(f"RESULT noagree {case} rank={rank} {type(exc).__name__}: {exc}", flush=True)
        if rank == 1:
            time.sleep(3)  # stay until rank 0's timeout has fired
        return
    if case == "retry_after_timeout":  # rank 1 is late; rank 0 times out, then tries again
        from mpi4py import MPI

        rank = MPI.COMM_WORLD.Get_rank()
        attempts = [1.0, 10.0] if rank == 0 else [1.0]
        if rank == 1:
            time.sleep(3)
        for seconds in attempts:
            try:
                gradcomm.init("gloo", timeout=seconds).close()
                outcome = "ok"
            except Exception as exc:  # noqa: BLE001 - the test checks type and message
                outcome = f"{type(exc).__name__}: {str(exc)[:60]}"
            print(f"RESULT noagree {case} rank={rank} t={seconds:g} {outcome}", flush=True)
        return
    raise SystemExit(f"unknown case {case!r}")

if __name__ == "__main__":
    main()

"""World size 1 with the mpi backend (plain ``python`` or ``mpiexec -n 1``) issues no collective.

Counts calls to every ``MPICommunicator._<collective>`` hook; prints
``RESULT single calls=<n> launcher=<name>`` and exits non-zero on a wrong value. Also checks that
``device="cuda"`` without CUDA raises BackendUnavailableError.
"""

from __future__ import annotations

import sys

import torch

import gradcomm
from gradcomm.comm.backends.mpi.communicator import MPICommunicator

calls: list[str] = []


def _counting(name: str) -> None:
    original = getattr(MPICommunicator, name)

    def wrapper(self: MPICommunicator, *args: object) -> object:
        calls.append(name)
        return original(self, *args)

    setattr(MPICommunicator, name, wrapper)


def main() -> None:
    for name in ("_all_reduce", "_broadcast", "_all_gather", "_barrier"):
        _counting(name)
    comm = gradcomm.init("mpi", timeout=10)
    if not isinstance(comm, MPICommunicator):
        sys.exit(f"expected an MPICommunicator, got {type(comm).__name__}")
    if comm.world_size != 1 or comm.rank != 0:
        sys.exit(f"expected a single rank, got rank {comm.rank} of {comm.world_size}")
    t = torch.arange(5, dtype=torch.float32)
    comm.all_reduce(t, "sum")
    comm.all_reduce(t, "avg")
    h = torch.full((4,), 1.5, dtype=torch.bfloat16)
    comm.all_reduce(h, "sum", async_op=True).wait()
    comm.broadcast(t, src=0)
    out = torch.empty(5)
    comm.all_gather(out, t)
    comm.barrier()
    if not torch.equal(t, torch.arange(5, dtype=torch.float32)) or not torch.equal(out, t):
        sys.exit(f"world_size 1 changed values: {t} {out}")
    if not bool((h == 1.5).all()):
        sys.exit(f"world_size 1 changed bfloat16 values: {h}")
    comm.close()
    if not torch.cuda.is_available():
        try:
            gradcomm.init("mpi", device="cuda")
        except gradcomm.BackendUnavailableError as exc:
            print(f"RESULT cuda-unavailable {exc}")
        else:
            sys.exit("device='cuda' without CUDA did not raise BackendUnavailableError")
    launcher = comm.launch.launcher.value
    print(f"RESULT single calls={len(calls)} launcher={launcher} {' '.join(calls)}", flush=True)


if __name__ == "__main__":
    main()

"""A setting that is bad on one rank only raises on *every* rank of an mpiexec job.

Usage: ``mpiexec -n N python init_bad_setting_one_rank.py BACKEND CASE``. The last rank gets the
bad value (read from the launcher's variables: this script imports no MPI before ``init``, as a
training script would not); the other ranks get good ones. Before ``gradcomm.init`` agreed on
its settings across ranks, the bad rank raised alone and the others waited forever in the
backend's first MPI collective (or the rendezvous through MPI), so the job hung until killed.
Prints ``RESULT badset rank=<r> <TypeName>: <message>`` (or ``no error``), then, to show that the
ranks are still in step, ``RESULT after rank=<r> <sum>`` from a plain mpi4py all-reduce.
"""

from __future__ import annotations

import os
import sys

import gradcomm

CASES = {
    # case: (environment variable or None for an argument, bad value)
    "profile": ("GRADCOMM_PROFILE", "tru"),
    "abort": ("GRADCOMM_MPI_ABORT_ON_ERROR", "maybe"),
    "cuda_aware": ("GRADCOMM_MPI_CUDA_AWARE", "yes please"),
    "timeout_env": ("GRADCOMM_TIMEOUT", "ten"),
    "backend_env": ("GRADCOMM_BACKEND", "glooo"),
    "timeout_arg": (None, -1.0),
    "device_arg": (None, "tpu"),
    "other_backend": ("GRADCOMM_BACKEND", "other"),  # valid, but not what the others chose
    "device_meta": (None, "meta"),  # a device type the backend does not take
    "env_arg": (None, {"A": 1}),  # not a mapping of str to str
    "timeout_int": (None, 10**400),  # beyond float's range
    "store_one_rank": ("MASTER_ADDR", "127.0.0.1"),  # a store address on one rank only
    "rank_out_of_range": (None, 5),  # explicit rank=5 (with world_size) on one rank only
    "rank_without_size": (None, "x"),  # explicit rank alone on one rank only
    "placement_with_store": (None, 0),  # rank=0 on the last rank, a store address everywhere
    "debug_env": ("GRADCOMM_DEBUG", "verbose"),
    "other_debug": ("GRADCOMM_DEBUG", "detail"),  # valid, but its checks would pair with data
}


def main() -> None:
    backend, case = sys.argv[1], sys.argv[2]
    rank = int(os.environ["PMI_RANK"])
    last = rank == int(os.environ["PMI_SIZE"]) - 1
    var, bad = CASES[case]
    # the timeout argument would win over GRADCOMM_TIMEOUT
    kwargs: dict[str, object] = {} if case == "timeout_env" else {"timeout": 30.0}
    os.environ.pop("GRADCOMM_BACKEND", None)
    chosen: str | None = backend
    if last:
        if case == "other_backend":
            os.environ["GRADCOMM_BACKEND"] = "gloo" if backend == "mpi" else "mpi"
            chosen = None
        elif case == "backend_env":
            os.environ["GRADCOMM_BACKEND"] = str(bad)
            chosen = None
        elif var is not None:
            os.environ[var] = str(bad)
        elif case in ("timeout_arg", "timeout_int"):
            kwargs["timeout"] = bad
        elif case == "env_arg":
            kwargs["env"] = bad
        elif case == "rank_out_of_range":
            kwargs["rank"], kwargs["world_size"] = bad, int(os.environ["PMI_SIZE"])
        elif case == "rank_without_size":
            kwargs["rank"] = bad
        elif case == "placement_with_store":
            kwargs["rank"], kwargs["world_size"] = bad, int(os.environ["PMI_SIZE"])
        else:
            kwargs["device"] = bad
        if case == "store_one_rank":
            os.environ["MASTER_PORT"] = "29517"
    if case == "placement_with_store":  # the store was trusted: a TCPStore timeout, 2x later
        os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", "29518"
    try:
        comm = gradcomm.init(chosen, **kwargs)  # type: ignore[arg-type]
        print(f"RESULT badset rank={rank} no error", flush=True)
        comm.close()
    except Exception as exc:  # noqa: BLE001 - the test checks type and message
        print(f"RESULT badset rank={rank} {type(exc).__name__}: {exc}", flush=True)
    from mpi4py import MPI

    total = MPI.COMM_WORLD.allreduce(rank + 1)
    print(f"RESULT after rank={rank} {total}", flush=True)


if __name__ == "__main__":
    main()

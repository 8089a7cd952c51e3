"""One rank of a job that makes the "gradcomm" default group every way torch users do, in turn.

Started by the test with SLURM's variables and ``MASTER_ADDR``/``MASTER_PORT`` but no ``RANK``
or ``WORLD_SIZE`` (as srun with an exported address), and ``argv[1]``: a free port for tcp://,
``argv[2]``: a FileStore path, ``argv[3]``: a second free port for
the last store at ``MASTER_ADDR``. Each way ends with an all-reduce whose sum is checked and
``destroy_process_group``; prints ``MODE <name> ok``. Last, ``GRADCOMM_DEBUG=detail`` must turn
a collective whose sizes differ across ranks into an error on every rank, and
``GRADCOMM_PROFILE=1`` write each rank's trace of the group's collectives; then rank 1 dies and
rank 0's all-reduce must fail with an error. Before that, rank 0's ``abort()`` must fail an
all-reduce that rank 1 never joins within seconds (``argv[4]``, ``argv[5]``: two more ports).
"""

from __future__ import annotations

import datetime
import os
import sys
import threading
import time

import torch
import torch.distributed as dist

from gradcomm.torch_backend import Options

rank, size = int(os.environ["SLURM_PROCID"]), int(os.environ["SLURM_NTASKS"])
port, path = sys.argv[1], sys.argv[2]


def check(name: str) -> None:
    assert (dist.get_rank(), dist.get_world_size()) == (rank, size)
    t = torch.full((3,), float(rank + 1))
    dist.all_reduce(t)
    assert torch.equal(t, torch.full((3,), size * (size + 1) / 2)), t
    transports = {k: c.backend for k, c in dist.group.WORLD.communicators.items()}
    dist.destroy_process_group()
    print(f"MODE {name} ok {transports}", flush=True)


dist.init_process_group("gradcomm")  # srun: rank and size from SLURM, store at MASTER_ADDR
check("srun-env")
dist.init_process_group("gradcomm", store=dist.FileStore(path, size), rank=rank, world_size=size)
check("explicit-store")
dist.init_process_group("gradcomm", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                        world_size=size, timeout=datetime.timedelta(seconds=60))
check("tcp-init-method")
dist.init_process_group("cpu:gradcomm,cuda:gradcomm", pg_options=Options(transport="gloo"))
check("per-device-options")

# gradcomm's debug mode and profiler apply to the group's collectives
trace_dir = os.path.join(os.path.dirname(path), "traces")
os.environ.update(GRADCOMM_DEBUG="detail", GRADCOMM_PROFILE="1", GRADCOMM_PROFILE_DIR=trace_dir,
                  MASTER_PORT=sys.argv[3])  # the first store's port may still be held
dist.init_process_group("gradcomm")
try:
    dist.all_reduce(torch.ones(3 + rank))  # sizes differ across ranks: an error, not a value
except RuntimeError as exc:
    assert "ranks called different collectives" in str(exc), exc
else:
    raise AssertionError("a collective whose sizes differ across ranks did not raise")
os.environ.pop("GRADCOMM_DEBUG")
check("debug-and-profile")
trace = os.path.join(trace_dir, f"gradcomm-trace-rank{rank}.json")
with open(trace) as f:
    assert "all_reduce" in f.read(), trace
print("MODE trace ok", flush=True)

# a stalled peer: abort() from another thread fails the collective waiting for it at once
os.environ.update(MASTER_PORT=sys.argv[4])
dist.init_process_group("gradcomm", timeout=datetime.timedelta(seconds=30))
dist.barrier()
if rank == 0:
    work = dist.all_reduce(torch.ones(1), async_op=True)  # rank 1 never joins it
    group = dist.group.WORLD
    start = time.monotonic()
    threading.Thread(target=group.abort).start()
    try:
        work.wait()
    except Exception as exc:  # noqa: BLE001 - the transport's error for an aborted wait
        took = time.monotonic() - start
        assert took < 5, f"the aborted all-reduce took {took:.1f} s to fail"
        print(f"MODE abort ok ({type(exc).__name__})", flush=True)
    else:
        raise AssertionError("an all-reduce of an aborted group returned")
else:
    time.sleep(3)  # stalled; then leave, which lets rank 0's transport close
dist.destroy_process_group()

# a peer that dies: the survivor's collective fails with an error within the timeout, no crash
os.environ.update(MASTER_PORT=sys.argv[5])
dist.init_process_group("gradcomm", timeout=datetime.timedelta(seconds=5))
dist.barrier()
if rank == 1:
    os._exit(0)
try:
    dist.all_reduce(torch.ones(1))
except Exception as exc:  # noqa: BLE001 - gloo's connection error or the timeout
    print(f"MODE peer-death ok ({type(exc).__name__})", flush=True)
else:
    raise AssertionError("an all-reduce with a dead peer returned")
os._exit(0)  # the group's transport still waits for the dead peer: do not tear it down

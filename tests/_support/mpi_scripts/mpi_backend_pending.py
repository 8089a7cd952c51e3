"""Run under ``mpiexec -n 2``: collectives left pending by the caller, on the mpi backend.

Case ``dropped``: rank 1 joins 0.5 s late, so rank 0's async all-reduces are still pending when
their :class:`Work` (and, for one, the tensor itself) is dropped. MPI still writes into those
buffers, so the communicator must keep them alive until the collective completes, and a dropped
work's copy-back into a non-contiguous tensor must still happen.

Case ``short-wait``: rank 1 joins 1.5 s late; rank 0's ``wait(timeout=0.3)`` times out. While that
collective is pending, a new one must raise RuntimeError at once; once it completes (a second
``wait()``), the communicator must work again, on both ranks.

Case ``swapped``: rank 1 joins 0.5 s late; rank 0 replaces the memory of each tensor it handed to
a pending collective (``t.data = ...`` or ``t.set_(...)``; all_reduce 1-D and 2-D, broadcast,
all_gather). MPI still writes into the old memory, so the
collective must keep that memory alive (not just the tensor object, whose memory was replaced);
otherwise the process crashes or corrupts tensors allocated since. The tensor's new memory
(same shape) stays untouched on these contiguous paths; a dropped work whose copy-back fails
(the tensor got smaller memory) logs a warning, and the next collectives run on every rank.

Exits non-zero on a wrong value; prints ``RESULT pending <case> ok rank=<r>``.
"""

from __future__ import annotations

import logging
import sys
import time
import weakref
from collections.abc import Callable

import torch

import gradcomm
from gradcomm.comm import Work


def dropped(comm: gradcomm.Communicator) -> None:
    r = comm.rank
    if r == 1:
        time.sleep(0.5)
    gone = torch.ones(4096)
    ref = weakref.ref(gone)
    comm.all_reduce(gone, async_op=True)  # Work dropped at once
    del gone
    if r == 0 and ref() is None:
        sys.exit("rank 0: the tensor of a pending all_reduce was freed while MPI still used it")
    strided = torch.ones(64, 2)[:, 0]  # non-contiguous: reduced in a copy, written back after
    comm.all_reduce(strided, async_op=True)
    for _ in range(100):  # later collectives finish the dropped ones
        # The last element counts the ranks that are done, so that all leave the loop together
        # (a rank leaving alone would pair its next collective with another rank's probe).
        done = ref() is None and torch.equal(strided, torch.full((64,), 2.0))
        probe = torch.tensor([1.0, 1.0, 1.0, float(done)])
        comm.all_reduce(probe)
        if not torch.equal(probe[:3], torch.full((3,), 2.0)):
            sys.exit(f"rank {r}: all_reduce after dropped works gave {probe.tolist()}")
        if probe[3] == comm.world_size:
            break
    else:
        sys.exit(f"rank {r}: after 100 collectives, dropped tensor freed: {ref() is None}; "
                 f"copy-back into the strided tensor: {strided[:4].tolist()}...")


def short_wait(comm: gradcomm.Communicator) -> None:
    r = comm.rank
    t = torch.full((5,), float(r + 1))
    if r == 1:
        time.sleep(1.5)
        comm.all_reduce(t)
    else:
        work = comm.all_reduce(t, async_op=True)
        try:
            work.wait(timeout=0.3)
            sys.exit("rank 0: wait(timeout=0.3) returned although rank 1 was 1.5 s late")
        except gradcomm.CollectiveTimeoutError:
            pass
        try:
            comm.all_reduce(torch.ones(2))
            sys.exit("rank 0: a collective was issued while a timed-out one was pending")
        except RuntimeError as exc:
            if "unusable" not in str(exc) or "still pending" not in str(exc):
                sys.exit(f"rank 0: unexpected message: {exc}")
        work.wait()
    if not torch.equal(t, torch.full((5,), 3.0)):
        sys.exit(f"rank {r}: the late all_reduce gave {t.tolist()}")
    after = torch.full((2,), float(r))
    comm.all_reduce(after)  # usable again
    if not torch.equal(after, torch.ones(2)):
        sys.exit(f"rank {r}: all_reduce after the late one gave {after.tolist()}")


def swapped(comm: gradcomm.Communicator) -> None:
    r, n = comm.rank, comm.world_size
    comm.all_reduce(torch.ones(2))
    size = 1 << 18  # 1 MiB of float32: freed memory goes back to the allocator's pool
    cases: list[tuple[str, Callable[[torch.Tensor], Work]]] = [
        ("all_reduce 1-D", lambda t: comm.all_reduce(t, async_op=True)),
        ("all_reduce 2-D", lambda t: comm.all_reduce(t.view(512, -1), async_op=True)),
        ("all_reduce MAX", lambda t: comm.all_reduce(t, "max", async_op=True)),
        ("broadcast", lambda t: comm.broadcast(t, src=1, async_op=True)),
    ]
    for name, start in cases:
        for how in ("data", "set_"):
            if r == 1:
                time.sleep(0.5)  # rank 0's collective stays pending meanwhile
            t = torch.full((size,), float(r + 1))
            handle = t if name != "all_reduce 2-D" else t.view(512, -1)
            work = start(t)
            if r == 0:
                new = torch.full(handle.shape, -5.0)  # new memory of the same shape
                if how == "data":
                    handle.data = new
                else:
                    handle.set_(new)
                del t
                fresh = [torch.full((size,), 7.0) for _ in range(4)]  # may reuse freed memory
            work.wait()
            if r == 0 and any(not torch.equal(f, torch.full((size,), 7.0)) for f in fresh):
                sys.exit(f"rank 0: {name} ({how}) wrote into memory allocated after the swap")
            if r == 0 and not torch.equal(handle, torch.full(handle.shape, -5.0)):
                sys.exit(f"rank 0: {name} ({how}) wrote into the tensor's new memory")
    for how in ("data", "set_"):
        if r == 1:
            time.sleep(0.5)
        src = torch.full((size,), float(r))
        out = torch.empty(n * size)
        work = comm.all_gather(out, src, async_op=True)
        if r == 0:
            if how == "data":
                src.data, out.data = torch.zeros(1), torch.zeros(1)
            else:
                src.set_(torch.zeros(1))
                out.set_(torch.zeros(1))
            fresh = [torch.full((size,), 7.0) for _ in range(4)]
        work.wait()
        if r == 0 and any(not torch.equal(f, torch.full((size,), 7.0)) for f in fresh):
            sys.exit(f"rank 0: all_gather ({how}) wrote into memory allocated after the swap")
    # A dropped work whose copy-back (non-contiguous tensor) fails because the tensor got smaller
    # memory: the error is logged, and the later collectives run on every rank, in step.
    warned: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            warned.append(record.getMessage())

    logging.getLogger("gradcomm.comm").addHandler(Keep(logging.WARNING))
    if r == 1:
        time.sleep(0.5)
    strided = torch.ones(8, 4)[:, ::2]
    comm.all_reduce(strided, async_op=True)  # Work dropped
    if r == 0:
        strided.data = torch.zeros(1)
    for i in range(5):
        probe = torch.ones(3)
        comm.all_reduce(probe)
        if not torch.equal(probe, torch.full((3,), float(n))):
            sys.exit(f"rank {r}: all_reduce {i} after the swaps gave {probe.tolist()}")
    if r == 0 and not any("completion step failed" in w for w in warned):
        sys.exit(f"rank 0: no warning about the failed copy-back; logged: {warned}")


def main() -> None:
    case = sys.argv[1]
    with gradcomm.init("mpi", timeout=30) as comm:
        comm.barrier()
        {"dropped": dropped, "short-wait": short_wait, "swapped": swapped}[case](comm)
        comm.barrier()
        print(f"RESULT pending {case} ok rank={comm.rank}", flush=True)


if __name__ == "__main__":
    main()

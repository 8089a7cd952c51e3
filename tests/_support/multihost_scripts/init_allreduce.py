"""``gradcomm.init`` then one all-reduce, for each backend of ``argv[1]`` (comma-separated) with
the timeout ``argv[2]``; prints ``RESULT backend=<b> rank=<r> of <n> local=<l> host=<hostname>
launcher=<launcher> sum=<s>`` per backend, or the error ``INIT FAILED rank=<r> after=<seconds>
<type>: <message>`` and exits 3 (every rank for itself: run with GRADCOMM_MPI_ABORT_ON_ERROR=0 so
that no rank's abort ends the others first)."""

from __future__ import annotations

import socket
import sys
import time

import torch

import gradcomm


def main() -> int:
    launch = gradcomm.comm.detect_launch()
    for backend in sys.argv[1].split(","):
        start = time.monotonic()
        try:
            comm = gradcomm.init(backend, timeout=float(sys.argv[2]))
        except Exception as exc:  # noqa: BLE001 - reported for the test to read
            print(f"INIT FAILED rank={launch.rank} after={time.monotonic() - start:.1f} "
                  f"{type(exc).__name__}: {exc}", flush=True)
            return 3
        t = torch.ones(4) * (comm.rank + 1)
        comm.all_reduce(t)
        # One write per line: ranks share the launcher's pipe, and print's separate newline
        # write let another rank's line land in between.
        sys.stdout.write(f"RESULT backend={backend} rank={comm.rank} of {comm.world_size} "
                         f"local={comm.local_rank} host={socket.gethostname()} "
                         f"launcher={launch.launcher.value} sum={t[0].item():g}\n")
        sys.stdout.flush()
        comm.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())

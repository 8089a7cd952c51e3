"""Run under ``mpiexec -n N`` with argv[1] = backend: all_gather whose input is a view into output.

Case 1: input is this rank's own slot of output (the in-place all-gather idiom).
Case 2: input is the first slot of output on every rank (overlapping another rank's slot).
Then one all_reduce checks that the ranks are still in step. Exits non-zero on a wrong value.
"""

from __future__ import annotations

import sys

import torch

import gradcomm


def main() -> None:
    comm = gradcomm.init(sys.argv[1], timeout=30)
    n, r = comm.world_size, comm.rank
    out = torch.zeros(n * 2)
    out[2 * r : 2 * r + 2] = torch.tensor([10.0 * r, 10.0 * r + 1])
    comm.all_gather(out, out[2 * r : 2 * r + 2])
    want = torch.tensor([v for k in range(n) for v in (10.0 * k, 10.0 * k + 1)])
    if not torch.equal(out, want):
        sys.exit(f"rank {r}: own-slot all_gather gave {out.tolist()}, want {want.tolist()}")
    out2 = torch.zeros(n * 2)
    out2[:2] = torch.tensor([10.0 * r, 10.0 * r + 1])
    comm.all_gather(out2, out2[:2])
    if not torch.equal(out2, want):
        sys.exit(f"rank {r}: overlapping all_gather gave {out2.tolist()}, want {want.tolist()}")
    t = torch.ones(1)
    comm.all_reduce(t)
    if t.item() != n:
        sys.exit(f"rank {r}: ranks out of step after all_gather: all_reduce gave {t.item()}")
    print(f"RESULT alias-ok rank={r} backend={comm.backend}", flush=True)
    comm.close()


if __name__ == "__main__":
    main()

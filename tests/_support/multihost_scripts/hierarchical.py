"""Across simulated hosts: ``split_by_host`` from the real hostnames, a ring of send/recv that
crosses hosts, and the hierarchical all-reduce against the flat one, for each backend named in
``argv[1]`` (comma-separated). Prints ``RESULT <backend> rank=<r> intra=<i>/<n> inter=<j>/<m>
ok`` per rank and backend; a wrong value raises (mpiexec's abort hook ends the job)."""

from __future__ import annotations

import sys

import torch

import gradcomm
from gradcomm.comm import HierarchicalAllReduce


def check(backend: str) -> str:
    with gradcomm.init(backend, timeout=60) as comm:
        r, n = comm.rank, comm.world_size
        hier = HierarchicalAllReduce(comm)  # hosts from the hostnames: no GRADCOMM_HOST_ID
        intra, inter = hier.intra, hier.inter
        got = torch.zeros(33)
        work = comm.recv(got, (r - 1) % n, async_op=True)
        comm.send(torch.full((33,), float(r)), (r + 1) % n)
        work.wait()
        assert torch.equal(got, torch.full((33,), float((r - 1) % n))), got
        t = torch.arange(1001, dtype=torch.float64) * (r + 1)
        flat = t.clone()
        comm.all_reduce(flat)
        hier.all_reduce(t)
        assert torch.allclose(t, flat), (t - flat).abs().max()
        return (f"RESULT {backend} rank={r} intra={intra.rank}/{intra.world_size} "
                f"inter={inter.rank}/{inter.world_size} ok\n")


def main() -> None:
    for backend in sys.argv[1].split(","):
        sys.stdout.write(check(backend))  # one write per line: ranks share the launcher's pipe
        sys.stdout.flush()


if __name__ == "__main__":
    main()

"""torch's own DistributedDataParallel over gradcomm: ``init_process_group("gradcomm")``.

A plain torch DDP script -- nothing gradcomm-specific but ``import gradcomm`` and the backend
name -- trains an MLP on scikit-learn's bundled digits. It runs unchanged under each launcher::

    torchrun --nproc_per_node 2 examples/torch_ddp_digits.py
    mpiexec -n 2 python examples/torch_ddp_digits.py          # no MASTER_ADDR, RANK needed
    srun -n 2 --mpi=pmix python examples/torch_ddp_digits.py  # or export MASTER_ADDR/MASTER_PORT

The transport is ``GRADCOMM_BACKEND`` (gloo, mpi, nccl, cupy-nccl; default: nccl with CUDA,
else gloo), e.g. ``GRADCOMM_BACKEND=mpi mpiexec -n 2 python examples/torch_ddp_digits.py``.
Data, batches and output: ``torch_digits_common.py``; at the end the ranks compare a digest of
their parameters and the script exits 1 if any rank differs.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch_digits_common import finish, parse_args, train

import gradcomm  # noqa: F401 - registers the "gradcomm" backend with torch.distributed


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(__doc__.splitlines()[0], 0.05, argv)
    dist.init_process_group("gradcomm")
    torch.manual_seed(args.seed + dist.get_rank())  # DDP broadcasts rank 0's initial parameters
    model = nn.parallel.DistributedDataParallel(
        nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10)))
    acc = train(model, torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9), args)
    return finish(list(model.parameters()), acc)


if __name__ == "__main__":
    sys.exit(main())

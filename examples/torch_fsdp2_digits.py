"""torch's FSDP2 (``fully_shard``) with bf16 mixed precision over gradcomm.

``init_process_group("gradcomm")``, then torch's FSDP2 unchanged: each rank keeps 1/N of every
parameter, all-gathers them in bfloat16 for forward and backward, and reduce-scatters the
gradients in float32. Trains an MLP on scikit-learn's bundled digits; runs unchanged under::

    torchrun --nproc_per_node 2 examples/torch_fsdp2_digits.py
    mpiexec -n 2 python examples/torch_fsdp2_digits.py
    srun -n 2 --mpi=pmix python examples/torch_fsdp2_digits.py

with the transport from ``GRADCOMM_BACKEND`` (gloo, mpi, ...). Data, batches and output:
``torch_digits_common.py``; at the end the full parameters (``full_tensor()``) are compared
across ranks by digest and the script exits 1 if any rank differs.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch_digits_common import finish, parse_args, train

import gradcomm  # noqa: F401 - registers the "gradcomm" backend with torch.distributed


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(__doc__.splitlines()[0], 3e-3, argv)
    dist.init_process_group("gradcomm")
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    torch.manual_seed(args.seed)  # FSDP2 shards what each rank builds: build the same model
    model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(),
                          nn.Linear(256, 10))
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    acc = train(model, torch.optim.AdamW(model.parameters(), lr=args.lr), args)
    full = [p.full_tensor() for p in model.parameters()]  # a collective: on every rank
    return finish(full, acc)


if __name__ == "__main__":
    sys.exit(main())

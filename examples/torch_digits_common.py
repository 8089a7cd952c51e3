"""What ``torch_ddp_digits.py`` and ``torch_fsdp2_digits.py`` share: the data, the training loop
and the end-of-run parameter check (plain torch.distributed; nothing gradcomm-specific).

Data: ``load_digits`` (1797 8x8 images), split with a fixed seed, standardised. Each step takes
one global batch from a permutation that is the same on every rank; rank ``r`` trains on
``batch[r::world_size]``, its loss scaled so that the average over ranks (DDP's, FSDP2's) is the
batch's mean loss. Rank 0 prints the loss and the held-out accuracy per epoch.
"""

from __future__ import annotations

import argparse
import hashlib
import sys
from collections.abc import Sequence

import torch
import torch.distributed as dist
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split
from sklearn.preprocessing import StandardScaler
from torch import nn


def parse_args(description: str, lr: float, argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--batch-size", type=int, default=64, help="global batch size")
    parser.add_argument("--lr", type=float, default=lr)
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args(argv)


def load_data(seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(x_train, y_train, x_test, y_test)``: float32 features, int64 labels, on the CPU."""
    x, y = load_digits(return_X_y=True)
    x_train, x_test, y_train, y_test = train_test_split(x, y, test_size=0.2, random_state=seed)
    scaler = StandardScaler().fit(x_train)
    return (torch.tensor(scaler.transform(x_train), dtype=torch.float32), torch.tensor(y_train),
            torch.tensor(scaler.transform(x_test), dtype=torch.float32), torch.tensor(y_test))


def train(model: nn.Module, opt: torch.optim.Optimizer, args: argparse.Namespace) -> float:
    """Train ``model`` (wrapped by DDP or sharded by FSDP2) for ``args.epochs``; return the final
    held-out accuracy."""
    rank, world = dist.get_rank(), dist.get_world_size()
    x_train, y_train, x_test, y_test = load_data(args.seed)
    order = torch.Generator().manual_seed(args.seed)
    acc = 0.0
    for epoch in range(1, args.epochs + 1):
        perm = torch.randperm(len(x_train), generator=order)
        total = 0.0
        for start in range(0, len(perm), args.batch_size):
            batch = perm[start:start + args.batch_size]
            mine = batch[rank::world]
            loss = nn.functional.cross_entropy(model(x_train[mine]).float(), y_train[mine],
                                               reduction="sum") * world / len(batch)
            opt.zero_grad()
            loss.backward()
            opt.step()
            total += loss.item() * len(batch) / world
        with torch.no_grad():
            acc = (model(x_test).float().argmax(1) == y_test).float().mean().item()
        if rank == 0:
            print(f"epoch {epoch:3d}/{args.epochs}  loss {total / len(x_train):.4f}  "
                  f"held-out acc {acc:.4f}", flush=True)
    return acc


def finish(parameters: list[torch.Tensor], acc: float) -> int:
    """Compare a digest of ``parameters`` across ranks, destroy the group; 0, or 1 if any rank
    differs (printed)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    digest = hashlib.sha256(b"".join(t.detach().float().numpy().tobytes()
                                     for t in parameters)).hexdigest()
    digests: list[object] = [None] * world
    dist.all_gather_object(digests, digest)
    dist.destroy_process_group()
    if len(set(digests)) != 1:
        print(f"rank {rank}: parameters differ across ranks: {digests}", file=sys.stderr)
        return 1
    if rank == 0:
        print(f"final held-out accuracy: {acc:.4f}")
        print(f"parameters identical on all {world} ranks (sha256 {digest[:16]}...)")
    return 0

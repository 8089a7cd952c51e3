"""Models, data and single-process references shared by the reducer tests and MPI scripts.

Every rank's batch is a known function of (seed, rank), so any process can build the global batch
(the concatenation of all ranks' batches) and compute the reference gradient on it alone.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

import torch
from torch import nn

BATCH = 4  # samples per rank


class Net(nn.Module):
    """A small MLP + conv net (channels_last conv weight, size-1 dims) with two heads."""

    def __init__(self, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.conv = nn.Conv2d(2, 3, 3, padding=1)
        self.bn = nn.BatchNorm2d(3)
        self.fc1 = nn.Linear(3 * 4 * 4, 16)
        self.fc2 = nn.Linear(16, 16)
        self.head_a = nn.Linear(16, 1)
        self.head_b = nn.Linear(16, 1)
        self.scale = nn.Parameter(torch.ones(1, 16))  # size-1 dim
        self.to(dtype)
        self.conv.to(memory_format=torch.channels_last)

    def forward(self, x: torch.Tensor, use_b: bool = True) -> torch.Tensor:
        h = torch.relu(self.bn(self.conv(x.contiguous(memory_format=torch.channels_last))))
        h = torch.tanh(self.fc1(h.flatten(1))) * self.scale
        h = torch.tanh(self.fc2(h))
        out = self.head_a(h)
        if use_b:
            out = out + self.head_b(h)
        return out


_SEED_LOCK = threading.RLock()


@contextlib.contextmanager
def seeded(seed: int) -> Iterator[None]:
    """Seed torch's global RNG for the block; thread ranks share that RNG, so hold a lock."""
    with _SEED_LOCK:
        torch.manual_seed(seed)
        yield


def make_model(seed: int = 0, dtype: torch.dtype = torch.float32) -> Net:
    with seeded(seed):
        return Net(dtype)


def batch(rank: int, seed: int = 1, dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor,
                                                                                 torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * seed + rank)
    x = torch.randn(BATCH, 2, 4, 4, generator=g).to(dtype)
    y = torch.randn(BATCH, 1, generator=g).to(dtype)
    return x, y


def global_batch(world_size: int, seed: int = 1,
                 dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    parts = [batch(r, seed, dtype) for r in range(world_size)]
    return torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])


def loss_fn(model: nn.Module, x: torch.Tensor, y: torch.Tensor, use_b: bool = True) -> torch.Tensor:
    return ((model(x, use_b) - y) ** 2).mean()


def eval_bn(model: nn.Module) -> nn.Module:
    """BatchNorm in eval mode, so a sample's output does not depend on its batch mates."""
    model.bn.eval()
    return model


def reference_grads(world_size: int, seed: int = 1) -> dict[str, torch.Tensor]:
    """Gradients of one process on the concatenated global batch (BatchNorm in eval mode)."""
    model = eval_bn(make_model())
    x, y = global_batch(world_size, seed)
    loss_fn(model, x, y).backward()
    return {n: p.grad.clone() for n, p in model.named_parameters()}


class ComplexNet(nn.Module):
    """A complex64 weight and a real head, initialised without the global RNG (thread ranks).

    ``conj=True`` uses the weight as ``w.conj()``: autograd then hands ``w`` a gradient that is a
    lazy conjugate view (``w.grad.is_conj()``), whose values live in a bit, not in memory.
    """

    def __init__(self, conj: bool = False) -> None:
        super().__init__()
        self.conj = conj
        g = torch.Generator().manual_seed(5)
        self.w = nn.Parameter(torch.randn(3, 4, dtype=torch.complex64, generator=g))
        self.head = nn.Linear(3, 1)
        with torch.no_grad():
            self.head.weight.copy_(torch.randn(1, 3, generator=g))
            self.head.bias.copy_(torch.randn(1, generator=g))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.w.conj() if self.conj else self.w
        return self.head((w @ x.T).abs().T)


def complex_batch(rank: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(50 + rank)
    return torch.randn(5, 4, dtype=torch.complex64, generator=g)


def complex_loss(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return model(x).pow(2).mean()


def complex_reference_grads(world_size: int, conj: bool = False) -> dict[str, torch.Tensor]:
    """Gradients of one :class:`ComplexNet` on the concatenated global complex batch."""
    model = ComplexNet(conj)
    complex_loss(model, torch.cat([complex_batch(r) for r in range(world_size)])).backward()
    return {n: p.grad.clone() for n, p in model.named_parameters()}


def grads_close(got: dict[str, torch.Tensor | None], want: dict[str, torch.Tensor],
                rtol: float = 1e-6) -> list[str]:
    """Names whose grad differs from ``want`` by more than ``rtol`` of the tensor's max |value|."""
    bad = []
    for name, ref in want.items():
        g = got.get(name)
        if g is None:
            bad.append(f"{name}: None")
            continue
        scale = float(ref.abs().max()) or 1.0
        err = float((g.double() - ref.double()).abs().max())
        if err > rtol * scale:
            bad.append(f"{name}: max error {err:.3g} vs scale {scale:.3g}")
    return bad


def flat_grads(model: nn.Module) -> torch.Tensor:
    """All gradients concatenated (float64 so any dtype fits; None counts as NaN)."""
    parts = []
    for p in model.parameters():
        if p.grad is None:
            parts.append(torch.full((p.numel(),), float("nan"), dtype=torch.float64))
        else:
            parts.append(p.grad.detach().reshape(-1).double())
    return torch.cat(parts)


def ulp_distance(a: torch.Tensor, b: torch.Tensor) -> int:
    """The largest distance between ``a`` and ``b`` in units in the last place (16-bit floats)."""
    ia, ib = a.view(torch.int16).int(), b.view(torch.int16).int()
    # map sign-magnitude bit patterns to a monotonic integer line
    ia = torch.where(ia < 0, -(ia & 0x7FFF), ia)
    ib = torch.where(ib < 0, -(ib & 0x7FFF), ib)
    return int((ia - ib).abs().max())

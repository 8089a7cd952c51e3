"""Training-step time of gradcomm against torch DDP, the old end-of-backward algorithm, and no comm.

One run times, on the same model, initial weights and data, one training step (``zero_grad()``
with torch's default ``set_to_none=True``, forward, loss, backward with the gradient reduction,
SGD step) for each variant -- the same user code for every variant:

* ``gradcomm+gloo`` / ``gradcomm+mpi``: :class:`gradcomm.GradientReducer` on ``gradcomm.init``'s
  gloo / mpi communicator (overlapped, bucketed all-reduce during backward).
* ``ddp``: ``torch.nn.parallel.DistributedDataParallel`` on a gloo process group of its own, with
  the same ``gradient_as_bucket_view`` setting as the gradcomm variants (like for like).
* ``old+gloo`` / ``old+mpi``: NVIDIA tacotron2's ``apply_gradient_allreduce`` (reimplemented
  below; gloo: a process group of its own): per-parameter hooks only queue one callback, which
  after backward flattens all grads of each dtype into a new buffer, all-reduces it
  (``torch.distributed.all_reduce`` on gloo, or mpi4py's ``Allreduce`` in place), divides by the
  world size and copies back.
* ``local``: every rank computes its own step with no communication (the compute floor).
* ``ddp+powersgd`` / ``gradcomm+gloo+powersgd`` / ``gradcomm+mpi+powersgd`` (not run by
  default): PowerSGD gradient compression, torch's own ``powerSGD_hook`` on DDP and gradcomm's
  ``"powersgd"`` comm hook, with the same options (``--powersgd-rank``, ``--powersgd-start-iter``;
  the other options torch's defaults). Their table rows add ``x plain`` (against the same variant
  without compression) and ``x ddp+psgd`` (against DDP with torch's PowerSGD hook).
* ``gradcomm+gloo+nocheck`` / ``gradcomm+mpi+nocheck`` (not run by default): the reducer with
  ``step_check=False``; their ``x plain`` is against the same variant with the step consistency
  check (the default), so ``1 / x plain - 1`` is the check's cost.

Variants are interleaved step by step: after ``--warmup`` untimed steps each, round ``i`` of
``--steps`` runs one timed step of every variant, in an order rotated every round, so a slow
period of a shared machine hits every variant alike. A step's time is the max over ranks. The
table gives each variant's median and inter-quartile range (IQR) over its steps, and its ratio to
DDP and to the old algorithm on the same backend as the median over rounds of the per-round
ratio (paired, so load that drifts between rounds cancels); it then checks issue 3's targets.
The many-parameter models (``scalars``: 5000 one-element parameters; ``small_layers``: a
transformer-like stack of 1000 small parameter tensors) add each variant's per-parameter cost:
the median over rounds of its forward+backward time minus ``local``'s in the same round, divided
by the number of parameter tensors (microseconds), and that cost's ratio to DDP's (issue 23's
target: at most 1.0x on gloo and mpi).
The ``faults`` column is the median number of minor page faults per step (max over ranks): glibc
returns freed memory to the kernel and a later step faults it back in, about 1-2 us per fault,
which moves a step by milliseconds when it happens. Which variant pays depends on how the six
variants' allocations interleave in one process (a job that trains one model reaches a steady
state: e.g. gradcomm+mpi alone on the MLP faults 0-1 times per step, interleaved ~1500), so by
default (``--malloc retain``) the benchmark asks glibc to keep freed memory (``mallopt``:
``M_TRIM_THRESHOLD`` 1 GiB, ``M_MMAP_THRESHOLD`` 32 MiB), as jemalloc or tcmalloc would, for every
variant alike; ``--malloc glibc`` measures with glibc's defaults.
Each gradcomm variant's bucket sizes and resolved first-bucket cap are printed under the table.

Run (2 ranks on 2 cores; OMP_NUM_THREADS=1 per rank is set here if unset)::

    mpiexec -n 2 python benchmarks/step_time.py
    mpiexec -n 4 python benchmarks/step_time.py --models mlp    # oversubscribed

Everything runs under ``mpiexec``: the gloo variants rendezvous through MPI, and DDP's default
process group uses a TCPStore whose port rank 0 broadcasts with mpi4py.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")  # before torch starts its thread pool

import argparse
import copy
import datetime
import json
import math
import resource
import statistics
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from gradcomm.bench.results import run_metadata

RESULTS_DIR = Path(__file__).resolve().parent / "results"
VARIANTS = ("local", "ddp", "old+gloo", "old+mpi", "gradcomm+gloo", "gradcomm+mpi")
POWERSGD_VARIANTS = ("ddp+powersgd", "gradcomm+gloo+powersgd", "gradcomm+mpi+powersgd")
NOCHECK_VARIANTS = ("gradcomm+gloo+nocheck", "gradcomm+mpi+nocheck")
KNOWN_VARIANTS = VARIANTS + POWERSGD_VARIANTS + NOCHECK_VARIANTS
MODELS = ("mlp", "conv", "transformer", "scalars", "small_layers")
# Models with many small parameters, whose table adds each variant's per-parameter cost.
MANY_PARAM_MODELS = ("scalars", "small_layers")


# ----------------------------------------------------------------------------- models and data
class TinyTransformer(nn.Module):
    """Token embedding, 4 pre-norm encoder layers (d_model 128, 4 heads), mean-pool, linear head."""

    def __init__(self, vocab: int = 1000, d_model: int = 128, classes: int = 10) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, d_model)
        layer = nn.TransformerEncoderLayer(
            d_model, nhead=4, dim_feedforward=4 * d_model, dropout=0.0, batch_first=True,
            norm_first=True,
        )
        self.encoder = nn.TransformerEncoder(layer, num_layers=4, enable_nested_tensor=False)
        self.head = nn.Linear(d_model, classes)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.encoder(self.embed(tokens)).mean(dim=1))


class Scalars(nn.Module):
    """5000 one-element parameters (many small biases and norms), each scaling one input column.

    Input ``(batch, 5000)`` float32; output ``(batch, 10)`` logits: column ``j`` scaled by
    parameter ``j``, summed in 10 groups of 500 columns.
    """

    def __init__(self, count: int = 5000, classes: int = 10) -> None:
        super().__init__()
        self.scales = nn.ParameterList(nn.Parameter(torch.ones(1) + 0.01 * torch.randn(1))
                                       for _ in range(count))
        self.classes = classes

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scaled = x * torch.cat(list(self.scales))
        return scaled.view(x.shape[0], self.classes, -1).sum(dim=-1)


class SmallLayers(nn.Module):
    """A transformer-like stack of small layers with 1000 parameter tensors: embedding (1), 83
    pre-norm encoder layers of d_model 16, 2 heads (12 each), final LayerNorm (2), bias-free head
    (1). Input ``(batch, seq)`` int64 tokens below ``vocab``; output ``(batch, 10)`` logits."""

    def __init__(self, vocab: int = 100, d_model: int = 16, layers: int = 83,
                 classes: int = 10) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, d_model)
        layer = nn.TransformerEncoderLayer(
            d_model, nhead=2, dim_feedforward=2 * d_model, dropout=0.0, batch_first=True,
            norm_first=True,
        )
        self.encoder = nn.TransformerEncoder(layer, num_layers=layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, classes, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(self.encoder(self.embed(tokens))).mean(dim=1))


def build_model(name: str) -> nn.Module:
    """The benchmark's models (seeded, so every rank and variant starts from the same weights)."""
    torch.manual_seed(0)
    if name == "mlp":  # 4 linear layers of width 1024: 3.16M parameters
        return nn.Sequential(
            nn.Linear(1024, 1024), nn.ReLU(),
            nn.Linear(1024, 1024), nn.ReLU(),
            nn.Linear(1024, 1024), nn.ReLU(),
            nn.Linear(1024, 10),
        )
    if name == "conv":  # small CIFAR-sized conv net
        return nn.Sequential(
            nn.Conv2d(3, 16, 3, padding=1), nn.ReLU(),
            nn.Conv2d(16, 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(32, 64, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(64, 64, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
            nn.Flatten(), nn.Linear(64 * 4 * 4, 256), nn.ReLU(), nn.Linear(256, 10),
        )
    if name == "transformer":
        return TinyTransformer()
    if name == "scalars":
        return Scalars()
    if name == "small_layers":
        return SmallLayers()
    raise ValueError(f"unknown model {name!r}; known: {', '.join(MODELS)}")


def make_batches(name: str, rank: int, count: int = 4) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``count`` fixed batches of this rank's data (seeded by rank: each rank has its own shard)."""
    gen = torch.Generator().manual_seed(1000 + rank)
    out = []
    for _ in range(count):
        if name == "mlp":
            x = torch.randn(64, 1024, generator=gen)
        elif name == "conv":
            x = torch.randn(16, 3, 32, 32, generator=gen)
        elif name == "scalars":
            x = torch.randn(16, 5000, generator=gen)
        elif name == "small_layers":
            x = torch.randint(0, 100, (8, 16), generator=gen)
        else:
            x = torch.randint(0, 1000, (8, 32), generator=gen)
        out.append((x, torch.randint(0, 10, (x.shape[0],), generator=gen)))
    return out


# ----------------------------------------------------------------------------- variants
class Variant:
    """A model copy, its optimizer and the way its gradients are reduced."""

    name = "local"
    backend = ""  # transport the reduction uses, for the "same backend" comparison

    def __init__(self, base: nn.Module, lr: float) -> None:
        self.model = copy.deepcopy(base)
        self.module = self.wrap(self.model)
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=lr, momentum=0.9)

    def wrap(self, model: nn.Module) -> nn.Module:
        return model

    def step(self, x: torch.Tensor, y: torch.Tensor) -> float:
        """One training step; returns the seconds its forward and backward took."""
        self.optimizer.zero_grad(set_to_none=True)
        t0 = time.perf_counter()
        loss = F.cross_entropy(self.module(x), y)
        loss.backward()
        t1 = time.perf_counter()
        self.optimizer.step()
        return t1 - t0

    def layout(self) -> dict[str, Any] | None:
        """How gradients are bucketed (gradcomm variants), for the report."""
        return None

    def close(self) -> None:
        pass


class DDPVariant(Variant):
    name = "ddp"
    backend = "gloo"

    def __init__(self, base: nn.Module, lr: float, view: bool) -> None:
        self.view = view
        super().__init__(base, lr)

    def wrap(self, model: nn.Module) -> nn.Module:
        # A gloo group of its own, as gradcomm+gloo has: each variant's connections and worker
        # threads then sit idle equally long between its steps.
        self.group = dist.new_group(backend="gloo")
        return nn.parallel.DistributedDataParallel(model, bucket_cap_mb=25,
                                                   process_group=self.group,
                                                   gradient_as_bucket_view=self.view)


class DDPPowerSGDVariant(DDPVariant):
    """DDP with torch's own PowerSGD comm hook."""

    name = "ddp+powersgd"

    def __init__(self, base: nn.Module, lr: float, view: bool, rank: int,
                 start_iter: int) -> None:
        self.psgd = (rank, start_iter)
        super().__init__(base, lr, view)

    def wrap(self, model: nn.Module) -> nn.Module:
        from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as psgd

        ddp = super().wrap(model)
        state = psgd.PowerSGDState(process_group=self.group,
                                   matrix_approximation_rank=self.psgd[0],
                                   start_powerSGD_iter=self.psgd[1])
        ddp.register_comm_hook(state, psgd.powerSGD_hook)
        return ddp


class OldAlgorithm:
    """NVIDIA tacotron2's ``apply_gradient_allreduce``, reimplemented as the baseline.

    A forward hook marks the module as needing a reduction; every parameter's gradient hook only
    queues (once per backward) a callback that the autograd engine runs after the whole backward
    pass. The callback buckets the grads by dtype, flattens each bucket into a new buffer
    (``torch.cat``, as ``torch._utils._flatten_dense_tensors`` does), all-reduces it (SUM),
    divides by the world size and copies the slices back into the grads.
    """

    def __init__(self, module: nn.Module, all_reduce: Callable[[torch.Tensor], None],
                 world_size: int) -> None:
        self.module = module
        self.all_reduce = all_reduce
        self.world_size = world_size
        self.needs_reduction = False
        self.queued = False
        module.register_forward_hook(self._mark)
        for param in module.parameters():
            if param.requires_grad:
                param.register_hook(self._queue)

    def _mark(self, *_: Any) -> None:
        self.needs_reduction = True

    def _queue(self, grad: torch.Tensor) -> None:
        if not self.queued:
            self.queued = True
            # No public API runs a callback at the end of backward; DDP uses this one too.
            torch.autograd.Variable._execution_engine.queue_callback(self._flush)

    def _flush(self) -> None:
        self.queued = False
        if not self.needs_reduction:
            return
        self.needs_reduction = False
        buckets: dict[torch.dtype, list[torch.Tensor]] = {}
        for param in self.module.parameters():
            if param.requires_grad and param.grad is not None:
                buckets.setdefault(param.grad.dtype, []).append(param.grad)
        for grads in buckets.values():
            flat = torch.cat([g.reshape(-1) for g in grads])
            self.all_reduce(flat)
            flat /= self.world_size
            for grad, synced in zip(grads, flat.split([g.numel() for g in grads]), strict=True):
                grad.copy_(synced.view_as(grad))


class OldGlooVariant(Variant):
    name = "old+gloo"
    backend = "gloo"

    def wrap(self, model: nn.Module) -> nn.Module:
        self.group = dist.new_group(backend="gloo")  # its own, as every other variant has
        OldAlgorithm(model, lambda t: dist.all_reduce(t, group=self.group),
                     dist.get_world_size())
        return model


class OldMPIVariant(Variant):
    name = "old+mpi"
    backend = "mpi"

    def wrap(self, model: nn.Module) -> nn.Module:
        from mpi4py import MPI

        self.comm = MPI.COMM_WORLD.Dup()
        OldAlgorithm(
            model, lambda t: self.comm.Allreduce(MPI.IN_PLACE, t.numpy(), op=MPI.SUM),
            self.comm.Get_size(),
        )
        return model

    def close(self) -> None:
        self.comm.Free()


class GradcommVariant(Variant):
    def __init__(self, base: nn.Module, lr: float, backend: str, options: dict[str, Any],
                 powersgd: tuple[int, int] | None = None) -> None:
        import gradcomm

        self.name = f"gradcomm+{backend}" + ("+powersgd" if powersgd else "")
        self.backend = backend
        self.options = options
        self.powersgd = powersgd
        self.comm = gradcomm.init(backend)
        super().__init__(base, lr)

    def wrap(self, model: nn.Module) -> nn.Module:
        from gradcomm.hooks import GradientReducer

        self.reducer = GradientReducer(model, self.comm, **self.options)
        if self.powersgd is not None:
            from gradcomm.hooks import PowerSGDState

            rank, start = self.powersgd
            self.reducer.register_comm_hook("powersgd", state=PowerSGDState(
                self.comm, matrix_approximation_rank=rank, start_powerSGD_iter=start))
        return model

    def layout(self) -> dict[str, Any]:
        return {
            "background_progress": self.comm.background_progress,
            "first_bucket_cap_mb": self.reducer.first_bucket_cap_mb,
            "bucket_mib": [round(b.nbytes / 2**20, 3) for b in self.reducer.buckets],
            "in_place": [b.index for b in self.reducer.buckets if b.in_place],
        }

    def close(self) -> None:
        self.reducer.remove()
        self.comm.close()


def build_variant(name: str, base: nn.Module, lr: float, options: dict[str, Any],
                  powersgd: tuple[int, int] = (1, 2)) -> Variant:
    if name == "ddp+powersgd":
        return DDPPowerSGDVariant(base, lr, options["gradient_as_bucket_view"], *powersgd)
    if name.startswith("gradcomm+") and name.endswith("+powersgd"):
        return GradcommVariant(base, lr, name.split("+")[1], options, powersgd)
    if name.startswith("gradcomm+") and name.endswith("+nocheck"):
        variant = GradcommVariant(base, lr, name.split("+")[1], {**options, "step_check": False})
        variant.name = name
        return variant
    if name == "local":
        return Variant(base, lr)
    if name == "ddp":
        return DDPVariant(base, lr, options["gradient_as_bucket_view"])
    if name == "old+gloo":
        return OldGlooVariant(base, lr)
    if name == "old+mpi":
        return OldMPIVariant(base, lr)
    if name.startswith("gradcomm+"):
        return GradcommVariant(base, lr, name.split("+", 1)[1], options)
    raise ValueError(f"unknown variant {name!r}; known: {', '.join(KNOWN_VARIANTS)}")


# ----------------------------------------------------------------------------- measurement
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # glibc's mallopt parameter numbers (malloc.h)


def retain_freed_memory() -> bool:
    """Ask glibc malloc to keep freed memory in the process (see the module docstring).

    Returns False (nothing changed) where the C library has no ``mallopt`` (not glibc).
    """
    import ctypes
    import ctypes.util

    name = ctypes.util.find_library("c")
    libc = ctypes.CDLL(name) if name else None
    mallopt = getattr(libc, "mallopt", None)
    if mallopt is None:
        return False
    return bool(mallopt(_M_TRIM_THRESHOLD, 2**30)) and bool(mallopt(_M_MMAP_THRESHOLD, 2**25))


def init_default_group(mpi_comm: Any) -> None:
    """torch's default gloo process group for DDP and old+gloo; rank 0 broadcasts the port."""
    rank, size = mpi_comm.Get_rank(), mpi_comm.Get_size()
    timeout = datetime.timedelta(seconds=300)
    if rank == 0:
        store = dist.TCPStore("127.0.0.1", 0, size, True, timeout=timeout, wait_for_workers=False)
        port = mpi_comm.bcast(store.port, root=0)
    else:
        port = mpi_comm.bcast(None, root=0)
        store = dist.TCPStore("127.0.0.1", port, size, False, timeout=timeout)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=size, timeout=timeout)


def rotations(items: Sequence[str], rounds: int) -> Iterator[list[str]]:
    """Round ``r`` runs the items starting at index ``r mod len``: every item goes first in turn."""
    for r in range(rounds):
        k = r % len(items)
        yield list(items[k:]) + list(items[:k])


def quartiles(values: Sequence[float]) -> tuple[float, float, float]:
    """(25th percentile, median, 75th percentile), by ``statistics.quantiles`` (exclusive)."""
    q1, med, q3 = statistics.quantiles(values, n=4)
    return q1, med, q3


def param_digest(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1).double() for p in model.parameters()])


def bench_model(
    model_name: str, variant_names: Sequence[str], args: argparse.Namespace, mpi_comm: Any,
    options: dict[str, Any],
) -> dict[str, Any]:
    from mpi4py import MPI

    rank = mpi_comm.Get_rank()
    base = build_model(model_name)
    nparams = sum(p.numel() for p in base.parameters())
    batches = make_batches(model_name, rank)
    psgd = (args.powersgd_rank, args.powersgd_start_iter)
    variants = {name: build_variant(name, base, args.lr, options, psgd) for name in variant_names}
    step_index = {name: 0 for name in variant_names}

    def run(name: str, steps: int, times: list[float] | None, faults: list[int] | None = None,
            fwd_bwd: list[float] | None = None) -> None:
        v = variants[name]
        for _ in range(steps):
            x, y = batches[step_index[name] % len(batches)]
            step_index[name] += 1
            f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
            t0 = time.perf_counter()
            fb = v.step(x, y)
            if times is not None:
                times.append(time.perf_counter() - t0)
            if fwd_bwd is not None:
                fwd_bwd.append(fb)
            if faults is not None:
                faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0)

    for name in variant_names:  # warm-up
        mpi_comm.Barrier()
        run(name, args.warmup, None)
    local: dict[str, list[float]] = {name: [] for name in variant_names}
    faults: dict[str, list[int]] = {name: [] for name in variant_names}
    fwd_bwd: dict[str, list[float]] = {name: [] for name in variant_names}
    for order in rotations(list(variant_names), args.steps):
        for name in order:
            mpi_comm.Barrier()
            run(name, 1, local[name], faults[name], fwd_bwd[name])
    gathered = mpi_comm.gather(local, root=0)
    gathered_faults = mpi_comm.gather(faults, root=0)
    gathered_fb = mpi_comm.gather(fwd_bwd, root=0)
    layouts = {name: v.layout() for name, v in variants.items()}

    # Every variant did the same steps on the same data: the distributed ones must agree.
    digests = {name: param_digest(v.model) for name, v in variants.items()}
    spread = {}
    for name, d in digests.items():
        lo, hi = d.clone(), d.clone()
        mpi_comm.Allreduce(MPI.IN_PLACE, lo.numpy(), op=MPI.MIN)
        mpi_comm.Allreduce(MPI.IN_PLACE, hi.numpy(), op=MPI.MAX)
        spread[name] = float((hi - lo).abs().max())
    ref = digests.get("ddp")
    vs_ddp = {n: (None if ref is None else float((d - ref).abs().max()))
              for n, d in digests.items()}
    for v in variants.values():
        v.close()
    if rank != 0:
        return {}
    tensors = sum(1 for _ in base.parameters())
    out: dict[str, Any] = {"model": model_name, "params": nparams, "param_tensors": tensors,
                           "variants": {}}
    job = {name: [max(g[name][i] for g in gathered) for i in range(len(gathered[0][name]))]
           for name in variant_names}
    job_fb = {name: [max(g[name][i] for g in gathered_fb) for i in range(len(gathered[0][name]))]
              for name in variant_names}
    per_param = per_param_costs(job_fb, tensors)
    for name in variant_names:
        per_step = job[name]
        q1, med, q3 = quartiles(per_step)
        backend = name.split("+")[1] if "+" in name else ""
        refs = {"ddp": "ddp", "old": f"old+{backend}" if name.startswith("gradcomm+") else ""}
        if name.endswith("+powersgd"):
            refs.update(plain=name.removesuffix("+powersgd"), ddp_psgd="ddp+powersgd")
        if name.endswith("+nocheck"):
            refs.update(plain=name.removesuffix("+nocheck"))
        paired = {key: (statistics.median(a / b for a, b in zip(per_step, job[ref], strict=True))
                        if ref in job else None) for key, ref in refs.items()}
        step_faults = [max(g[name][i] for g in gathered_faults) for i in range(len(per_step))]
        out["variants"][name] = {
            "median_ms": med * 1e3, "q1_ms": q1 * 1e3, "q3_ms": q3 * 1e3,
            "page_faults_per_step": statistics.median(step_faults),
            "buckets": layouts[name],
            "iqr_ms": (q3 - q1) * 1e3, "steps": len(per_step),
            "step_ms": [t * 1e3 for t in per_step],
            "param_spread_across_ranks": spread[name],
            "max_abs_param_diff_vs_ddp": vs_ddp[name],
            "x_ddp": paired["ddp"], "x_old": paired["old"],
            "x_plain": paired.get("plain"), "x_ddp_powersgd": paired.get("ddp_psgd"),
            "fwd_bwd_median_ms": statistics.median(job_fb[name]) * 1e3,
            **per_param.get(name, {}),
        }
    return out


def per_param_costs(fwd_bwd: dict[str, list[float]], tensors: int) -> dict[str, dict[str, Any]]:
    """Each wrapped variant's cost per parameter tensor, in microseconds: the median over rounds
    of (its forward+backward seconds - ``local``'s in the same round), divided by ``tensors``
    (paired, as the step ratios, so load that drifts between rounds cancels); and its ratio to
    DDP's (issue 23's measure). Empty without a ``local`` variant."""
    if "local" not in fwd_bwd:
        return {}
    base = fwd_bwd["local"]
    cost = {name: statistics.median(a - b for a, b in zip(t, base, strict=True)) / tensors * 1e6
            for name, t in fwd_bwd.items() if name != "local"}
    ddp = cost.get("ddp")
    return {name: {"us_per_param": c,
                   "per_param_x_ddp": None if ddp is None or ddp <= 0 else c / ddp}
            for name, c in cost.items()}


# ----------------------------------------------------------------------------- report
def ratio(result: dict[str, Any], a: str, b: str) -> float | None:
    """Median over rounds of ``time(a) / time(b)`` in the same round (None if one is missing)."""
    v = result["variants"]
    if a not in v or b not in v:
        return None
    if b == "ddp":
        return v[a]["x_ddp"]  # type: ignore[no-any-return]
    if b.startswith("old+") and v[a]["x_old"] is not None:
        return v[a]["x_old"]  # type: ignore[no-any-return]
    return float(v[a]["median_ms"] / v[b]["median_ms"])


def table(result: dict[str, Any]) -> list[str]:
    lines = [
        f"model {result['model']} ({result['params'] / 1e6:.2f}M params)",
        "  (x ddp, x old: median over rounds of the paired per-round ratio; rank spread: max abs"
        " difference of the final parameters between ranks; vs ddp: max abs difference from"
        " DDP's final parameters (0: bit-identical); faults: minor page faults per step)",
        f"  {'variant':<22} {'median ms':>10} {'IQR ms':>8} {'x ddp':>7} {'x old':>7}"
        f" {'rank spread':>12} {'vs ddp':>9} {'faults':>7} {'x plain':>8} {'x ddp+psgd':>10}",
    ]
    for name, v in result["variants"].items():
        backend = name.split("+")[1] if "+" in name else ""
        x_ddp = ratio(result, name, "ddp")
        x_old = ratio(result, name, f"old+{backend}") if name.startswith("gradcomm+") else None
        diff = v["max_abs_param_diff_vs_ddp"]
        extra = [v.get("x_plain"), v.get("x_ddp_powersgd")]
        plain, vs_psgd = ("" if x is None or name == "ddp+powersgd" else f"{x:.3f}"
                          for x in extra)
        lines.append(
            f"  {name:<22} {v['median_ms']:>10.2f} {v['iqr_ms']:>8.2f} "
            f"{'' if x_ddp is None else f'{x_ddp:.3f}':>7} "
            f"{'' if x_old is None else f'{x_old:.3f}':>7} "
            f"{v['param_spread_across_ranks']:>12.1e} {'' if diff is None else f'{diff:.1e}':>9}"
            f" {v.get('page_faults_per_step', 0):>7.0f} {plain:>8} {vs_psgd:>10}"
        )
    if result["model"] in MANY_PARAM_MODELS:
        lines.append(f"  per parameter ({result.get('param_tensors')} tensors; median over rounds"
                     " of forward+backward minus local's, divided by the tensors):")
        for name, v in result["variants"].items():
            if v.get("us_per_param") is not None:
                x = v.get("per_param_x_ddp")
                lines.append(f"    {name:<22} fwd+bwd {v['fwd_bwd_median_ms']:>8.2f} ms "
                             f"{v['us_per_param']:>7.2f} us/param "
                             f"{'' if x is None else f'{x:.3f}x ddp'}")
    for name, v in result["variants"].items():
        lay = v.get("buckets")
        if lay:
            lines.append(
                f"  {name}: buckets {lay['bucket_mib']} MiB (first cap {lay['first_bucket_cap_mb']}"
                f" MiB; in place: {lay.get('in_place', [])}; "
                f"background_progress={lay['background_progress']})"
            )
    return lines


def targets(results: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Issue 3's step-time targets and issue 23's per-parameter ones (the many-parameter
    models), each with the measured ratio and whether it holds."""
    checks: list[dict[str, Any]] = []
    for res in results:
        if res["model"] in MANY_PARAM_MODELS:  # issue 23: the per-parameter cost
            for name in ("gradcomm+gloo", "gradcomm+mpi"):
                r = res["variants"].get(name, {}).get("per_param_x_ddp")
                if r is not None:
                    checks.append({"target": f"{name} per-param cost <= 1.0x ddp "
                                             f"({res['model']})", "ratio": r, "holds": r <= 1.0})
            continue
        r = ratio(res, "gradcomm+gloo", "ddp")
        if r is not None:
            checks.append({"target": f"gradcomm+gloo <= 1.0x ddp ({res['model']})",
                           "ratio": r, "holds": r <= 1.0})
        if res["model"] == "mlp":
            for name, limit, ref in (("gradcomm+mpi", 0.75, "ddp"),
                                     ("gradcomm+gloo", 0.9, "old+gloo"),
                                     ("gradcomm+mpi", 0.9, "old+mpi")):
                r = ratio(res, name, ref)
                if r is not None:
                    checks.append({"target": f"{name} <= {limit}x {ref} (mlp)",
                                   "ratio": r, "holds": r <= limit})
    return checks


def _mib_or_auto(text: str) -> float | None:
    """argparse type: a number of MiB (``inf``: none in place), or ``auto`` (None)."""
    if text.strip().lower() == "auto":
        return None
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number of MiB or 'auto': {text!r}") from None


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default=",".join(MODELS),
                   help=f"comma-separated subset of {','.join(MODELS)} (default: all)")
    p.add_argument("--variants", default=",".join(VARIANTS),
                   help=f"comma-separated subset of {','.join(KNOWN_VARIANTS)} (default: all "
                        "but the powersgd ones)")
    p.add_argument("--powersgd-rank", type=int, default=1,
                   help="matrix_approximation_rank of the powersgd variants (default 1)")
    p.add_argument("--powersgd-start-iter", type=int, default=2,
                   help="start_powerSGD_iter of the powersgd variants (default 2: torch's "
                        "smallest with error feedback; the warm-up steps cover it)")
    p.add_argument("--steps", type=int, default=60,
                   help="timed steps per variant, interleaved (default 60, at least 50)")
    p.add_argument("--warmup", type=int, default=5, help="untimed steps first (default 5)")
    p.add_argument("--lr", type=float, default=0.01, help="SGD learning rate (momentum 0.9)")
    p.add_argument("--bucket-cap-mb", type=float, default=25.0, help="gradcomm bucket cap (MiB)")
    p.add_argument("--first-bucket-cap-mb", type=float, default=None,
                   help="gradcomm cap of bucket 0 (MiB); default: the reducer's choice (1 MiB "
                        "if the transport progresses in the background, else the bucket cap)")
    p.add_argument("--in-place-min-mb", type=_mib_or_auto, default=None,
                   help="gradcomm: gradients of at least this many MiB are reduced in place; "
                        "'inf': none; default 'auto': the reducer's choice per transport (2 MiB "
                        "on mpi, inf on gloo)")
    p.add_argument("--gradient-as-bucket-view", action=argparse.BooleanOptionalAction,
                   default=True, help="gradcomm and ddp: grads are views into the buckets "
                                      "(default on)")
    p.add_argument("--malloc", choices=("retain", "glibc"), default="retain",
                   help="retain: glibc keeps freed memory, so page faults from heap trimming do "
                        "not land on whichever variant runs next (default); glibc: its defaults")
    p.add_argument("--out", type=Path, default=None,
                   help="JSON file (default benchmarks/results/step_time.json, the baseline "
                        "behind the docs' tables: pass --out elsewhere to keep it)")
    args = p.parse_args(argv)
    if args.steps < 50:
        p.error("need --steps >= 50 timed steps")
    if args.warmup < 0:
        p.error("--warmup must be >= 0")
    for flag, cap in (("--bucket-cap-mb", args.bucket_cap_mb),
                      ("--first-bucket-cap-mb", args.first_bucket_cap_mb)):
        if cap is not None and not (math.isfinite(cap) and cap > 0):
            p.error(f"{flag} must be a positive number of MiB, got {cap}")
    if args.in_place_min_mb is not None and not args.in_place_min_mb >= 0:  # inf: none
        p.error(f"--in-place-min-mb must be a number of MiB >= 0, 'inf' or 'auto', got "
                f"{args.in_place_min_mb}")
    for flag, text, known in (("--models", args.models, MODELS),
                              ("--variants", args.variants, KNOWN_VARIANTS)):
        chosen = [v.strip() for v in text.split(",") if v.strip()]
        if not chosen:
            p.error(f"{flag} names nothing; choose from {','.join(known)}")
        unknown = [v for v in chosen if v not in known]
        if unknown:
            p.error(f"{flag}: unknown {', '.join(map(repr, unknown))}; known: {','.join(known)}")
    return args


def gradcomm_options(args: argparse.Namespace) -> dict[str, Any]:
    """The :class:`gradcomm.GradientReducer` keyword arguments that ``args`` select."""
    return {"bucket_cap_mb": args.bucket_cap_mb,
            "first_bucket_cap_mb": args.first_bucket_cap_mb,
            "in_place_min_mb": args.in_place_min_mb,
            "gradient_as_bucket_view": args.gradient_as_bucket_view}


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    from mpi4py import MPI

    mpi_comm = MPI.COMM_WORLD
    rank, size = mpi_comm.Get_rank(), mpi_comm.Get_size()
    models = [m.strip() for m in args.models.split(",") if m.strip()]  # checked by parse_args
    names = [v.strip() for v in args.variants.split(",") if v.strip()]
    options = gradcomm_options(args)
    malloc = args.malloc
    if malloc == "retain" and not retain_freed_memory():
        malloc = "glibc (mallopt unavailable)"
    init_default_group(mpi_comm)
    if rank == 0:
        print(f"{size} ranks, malloc: {malloc}, gradcomm options: {options}", flush=True)
    meta = run_metadata(["mpiexec", "-n", str(size), "python", *sys.argv])
    results = []
    for model in models:
        res = bench_model(model, names, args, mpi_comm, options)
        if rank == 0:
            results.append(res)
            print("\n".join(table(res)), flush=True)
    if rank == 0:
        checks = targets(results)
        print("targets:")
        for c in checks:
            print(f"  {'HOLDS ' if c['holds'] else 'MISSED'} {c['target']}: {c['ratio']:.3f}x")
        doc = {
            "meta": {
                **meta,
                "world_size": size, "steps": args.steps,
                "warmup": args.warmup, "gradcomm_options": options, "malloc": malloc,
                "loadavg_end": list(os.getloadavg()),
                "step": "max over ranks of zero_grad+forward+loss+backward(+reduce)+SGD step",
            },
            "results": results,
            "targets": checks,
        }
        out = args.out or RESULTS_DIR / "step_time.json"
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(doc, indent=1) + "\n")
        print(f"wrote {out}")
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())

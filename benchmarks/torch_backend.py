"""Step time of torch DDP and FSDP2 over the "gradcomm" backend against torch's gloo, and of DDP
over "gradcomm" against gradcomm's own GradientReducer on the same transport.

One job (under ``mpiexec``) makes the default group ``init_process_group("gradcomm")`` with the
transport ``--transport`` (``GRADCOMM_BACKEND``), a torch gloo group over the same ranks, and times
one training step (``zero_grad``, forward, cross-entropy, backward, SGD step; FSDP2: AdamW) of
each variant on the models of ``step_time.py`` (same weights and data for every variant):

* ``ddp+gloo``: ``DistributedDataParallel`` on torch's gloo group;
* ``ddp+gradcomm``: ``DistributedDataParallel`` on the "gradcomm" group;
* ``reducer``: :class:`gradcomm.GradientReducer` on ``gradcomm.init(transport)``;
* ``fsdp2+gloo`` / ``fsdp2+gradcomm``: ``fully_shard`` on each child module and the root, on a
  device mesh of that group (``--fsdp``; fp32, no mixed precision).

DDP variants use ``gradient_as_bucket_view=True`` and the reducer its default options. Variants are
interleaved step by step, in an order rotated every round, so a slow period of a shared machine
hits every variant alike; a step's time is the max over ranks. For each of ``--runs`` runs the
table gives each variant's median step (ms) and the paired ratios (median over rounds of the
per-round ratio): ``ddp+gradcomm / ddp+gloo``, ``ddp+gradcomm / reducer`` and
``fsdp2+gradcomm / fsdp2+gloo``. The JSON (``--out``) records them with the commit and machine.

    mpiexec -n 2 python benchmarks/torch_backend.py --transport mpi --runs 3
    mpiexec -n 2 python benchmarks/torch_backend.py --transport gloo --models mlp
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")  # before torch starts its thread pool

import argparse
import copy
import json
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
from step_time import build_model, make_batches, quartiles, rotations

import gradcomm
from gradcomm.bench.results import run_metadata

MODELS = ("mlp", "conv", "transformer")
RATIOS = (("ddp+gradcomm", "ddp+gloo"), ("ddp+gradcomm", "reducer"),
          ("fsdp2+gradcomm", "fsdp2+gloo"))


class Variant:
    """A model copy, its optimizer and how it is made data-parallel."""

    def __init__(self, name: str, base: nn.Module, group: dist.ProcessGroup | None,
                 comm: gradcomm.Communicator | None) -> None:
        from torch.distributed.device_mesh import DeviceMesh
        from torch.distributed.fsdp import fully_shard

        self.name = name
        model = copy.deepcopy(base)
        self.reducer = None
        if name.startswith("ddp"):
            self.module: nn.Module = nn.parallel.DistributedDataParallel(
                model, process_group=group, gradient_as_bucket_view=True)
        elif name == "reducer":
            self.reducer = gradcomm.GradientReducer(model, comm)
            self.module = model
        else:
            assert group is not None
            mesh = DeviceMesh.from_group(group, "cpu")
            for child in model.children():
                if any(True for _ in child.parameters()):
                    fully_shard(child, mesh=mesh)
            fully_shard(model, mesh=mesh)
            self.module = model
        opt = torch.optim.AdamW if name.startswith("fsdp2") else torch.optim.SGD
        self.optimizer = opt(model.parameters(), lr=1e-3)

    def step(self, x: torch.Tensor, y: torch.Tensor) -> None:
        self.optimizer.zero_grad(set_to_none=True)
        F.cross_entropy(self.module(x), y).backward()
        self.optimizer.step()


def bench_model(model_name: str, names: Sequence[str], args: argparse.Namespace,
                groups: dict[str, dist.ProcessGroup], comm: gradcomm.Communicator,
                ) -> dict[str, Any]:
    base = build_model(model_name)
    batches = make_batches(model_name, dist.get_rank())
    variants = {n: Variant(n, base, groups.get(n.split("+")[-1]), comm) for n in names}
    sync = groups["gloo"]
    runs = []
    for _ in range(args.runs):
        for v in variants.values():
            for i in range(args.warmup):
                v.step(*batches[i % len(batches)])
        times: dict[str, list[float]] = {n: [] for n in names}
        for step, order in enumerate(rotations(list(names), args.steps)):
            x, y = batches[step % len(batches)]
            for name in order:
                dist.barrier(group=sync)
                t0 = time.perf_counter()
                variants[name].step(x, y)
                took = torch.tensor([time.perf_counter() - t0])
                dist.all_reduce(took, op=dist.ReduceOp.MAX, group=sync)
                times[name].append(took.item())
        run: dict[str, Any] = {"median_ms": {}, "iqr_ms": {}, "ratios": {}}
        for name, ts in times.items():
            q1, med, q3 = quartiles(ts)
            run["median_ms"][name] = med * 1e3
            run["iqr_ms"][name] = (q3 - q1) * 1e3
        for a, b in RATIOS:
            if a in times and b in times:
                run["ratios"][f"{a} / {b}"] = statistics.median(
                    x / y for x, y in zip(times[a], times[b], strict=True))
        runs.append(run)
    for v in variants.values():
        if v.reducer is not None:
            v.reducer.remove()
    return {"model": model_name, "runs": runs}


def table(result: dict[str, Any]) -> list[str]:
    runs = result["runs"]
    names = list(runs[0]["median_ms"])
    ratios = list(runs[0]["ratios"])
    lines = [f"\n{result['model']}: median step ms per run (IQR), then paired ratios",
             "| run | " + " | ".join(names + ratios) + " |",
             "|---|" + "---:|" * (len(names) + len(ratios))]
    for i, run in enumerate(runs):
        cells = [f"{run['median_ms'][n]:.1f} ({run['iqr_ms'][n]:.1f})" for n in names]
        cells += [f"{run['ratios'][r]:.3f}" for r in ratios]
        lines.append(f"| {i + 1} | " + " | ".join(cells) + " |")
    return lines


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--transport", default=os.environ.get("GRADCOMM_BACKEND", "mpi"),
                        help="gradcomm transport of the 'gradcomm' group and the reducer")
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--steps", type=int, default=30, help="timed steps per variant per run")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--no-fsdp", dest="fsdp", action="store_false",
                        help="leave out the FSDP2 variants")
    parser.add_argument("--out", type=Path, default=None,
                        help="JSON file (default: torch_backend_<transport>.json in the "
                             "working directory)")
    args = parser.parse_args(argv)
    for m in args.models.split(","):
        if m not in MODELS:
            parser.error(f"unknown model {m!r}; known: {', '.join(MODELS)}")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    os.environ["GRADCOMM_BACKEND"] = args.transport
    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    dist.init_process_group("gradcomm")  # under mpiexec: gradcomm's rendezvous
    meta = run_metadata(["mpiexec", "-n", str(dist.get_world_size()), "python", *sys.argv])
    groups = {"gloo": dist.new_group(backend="gloo"), "gradcomm": dist.group.WORLD}
    comm = gradcomm.init(args.transport)
    names = ["ddp+gloo", "ddp+gradcomm", "reducer"]
    if args.fsdp:
        names += ["fsdp2+gloo", "fsdp2+gradcomm"]
    results = []
    for model in args.models.split(","):
        res = bench_model(model, names, args, groups, comm)
        results.append(res)
        if dist.get_rank() == 0:
            print("\n".join(table(res)), flush=True)
    if dist.get_rank() == 0:
        doc = {"meta": {**meta, "transport": args.transport, "world_size": dist.get_world_size(),
                        "steps": args.steps, "warmup": args.warmup, "runs": args.runs,
                        "loadavg_end": list(os.getloadavg())},
               "results": results}
        out = args.out or Path(f"torch_backend_{args.transport}.json")
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(doc, indent=1) + "\n")
        print(f"wrote {out}")
    comm.close()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())

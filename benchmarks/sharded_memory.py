"""Memory and step time of sharded data parallelism (ZeRO stages 1 and 2) against DDP, per rank.

Variants, each training the same ~50M-parameter MLP (12 ``Linear(2048, 2048)`` layers, float32)
with AdamW (lr 1e-4, weight decay 0.01) on the same random batches:

* ``ddp``: ``torch.nn.parallel.DistributedDataParallel`` (gloo) + ``torch.optim.AdamW``;
* ``ddp+zero``: DDP + torch's ``ZeroRedundancyOptimizer(AdamW)`` (gloo);
* ``gradcomm``: :class:`gradcomm.GradientReducer` + ``torch.optim.AdamW`` (unsharded);
* ``gradcomm-zero1`` / ``gradcomm-zero2``: the same reducer + :class:`gradcomm.ShardedOptimizer`
  of stage 1 / 2.

The gradcomm variants run on ``--backend`` (gloo or mpi); the torch ones always on gloo (torch's
pip wheels have no MPI process group). Per rank, counted from the tensors themselves after the
last timed backward (gradients) and step (the rest): ``state_mib`` (every tensor in the
optimizer's state), ``grad_mib`` (``param.grad`` and, in stage 2, the kept gradient shards),
``comm_mib`` (bucket buffers: DDP's as its comm hook sees them, ``GradBucket.buffer()``; the
reducer's; the sharded optimizer's two all-gather buffers); ``peak_rss_mib`` (the process's peak
resident set, ``ru_maxrss``; one job per variant so peaks do not mix) and ``step_ms`` (median over
the timed steps of zero_grad + forward + backward + step, each after a barrier; max over ranks).
Bucket caps 25 MiB everywhere; gradcomm reduces no gradient in place (``in_place_min_mb=inf``) so
every variant has the same bucket layout.

Run (the driver launches one ``mpiexec`` job per world size, backend and variant and writes one
result file)::

    python benchmarks/sharded_memory.py --out benchmarks/results/sharded_memory.json
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")  # before torch starts its thread pool

import argparse
import json
import math
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

VARIANTS = ("ddp", "ddp+zero", "gradcomm", "gradcomm-zero1", "gradcomm-zero2")
MIB = 2.0 ** 20


def build_model() -> nn.Module:
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for _ in range(12):
        layers += [nn.Linear(2048, 2048), nn.ReLU()]
    return nn.Sequential(*layers)


def nbytes(t: torch.Tensor | None) -> int:
    return 0 if t is None else t.numel() * t.element_size()


def state_bytes(opt: torch.optim.Optimizer) -> int:
    return sum(nbytes(v) for st in opt.state.values() for v in st.values()
               if isinstance(v, torch.Tensor))


def worker(variant: str, backend: str, steps: int, warmup: int, out: Path) -> None:
    import torch.distributed as dist
    from mpi4py import MPI
    from step_time import init_default_group  # benchmarks/ is sys.path[0]

    import gradcomm

    world = MPI.COMM_WORLD
    rank = world.Get_rank()
    torch.set_num_threads(1)
    model = build_model()
    comm_bytes = {}
    opt: Any
    if variant.startswith("ddp"):
        from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
        from torch.distributed.optim import ZeroRedundancyOptimizer

        init_default_group(world)
        ddp = nn.parallel.DistributedDataParallel(model)

        def seen(state, bucket):  # type: ignore[no-untyped-def]  # DDP checks annotations
            state[bucket.index()] = nbytes(bucket.buffer())
            return allreduce_hook(None, bucket)  # type: ignore[arg-type]

        ddp.register_comm_hook(comm_bytes, seen)
        net: nn.Module = ddp
        if variant == "ddp":
            opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.01)
        else:
            opt = ZeroRedundancyOptimizer(model.parameters(), torch.optim.AdamW, lr=1e-4,
                                          weight_decay=0.01)
    else:
        comm = gradcomm.init(backend)
        reducer = gradcomm.GradientReducer(model, comm, in_place_min_mb=math.inf)
        net = model
        if variant == "gradcomm":
            opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.01)
        else:
            opt = gradcomm.ShardedOptimizer(reducer, torch.optim.AdamW, stage=int(variant[-1]),
                                            lr=1e-4, weight_decay=0.01)
    gen = torch.Generator().manual_seed(rank)
    x, y = torch.randn(16, 2048, generator=gen), torch.randn(16, 2048, generator=gen)
    times, grads = [], 0
    for i in range(warmup + steps):
        world.Barrier()
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        ((net(x) - y) ** 2).mean().backward()
        grads = sum(nbytes(p.grad) for p in model.parameters())
        if isinstance(opt, gradcomm.ShardedOptimizer):
            grads = opt.memory_bytes()["gradients"]
        opt.step()
        if i >= warmup:
            times.append(time.perf_counter() - t0)
    if isinstance(opt, gradcomm.ShardedOptimizer):
        mem = opt.memory_bytes()
        state, comm_total = mem["optimizer_state"], mem["comm_buffers"]
    elif variant == "gradcomm":
        state = state_bytes(opt)
        comm_total = sum(b.nbytes for b in reducer.buckets)
    else:
        state = state_bytes(opt.optim if variant == "ddp+zero" else opt)
        comm_total = sum(comm_bytes.values())
    row = {"state_mib": state / MIB, "grad_mib": grads / MIB, "comm_mib": comm_total / MIB,
           "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
           "step_ms": statistics.median(times) * 1e3}
    rows = world.gather(row, root=0)
    if rank == 0:
        job = {k: max(r[k] for r in rows) for k in row}
        job["params_m"] = sum(p.numel() for p in model.parameters()) / 1e6
        out.write_text(json.dumps(job))
    if variant.startswith("ddp"):
        dist.destroy_process_group()
    else:
        comm.close()


def run_all(args: argparse.Namespace) -> dict[str, Any]:
    from gradcomm.bench.results import run_metadata

    meta = run_metadata()
    here = Path(__file__).resolve()
    mpiexec = Path(sys.executable).parent / "mpiexec"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env["PYTHONPATH"] = os.pathsep.join([str(here.parent.parent), env.get("PYTHONPATH", "")])
    results: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmp:
        for backend in args.backends:
            for n in args.world_sizes:
                for variant in VARIANTS:
                    path = Path(tmp) / "row.json"
                    cmd = [str(mpiexec), "-n", str(n), sys.executable, str(here), "--worker",
                           variant, "--backend", backend, "--steps", str(args.steps),
                           "--warmup", str(args.warmup), "--row", str(path)]
                    subprocess.run(cmd, check=True, env=env, timeout=1200)
                    row = {"backend": backend, "world_size": n, "variant": variant,
                           **json.loads(path.read_text())}
                    print(json.dumps(row), flush=True)
                    results.append(row)
    meta.update({"world_size": " and ".join(map(str, args.world_sizes)), "steps": args.steps,
                 "warmup": args.warmup, "model": "12 x Linear(2048, 2048)", "optimizer": "AdamW",
                 "loadavg_end": list(os.getloadavg())})
    return {"meta": meta, "sharded": results}


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    p.add_argument("--backends", nargs="+", default=["gloo", "mpi"], choices=("gloo", "mpi"))
    p.add_argument("--world-sizes", nargs="+", type=int, default=[2, 4])
    p.add_argument("--steps", type=int, default=5, help="timed steps (default 5)")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps first (default 3)")
    p.add_argument("--out", type=Path, default=None, help="write the result file here (JSON)")
    p.add_argument("--worker", choices=VARIANTS, help=argparse.SUPPRESS)
    p.add_argument("--backend", default="gloo", help=argparse.SUPPRESS)
    p.add_argument("--row", type=Path, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.steps < 1 or args.warmup < 1 or min(args.world_sizes) < 2:
        p.error("need --steps >= 1, --warmup >= 1 and world sizes >= 2")
    if args.worker:
        worker(args.worker, args.backend, args.steps, args.warmup, args.row)
        return 0
    doc = run_all(args)
    import report  # benchmarks/ is sys.path[0]

    print("\n".join(report.sharded_memory_table(doc)))
    if args.out is not None:
        args.out.write_text(json.dumps(doc, indent=1) + "\n")
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

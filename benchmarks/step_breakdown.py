"""Where a training step's time goes: forward, backward, the reducer's gradient hooks, optimizer.

``step_time.py`` gives whole steps; this script splits them, for one model and one transport,
into phases, for three variants built as ``step_time.py`` builds them (the same model, data,
retained memory and gradcomm options): ``local`` (no communication), ``old+<backend>`` (the
end-of-backward algorithm) and ``gradcomm+<backend>``. Rounds are interleaved and each step is
preceded by a barrier, as there. Per step and rank it times

* ``forward``: ``zero_grad()`` (``set_to_none=True``), forward and loss;
* ``backward``: ``loss.backward()``, which includes the gradient reduction of both algorithms;
* ``hooks`` (gradcomm only, inside ``backward``): the time spent in the reducer's
  post-accumulate-grad hooks, i.e. staging each gradient into its bucket (one pre-dividing copy)
  and launching the buckets that filled. It is bracketed with public API only: this script
  registers a post-accumulate-grad hook on every parameter just before the reducer is built and
  another just after, and torch runs a parameter's hooks of that kind in registration order;
* ``optimizer``: the SGD step (momentum 0.9).

The table gives each phase's median over steps (the max over ranks of the per-rank medians), and
``backward - local`` = the variant's backward minus ``local``'s: for ``old`` that is its
end-of-backward flush (flatten, all-reduce, divide, copy back); for gradcomm it is the hooks plus
the end-of-backward flush (launch what is left, wait, re-point the grads).

Run (2 ranks on 2 cores; OMP_NUM_THREADS=1 per rank is set here if unset)::

    mpiexec -n 2 python benchmarks/step_breakdown.py --model mlp --backend gloo
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")  # before torch starts its thread pool

import argparse
import json
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import report  # report and step_time: the benchmarks/ directory is sys.path[0]
import step_time as st
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from gradcomm.bench.results import run_metadata

PHASES = ("forward", "backward", "hooks", "optimizer", "step")


class BracketedGradcomm(st.GradcommVariant):
    """``step_time``'s gradcomm variant with the reducer's gradient hooks timed (see above)."""

    def wrap(self, model: nn.Module) -> nn.Module:
        self.hook_s = 0.0
        self._entered = 0.0
        params = [p for p in model.parameters() if p.requires_grad]
        for p in params:
            p.register_post_accumulate_grad_hook(self._enter)
        wrapped = super().wrap(model)
        for p in params:
            p.register_post_accumulate_grad_hook(self._leave)
        return wrapped

    def _enter(self, _param: torch.Tensor) -> None:
        self._entered = time.perf_counter()

    def _leave(self, _param: torch.Tensor) -> None:
        self.hook_s += time.perf_counter() - self._entered


def timed_step(v: st.Variant, x: torch.Tensor, y: torch.Tensor) -> dict[str, float]:
    """One training step of ``v`` (as :meth:`step_time.Variant.step`), its phases in seconds."""
    clock = time.perf_counter
    hooks_before = getattr(v, "hook_s", 0.0)
    t0 = clock()
    v.optimizer.zero_grad(set_to_none=True)
    loss = F.cross_entropy(v.module(x), y)
    t1 = clock()
    loss.backward()
    t2 = clock()
    v.optimizer.step()
    t3 = clock()
    return {"forward": t1 - t0, "backward": t2 - t1,
            "hooks": getattr(v, "hook_s", 0.0) - hooks_before, "optimizer": t3 - t2,
            "step": t3 - t0}


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", choices=st.MODELS, default="mlp")
    p.add_argument("--backend", choices=("gloo", "mpi"), default="gloo")
    p.add_argument("--steps", type=int, default=100, help="timed steps per variant (default 100)")
    p.add_argument("--warmup", type=int, default=5, help="untimed steps first (default 5)")
    p.add_argument("--out", type=Path, default=None, help="also write the numbers here (JSON)")
    args = p.parse_args(argv)
    if args.steps < 10:
        p.error("need --steps >= 10")
    if args.warmup < 0:
        p.error("--warmup must be >= 0")
    if args.out is not None and (args.out.is_dir() or not args.out.resolve().parent.is_dir()):
        p.error(f"--out {args.out}: not a file in an existing directory")  # before measuring
    from mpi4py import MPI

    if MPI.COMM_WORLD.Get_size() < 2:  # one process, or torchrun (whose ranks are MPI singletons)
        p.error("run under mpiexec with 2 or more ranks, e.g. "
                "mpiexec -n 2 python benchmarks/step_breakdown.py")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    from mpi4py import MPI

    world = MPI.COMM_WORLD
    rank, size = world.Get_rank(), world.Get_size()
    meta = run_metadata(["mpiexec", "-n", str(size), "python", *sys.argv])
    malloc = "retain" if st.retain_freed_memory() else "glibc (mallopt unavailable)"
    st.init_default_group(world)
    base = st.build_model(args.model)
    batches = st.make_batches(args.model, rank)
    options = st.gradcomm_options(st.parse_args([]))  # step_time.py's defaults
    variants: dict[str, st.Variant] = {
        "local": st.build_variant("local", base, 0.01, options),
        f"old+{args.backend}": st.build_variant(f"old+{args.backend}", base, 0.01, options),
        f"gradcomm+{args.backend}": BracketedGradcomm(base, 0.01, args.backend, options),
    }
    names = list(variants)
    times: dict[str, dict[str, list[float]]] = {n: {ph: [] for ph in PHASES} for n in names}
    for name in names:
        for i in range(args.warmup):
            world.Barrier()
            timed_step(variants[name], *batches[i % len(batches)])
    for r, order in enumerate(st.rotations(names, args.steps)):
        for name in order:
            world.Barrier()
            for ph, sec in timed_step(variants[name], *batches[r % len(batches)]).items():
                times[name][ph].append(sec)
    medians = {n: {ph: statistics.median(v) * 1e3 for ph, v in by.items()}
               for n, by in times.items()}
    gathered = world.gather(medians, root=0)
    layout = variants[f"gradcomm+{args.backend}"].layout()
    for v in variants.values():
        v.close()
    if rank == 0:
        job = {n: {ph: max(g[n][ph] for g in gathered) for ph in PHASES} for n in names}
        doc: dict[str, Any] = {
            "meta": {
                **meta,
                "world_size": size, "model": args.model, "backend": args.backend,
                "steps": args.steps, "malloc": malloc, "loadavg_end": list(os.getloadavg()),
                "gradcomm_options": options, "gradcomm_buckets": layout,
            },
            "median_ms": job,
        }
        print("\n".join(report.step_breakdown_table(doc)), flush=True)
        if args.out is not None:
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text(json.dumps(doc, indent=1) + "\n")
            print(f"wrote {args.out}")
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())

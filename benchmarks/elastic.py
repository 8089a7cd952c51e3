"""Fault tolerance: recovery time, rejoin time, and the step time with the feature on and off.

One run starts a coordinator (in this process) and worker processes of this script:

1. **Step time** (``--world-size`` workers, 4 by default): every worker trains two copies of
   the same model, step by step in alternation (the order swapped every step, so a slow moment
   of a shared machine hits both): ``off`` -- a :class:`gradcomm.GradientReducer` over
   ``gradcomm.init``'s gloo communicator (rendezvous at the coordinator's store) -- and ``on``
   -- a reducer over an :class:`gradcomm.elastic.ElasticGroup`'s communicator, the step taken from
   ``group.steps()`` and run in ``with step:`` (the generator's and the step's work are timed).
   The group's monitor thread heartbeats meanwhile, for both (20 small store calls a second).
   After ``--warmup`` untimed steps, ``--rounds`` rounds of ``--steps`` steps each are timed on
   rank 0 (every step ends in an all-reduce, so all ranks finish it together); per round the
   ratio is the ``on`` median over the ``off`` median, and the result the median over rounds.
   Models:
   ``digits`` (examples/train_digits.py's MLP, 64-128-10, global batch 64) and ``transformer``
   (benchmarks/step_time.py's TinyTransformer, batch 8 x 32 tokens per rank).
2. **Recovery and rejoin** (the digits MLP, ``--timeout 10 --heartbeat-timeout 2``, the settings
   docs/fault-tolerance.md documents): ``--cycles`` times, a worker is killed with SIGKILL while
   the job trains and a replacement is started once the survivors train again. Recovery: from the
   kill to the survivors' next completed step. Rejoin: from the replacement's ElasticGroup
   creation (its imports done) to its first completed step; ``start to step`` adds the process's
   start-up.

Run (4 workers on a 2-core machine are oversubscribed: compare ratios, not absolute times)::

    python benchmarks/elastic.py --out benchmarks/results/elastic.json

The JSON holds the provenance (``gradcomm.bench.results.run_metadata``), every phase's step
times and the recovery and rejoin times.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")  # before torch starts its thread pool

import argparse
import json
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

import gradcomm
from gradcomm import elastic
from gradcomm.bench.results import run_metadata
from gradcomm.elastic.coordinator import connect, serve

HERE = Path(__file__).resolve()
MODELS = ("digits", "transformer")
ELASTIC = dict(timeout=10.0, heartbeat_timeout=2.0)  # docs/fault-tolerance.md's settings


# ----------------------------------------------------------------------------- models and data
def build_model(name: str) -> nn.Module:
    torch.manual_seed(0)
    if name == "digits":
        return nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10))
    sys.path.insert(0, str(HERE.parent))
    from step_time import TinyTransformer  # the model of benchmarks/step_time.py

    return TinyTransformer()


def batch(name: str, rank: int, world_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1000 + rank)
    if name == "digits":  # this rank's share of a global batch of 64
        x = torch.randn(64 // world_size, 64, generator=gen)
    else:
        x = torch.randint(0, 1000, (8, 32), generator=gen)
    return x, torch.randint(0, 10, (x.shape[0],), generator=gen)


def train_step(model: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor,
               y: torch.Tensor) -> None:
    opt.zero_grad()
    nn.functional.cross_entropy(model(x), y).backward()
    opt.step()


# ----------------------------------------------------------------------------- worker: step time
def step_time_worker(args: argparse.Namespace) -> None:
    """Time ``off`` and ``on`` steps in alternation, per model: two copies of the model, one
    with a GradientReducer over ``gradcomm.init``'s gloo communicator, one under an
    ElasticGroup (its steps taken from ``group.steps()``, the generator's work timed too)."""
    import logging

    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(message)s")
    rank = args.rank
    store = connect(args.coordinator, 60.0)
    # "off" rendezvouses through the coordinator's store too, with a client of its own
    host, port = args.coordinator.rsplit(":", 1)
    env = {"MASTER_ADDR": host, "MASTER_PORT": port, "TORCHELASTIC_USE_AGENT_STORE": "True"}
    for name in args.models:
        off_model, on_model = build_model(name), build_model(name)
        off_opt = torch.optim.SGD(off_model.parameters(), lr=0.01)
        on_opt = torch.optim.SGD(on_model.parameters(), lr=0.01)
        x, y = batch(name, rank, args.world_size)
        total = args.warmup + args.rounds * args.steps
        times: dict[str, list[float]] = {"off": [], "on": []}
        state = elastic.State(on_model, on_opt)
        with gradcomm.init("gloo", rank=rank, world_size=args.world_size, env=env,
                           timeout=60.0) as comm, elastic.ElasticGroup(
                state, lambda c, st: gradcomm.GradientReducer(st.model, c),
                coordinator=args.coordinator, backend="gloo", job_id=f"bench-{name}",
                world_size=args.world_size, min_world_size=args.world_size,
                **ELASTIC) as group:
            gradcomm.GradientReducer(off_model, comm)
            steps = iter(group.steps(total))
            for i in range(total):
                for mode in (("off", "on") if i % 2 == 0 else ("on", "off")):
                    start = time.perf_counter()
                    if mode == "off":
                        train_step(off_model, off_opt, x, y)
                    else:
                        with next(steps):
                            train_step(on_model, on_opt, x, y)
                    if i >= args.warmup:
                        times[mode].append(time.perf_counter() - start)
            assert next(steps, None) is None  # the final agreement
        if rank == 0:
            store.set(f"bench/{name}", json.dumps(times))


# ----------------------------------------------------------------------------- worker: recovery
def train_worker(args: argparse.Namespace) -> None:
    """Train the digits MLP under ElasticGroup until killed; append 'time step world_size
    created' per completed step to ``--progress`` (``created``: when its ElasticGroup was)."""
    import logging

    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(message)s")
    model = build_model("digits")
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    state = elastic.State(model, opt)
    created = time.time()
    with elastic.ElasticGroup(state, lambda comm, st: gradcomm.GradientReducer(st.model, comm),
                              coordinator=args.coordinator, backend="gloo", job_id="recovery",
                              world_size=args.world_size, min_world_size=2,
                              **ELASTIC) as group, args.progress.open("a") as out:
        for step in group.steps(10**9):
            with step as comm:
                x, y = batch("digits", comm.rank, comm.world_size)
                train_step(model, opt, x, y)
            out.write(f"{time.time():.4f} {state.step} {group.world_size} {created:.4f}\n")
            out.flush()
            time.sleep(0.005)


# ----------------------------------------------------------------------------- the launcher
def spawn(args: argparse.Namespace, mode: str, rank: int, progress: Path | None = None
          ) -> subprocess.Popen[bytes]:
    cmd = [sys.executable, str(HERE), "--worker", mode, "--rank", str(rank), "--coordinator",
           args.address, "--world-size", str(args.world_size), "--steps", str(args.steps),
           "--warmup", str(args.warmup), "--rounds", str(args.rounds), "--models", *args.models]
    if progress is not None:
        cmd += ["--progress", str(progress)]
    log = (args.work / f"{mode}{rank}.log").open("w")  # stderr: the worker's traceback, if any
    return subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=log)


def read_progress(path: Path) -> list[tuple[float, int, int, float]]:
    if not path.exists():
        return []
    rows = []
    for line in path.read_text().splitlines():
        parts = line.split()
        if len(parts) == 4:
            rows.append((float(parts[0]), int(parts[1]), int(parts[2]), float(parts[3])))
    return rows


def wait_until(test: Any, timeout: float, what: str) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = test()
        if got:
            return got
        time.sleep(0.02)
    raise RuntimeError(f"timed out waiting for {what}")


def measure_step_time(args: argparse.Namespace, store: dist.Store) -> dict[str, Any]:
    procs = [spawn(args, "steptime", r) for r in range(args.world_size)]
    for p in procs:
        if p.wait(timeout=args.run_timeout) != 0:
            raise RuntimeError(f"a step-time worker exited {p.returncode}: see {args.work}")
    out: dict[str, Any] = {}
    for name in args.models:
        times = json.loads(store.get(f"bench/{name}"))
        on, off = times["on"], times["off"]
        rounds = [statistics.median(on[k:k + args.steps]) / statistics.median(off[k:k + args.steps])
                  for k in range(0, len(on), args.steps)]
        out[name] = {"on_ms": [t * 1e3 for t in on], "off_ms": [t * 1e3 for t in off],
                     "median_on_ms": statistics.median(on) * 1e3,
                     "median_off_ms": statistics.median(off) * 1e3,
                     "round_ratios": rounds, "ratio": statistics.median(rounds)}
    return out


def measure_recovery(args: argparse.Namespace, work: Path) -> list[dict[str, float]]:
    procs = {}
    for r in range(args.world_size):
        procs[r] = spawn(args, "train", r, work / f"progress{r}")

    def rows() -> list[tuple[float, int, int, float]]:
        return sorted(row for r in procs for row in read_progress(work / f"progress{r}"))

    cycles = []
    try:
        for cycle in range(args.cycles):
            victim = min(r for r, p in procs.items() if p.poll() is None)
            start_step = (rows()[-1][1] if rows() else 0) + 20
            wait_until(lambda s=start_step: rows() and rows()[-1][1] >= s, args.run_timeout,
                       f"step {start_step}")
            procs[victim].send_signal(signal.SIGKILL)
            killed = time.time()
            after = wait_until(lambda t=killed: [r for r in rows() if r[0] > t
                                                 and r[2] == args.world_size - 1],
                               args.run_timeout, "the survivors' next step")[0]
            new = max(procs) + 1
            started = time.time()
            procs[new] = spawn(args, "train", new, work / f"progress{new}")
            first = wait_until(lambda n=new: read_progress(work / f"progress{n}"),
                               args.run_timeout, "the replacement's first step")[0]
            cycles.append({"cycle": cycle, "killed_at_step": after[1] - 1,
                           "recovery_s": after[0] - killed, "rejoin_s": first[0] - first[3],
                           "start_to_step_s": first[0] - started})
            print(f"cycle {cycle}: recovery {cycles[-1]['recovery_s']:.2f} s, rejoin "
                  f"{cycles[-1]['rejoin_s']:.2f} s", flush=True)
    finally:
        for p in procs.values():
            p.kill()
            p.wait()
    return cycles


def main() -> int:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    p.add_argument("--models", nargs="+", default=list(MODELS), choices=MODELS)
    p.add_argument("--world-size", type=int, default=4)
    p.add_argument("--rounds", type=int, default=6, help="on/off pairs per model (default 6)")
    p.add_argument("--steps", type=int, default=60, help="timed steps per phase (default 60)")
    p.add_argument("--warmup", type=int, default=10, help="untimed steps per phase")
    p.add_argument("--cycles", type=int, default=3, help="kill/replace cycles (default 3)")
    p.add_argument("--run-timeout", type=float, default=900.0)
    p.add_argument("--out", type=Path, default=None, help="write the JSON result here")
    p.add_argument("--worker", choices=("steptime", "train"), default=None,
                   help=argparse.SUPPRESS)
    p.add_argument("--rank", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--coordinator", default=None, help=argparse.SUPPRESS)
    p.add_argument("--progress", type=Path, default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    torch.set_num_threads(1)
    if args.worker == "steptime":
        step_time_worker(args)
        return 0
    if args.worker == "train":
        train_worker(args)
        return 0
    meta = run_metadata()
    server = serve("127.0.0.1", 0)
    args.address = f"127.0.0.1:{server.port}"
    store = connect(args.address, 60.0)
    work = Path(os.environ.get("TMPDIR", "/tmp")) / f"gradcomm-elastic-bench-{os.getpid()}"
    work.mkdir(parents=True, exist_ok=True)
    args.work = work
    steps = measure_step_time(args, store)
    for name, r in steps.items():
        print(f"{name}: step {r['median_off_ms']:.2f} ms off, {r['median_on_ms']:.2f} ms on; "
              f"on/off {r['ratio']:.3f} (median of {args.rounds} paired rounds)", flush=True)
    cycles = measure_recovery(args, work)
    meta.update(world_size=args.world_size, settings=ELASTIC, steps=args.steps,
                warmup=args.warmup, rounds=args.rounds,
                loadavg_end=list(os.getloadavg()))
    doc = {"meta": meta, "elastic": {"step_time": steps, "recovery": cycles}}
    if args.out is not None:
        args.out.write_text(json.dumps(doc, indent=1) + "\n")
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

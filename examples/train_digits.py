"""Data-parallel training of a small MLP on scikit-learn's bundled digits data, with gradcomm.

The same script runs, unchanged, as::

    python examples/train_digits.py                                   # one process
    torchrun --nproc_per_node 2 examples/train_digits.py              # gloo
    GRADCOMM_BACKEND=mpi  mpiexec -n 2 python examples/train_digits.py
    GRADCOMM_BACKEND=gloo mpiexec -n 2 python examples/train_digits.py  # gloo, rendezvous over MPI

and on GPUs (``--device`` defaults to the communicator's device: ``cuda:<local_rank>`` for nccl
and cupy-nccl, the CPU for gloo and mpi)::

    torchrun --nproc_per_node 2 examples/train_digits.py --backend nccl
    mpiexec -n 2 python examples/train_digits.py --backend cupy-nccl
    GRADCOMM_BACKEND=mpi mpiexec -n 2 python examples/train_digits.py --device cuda  # GPU buffers

Data: ``sklearn.datasets.load_digits`` (1797 8x8 images, 10 classes, shipped with scikit-learn, no
download), split once into train and held-out sets with a fixed seed (identical on every rank),
features standardised with the training set's mean and standard deviation. The model and the data
live on the communicator's device.

Training: every step takes one global batch of ``--batch-size`` samples from a permutation that is
the same on every rank; rank ``r`` trains on its shard ``batch[r::world_size]``. Each rank's loss is
the sum of its samples' cross-entropies times ``world_size / len(batch)``, so after the
:class:`gradcomm.GradientReducer` averages gradients over ranks, every rank holds the gradient of
the mean loss over the whole global batch: results do not depend on the world size beyond float
rounding.

``--comm-hook`` picks how buckets are summed; ``--comm-hook powersgd`` compresses them with
PowerSGD (rank ``--powersgd-rank``, after ``--powersgd-start-iter`` plain steps; docs/powersgd.md).
``--zero 1`` / ``--zero 2`` train with :class:`gradcomm.ShardedOptimizer` (ZeRO stage 1: each rank
keeps the optimizer state of its shard only; stage 2: the averaged gradients too; docs/sharded.md):
same accuracy, less memory per rank.

Fault tolerance: with ``--elastic`` each worker is started on its own (no torchrun, no mpirun)
with ``GRADCOMM_COORDINATOR=host:port`` naming a coordinator (``python -m
gradcomm.elastic``); workers may die, stall or join while it trains, and every worker
that finishes holds the parameters of the uninterrupted run (docs/fault-tolerance.md;
examples/fault_tolerance_demo.sh kills one and starts a replacement; with ``--zero`` the sharded
optimizer is rebuilt over every new communicator from snapshots of its full state)::

    python -m gradcomm.elastic --port 29400 &
    for i in 0 1 2 3; do GRADCOMM_COORDINATOR=127.0.0.1:29400 \
        python examples/train_digits.py --elastic --world-size 4 --min-world-size 2 & done

Output: rank 0 prints one line per epoch (training loss and accuracy, held-out accuracy), then
``final held-out accuracy: 0.XXXX``; it shows a tqdm progress bar on stderr. Log records (stderr)
carry the rank. At the end every rank all-gathers a SHA-256 digest of its parameters through the
communicator; the script prints ``parameters identical on all N ranks`` and exits 0, or exits 1 if
any rank differs. With ``--elastic`` every worker prints its own ``final held-out accuracy``,
``parameters sha256 ...``, ``applied steps N`` and, with ``--reference FILE`` (parameters saved
by a one-process run with ``--save-params FILE``), ``matches one-process run: True|False (max rel
diff D)``, D being the largest ``max|p - q| / max|q|`` over the parameters; it exits 1 unless they
match (relative 1e-5).
"""

from __future__ import annotations

import argparse
import hashlib
import logging
import math
import os
import socket
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import torch
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split
from sklearn.preprocessing import StandardScaler
from torch import nn
from tqdm import tqdm

import gradcomm
from gradcomm import elastic
from gradcomm.comm import detect_launch
from gradcomm.hooks import PowerSGDState

log = logging.getLogger("train_digits")


class RankFilter(logging.Filter):
    """Adds ``record.rank`` (who logs: ``"rank 0"``, or ``"worker <pid>"`` with ``--elastic``,
    whose ranks change) to every log record."""

    def __init__(self, rank: str) -> None:
        super().__init__()
        self.rank = rank

    def filter(self, record: logging.LogRecord) -> bool:
        record.rank = self.rank
        return True


def setup_logging(who: str, level: str) -> None:
    """Log to stderr, each record tagged with ``who`` (also gradcomm's own ``gradcomm.*`` logs)."""
    handler = logging.StreamHandler(sys.stderr)
    handler.addFilter(RankFilter(who))
    handler.setFormatter(
        logging.Formatter("%(asctime)s [%(rank)s] %(name)s %(levelname)s: %(message)s")
    )
    logging.basicConfig(level=level.upper(), handlers=[handler], force=True)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    p.add_argument("--epochs", type=int, default=10, help="passes over the training set")
    p.add_argument("--lr", type=float, default=0.05, help="SGD learning rate (momentum 0.9)")
    p.add_argument("--batch-size", type=int, default=64,
                   help="GLOBAL batch size, split across ranks (default 64)")
    p.add_argument("--hidden", type=int, default=128, help="width of the hidden layer")
    p.add_argument("--backend", default=None,
                   help="gradcomm backend (gloo, mpi, ...); default GRADCOMM_BACKEND, else auto")
    p.add_argument("--device", default=None,
                   help="device of the model and data, passed to gradcomm.init (cpu, cuda, "
                        "cuda:<i>); default the backend's: cpu for gloo and mpi, "
                        "cuda:<local_rank> for nccl and cupy-nccl")
    p.add_argument("--timeout", type=float, default=None,
                   help="collective timeout in seconds (default GRADCOMM_TIMEOUT, else 300)")
    p.add_argument("--seed", type=int, default=0, help="seed of the split, init and shuffling")
    p.add_argument("--log-level", default="INFO", help="logging level (default INFO)")
    p.add_argument("--comm-hook", default="allreduce",
                   choices=("allreduce", "fp16_compress", "bf16_compress", "powersgd"),
                   help="how gradient buckets are summed (default allreduce)")
    p.add_argument("--zero", type=int, default=0, choices=(0, 1, 2),
                   help="shard the optimizer: 0 none, 1 its state, 2 its state and the gradients "
                        "(gradcomm.ShardedOptimizer stage; 2 needs --comm-hook allreduce)")
    p.add_argument("--powersgd-rank", type=int, default=2,
                   help="PowerSGD's matrix_approximation_rank (default 2)")
    p.add_argument("--powersgd-start-iter", type=int, default=10,
                   help="PowerSGD's start_powerSGD_iter: plain all-reduce steps first (default 10)")
    p.add_argument("--save-params", type=Path, default=None,
                   help="save the final parameters to this file (torch.save)")
    ft = p.add_argument_group("fault tolerance (docs/fault-tolerance.md)")
    ft.add_argument("--elastic", action="store_true",
                    help="survive failed workers and admit new ones (gradcomm.elastic); start each "
                         "worker on its own, with GRADCOMM_COORDINATOR=host:port")
    ft.add_argument("--min-world-size", type=int, default=1,
                    help="fewest workers to go on with (default 1)")
    ft.add_argument("--world-size", type=int, default=None,
                    help="workers the first step waits for (default WORLD_SIZE, else "
                         "--min-world-size)")
    ft.add_argument("--heartbeat-timeout", type=float, default=2.0,
                    help="seconds without a heartbeat before a worker counts as dead (default 2)")
    ft.add_argument("--join-timeout", type=float, default=60.0,
                    help="seconds to wait for workers when fewer than needed (default 60)")
    ft.add_argument("--snapshot-every", type=int, default=1,
                    help="with --zero: steps between snapshots of the sharded optimizer's full "
                         "state (default 1)")
    ft.add_argument("--reference", type=Path, default=None,
                    help="parameters of the one-process run (--save-params) to compare with")
    ft.add_argument("--progress", type=Path, default=None,
                    help="append 'time step world_size' per completed step to this file")
    ft.add_argument("--step-delay", type=float, default=0.0,
                    help="seconds to sleep after each step, so that a demo has time to kill and "
                         "start workers (default 0)")
    args = p.parse_args(argv)
    if args.epochs < 1 or args.batch_size < 1 or not 0 < args.lr < math.inf or args.hidden < 1:
        p.error("--epochs, --batch-size and --hidden must be >= 1 and --lr a finite number > 0")
    if args.powersgd_rank < 1 or args.powersgd_start_iter < 0:
        p.error("--powersgd-rank must be >= 1 and --powersgd-start-iter >= 0")
    if args.zero == 2 and args.comm_hook != "allreduce":
        p.error("--zero 2 reduce-scatters the buckets: use it with --comm-hook allreduce")
    if args.elastic and args.backend == "mpi":
        p.error("--elastic re-forms the group at run time, which MPI cannot: use gloo")
    if args.min_world_size < 1 or args.snapshot_every < 1 or args.step_delay < 0:
        p.error("--min-world-size and --snapshot-every must be >= 1 and --step-delay >= 0")
    if args.device is not None:
        try:
            torch.device(args.device)
        except (RuntimeError, ValueError) as exc:
            p.error(f"--device {args.device!r} is not a torch device: {exc}")
    return args


def load_data(seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Standardised digits split 80/20 (stratified); identical on every rank for one seed.

    Returns:
        ``x_train`` (N, 64) float32, ``y_train`` (N,) int64, ``x_test``, ``y_test`` likewise.
    """
    x, y = load_digits(return_X_y=True)
    x_tr, x_te, y_tr, y_te = train_test_split(
        x, y, test_size=0.2, random_state=seed, stratify=y
    )
    scaler = StandardScaler().fit(x_tr)
    x_train, x_test = (torch.as_tensor(scaler.transform(a), dtype=torch.float32)
                       for a in (x_tr, x_te))
    y_train, y_test = (torch.as_tensor(a, dtype=torch.int64) for a in (y_tr, y_te))
    return x_train, y_train, x_test, y_test


def evaluate(
    model: nn.Module, comm: gradcomm.Communicator, x: torch.Tensor, y: torch.Tensor
) -> float:
    """Accuracy on (x, y): each rank scores its shard, the counts are summed over ranks."""
    rank, ws = comm.rank, comm.world_size
    with torch.no_grad():
        pred = model(x[rank::ws]).argmax(1)
    counts = torch.tensor(
        [(pred == y[rank::ws]).sum().item(), pred.numel()], dtype=torch.float64,
        device=comm.device,
    )
    comm.all_reduce(counts)
    return float(counts[0] / counts[1])


def parameter_digest(model: nn.Module) -> torch.Tensor:
    """SHA-256 of every parameter's bytes, in registration order, as 4 int64 values."""
    h = hashlib.sha256()
    for p in model.parameters():
        h.update(p.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return torch.frombuffer(bytearray(h.digest()), dtype=torch.int64).clone()


def epoch_permutation(n: int, seed: int, epoch: int) -> torch.Tensor:
    """Epoch ``epoch``'s shuffling: the ``epoch + 1``-th permutation drawn from a generator
    seeded with ``seed`` -- the one the loop of :func:`main` draws for that epoch."""
    gen = torch.Generator().manual_seed(seed)
    for _ in range(epoch):
        torch.randperm(n, generator=gen)
    return torch.randperm(n, generator=gen)


def max_rel_diff(params: Sequence[torch.Tensor], reference: Sequence[torch.Tensor]) -> float:
    """Largest ``max|p - q| / max|q|`` over the parameters (q: the reference's)."""
    return max(float((p.detach().cpu() - q).abs().max() / q.abs().max())
               for p, q in zip(params, reference, strict=True))


def train_elastic(args: argparse.Namespace) -> int:
    """The same training, fault-tolerant: the global batch of each step is the one :func:`main`
    takes, split over the workers of the moment (docs/fault-tolerance.md)."""
    device = torch.device(args.device or "cpu")
    x_tr, y_tr, x_te, y_te = (t.to(device) for t in load_data(args.seed))
    torch.manual_seed(args.seed)
    model = nn.Sequential(nn.Linear(64, args.hidden), nn.ReLU(), nn.Linear(args.hidden, 10))
    model.to(device)
    opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    loss_fn = nn.CrossEntropyLoss(reduction="sum")
    n, bs = len(x_tr), args.batch_size
    steps = (n + bs - 1) // bs

    def build(comm: gradcomm.Communicator, state: elastic.State) -> gradcomm.GradientReducer:
        # Called with every new communicator: what runs over it is built anew.
        reducer = gradcomm.GradientReducer(state.model, comm)
        if args.comm_hook == "powersgd":
            hook_state = PowerSGDState(comm, matrix_approximation_rank=args.powersgd_rank,
                                       start_powerSGD_iter=args.powersgd_start_iter)
            hook_state.iter = state.step  # the count goes on; the error feedback starts afresh
            reducer.register_comm_hook("powersgd", state=hook_state)
        else:
            reducer.register_comm_hook(args.comm_hook)
        if args.zero:  # after the hook (stage 2 replaces it); its state kept as snapshots
            state.optimizer = gradcomm.ShardedOptimizer(reducer, torch.optim.SGD,
                                                        stage=args.zero, lr=args.lr,
                                                        momentum=0.9)
        return reducer

    state = elastic.State(model, None if args.zero else opt)  # what a joiner receives
    epoch_perm: tuple[int, torch.Tensor] = (-1, torch.empty(0))
    with elastic.ElasticGroup(state, build, backend=args.backend, device=args.device,
                              min_world_size=args.min_world_size, world_size=args.world_size,
                              timeout=args.timeout or 30.0,
                              heartbeat_timeout=args.heartbeat_timeout,
                              join_timeout=args.join_timeout,
                              snapshot_every=args.snapshot_every) as group:
        for step in group.steps(args.epochs * steps):
            epoch, i = divmod(step.index, steps)
            if epoch_perm[0] != epoch:
                epoch_perm = (epoch, epoch_permutation(n, args.seed, epoch).to(device))
            batch = epoch_perm[1][i * bs:(i + 1) * bs]
            with step as comm:  # a step that fails is discarded, and retried after re-forming
                shard = batch[comm.rank::comm.world_size]
                optimizer = state.optimizer  # a new one at each re-formation with --zero
                assert optimizer is not None
                optimizer.zero_grad(set_to_none=True)
                loss_sum = loss_fn(model(x_tr[shard]), y_tr[shard])
                (loss_sum * (comm.world_size / len(batch))).backward()
                optimizer.step()
            if args.progress is not None:
                with args.progress.open("a") as f:
                    f.write(f"{time.time():.3f} {state.step} {group.world_size}\n")
            if i == steps - 1 and group.rank == 0:
                print(f"epoch {epoch + 1:3d}/{args.epochs}  held-out acc "
                      f"{accuracy(model, x_te, y_te):.4f}  ({group.world_size} workers)",
                      flush=True)
            time.sleep(args.step_delay)
    print(f"final held-out accuracy: {accuracy(model, x_te, y_te):.4f}")
    print(f"parameters sha256 {parameter_digest(model).numpy().tobytes().hex()}")
    print(f"applied steps {state.step}")
    same = True
    if args.reference is not None:
        diff = max_rel_diff(list(model.parameters()), torch.load(args.reference))
        same = diff < 1e-5
        print(f"matches one-process run: {same} (max rel diff {diff:.1e})")
    sys.stdout.flush()
    return 0 if same else 1


def accuracy(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
    """Accuracy of ``model`` on (x, y), on this process alone."""
    with torch.no_grad():
        return float((model(x).argmax(1) == y).float().mean())


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    start = time.perf_counter()
    # Share the host's cores among the ranks on it (2 ranks on 2 cores: one thread each).
    launch = detect_launch()
    local = (args.world_size or 1) if args.elastic else launch.local_world_size  # per host
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // local))
    setup_logging(f"worker {os.getpid()}" if args.elastic else f"rank {launch.rank}",
                  args.log_level)
    if args.elastic:
        return train_elastic(args)

    comm = gradcomm.init(args.backend, timeout=args.timeout, device=args.device)
    rank, ws, device = comm.rank, comm.world_size, comm.device
    log.info("%s launcher, backend %s, rank %d of %d, local rank %d, device %s, host %s",
             launch.launcher.value, comm.backend, rank, ws, comm.local_rank, device,
             socket.gethostname())

    x_tr, y_tr, x_te, y_te = (t.to(device) for t in load_data(args.seed))
    torch.manual_seed(args.seed)  # initialised on the CPU: the same values on every device
    model = nn.Sequential(nn.Linear(64, args.hidden), nn.ReLU(), nn.Linear(args.hidden, 10))
    model.to(device)
    # Broadcasts rank 0's parameters; from now on backward() leaves averaged gradients.
    reducer = gradcomm.GradientReducer(model, comm)
    if args.comm_hook == "powersgd":
        reducer.register_comm_hook("powersgd", state=PowerSGDState(
            comm, matrix_approximation_rank=args.powersgd_rank,
            start_powerSGD_iter=args.powersgd_start_iter))
    else:
        reducer.register_comm_hook(args.comm_hook)
    log.info("gradient reducer: %d parameter(s) in %d bucket(s), comm hook %s",
             len(reducer.parameter_names), len(reducer.buckets), args.comm_hook)
    opt: torch.optim.Optimizer
    if args.zero:
        # Each rank keeps the momentum (and with --zero 2 the averaged gradients) of its shard.
        opt = gradcomm.ShardedOptimizer(reducer, torch.optim.SGD, stage=args.zero, lr=args.lr,
                                        momentum=0.9)
    else:
        opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    loss_fn = nn.CrossEntropyLoss(reduction="sum")
    n = len(x_tr)
    if args.batch_size < ws:
        log.error("--batch-size %d is smaller than the world size %d: some ranks would get "
                  "empty shards", args.batch_size, ws)
        comm.close()
        return 2
    steps = (n + args.batch_size - 1) // args.batch_size
    log.info("%d training samples, %d held out; global batch %d (about %d per rank), %d steps "
             "per epoch", n, len(x_te), args.batch_size, -(-args.batch_size // ws), steps)

    gen = torch.Generator().manual_seed(args.seed)  # same shuffling on every rank
    bar = tqdm(total=args.epochs * steps, disable=rank != 0, desc="training", unit="step",
               file=sys.stderr, dynamic_ncols=True)
    for epoch in range(1, args.epochs + 1):
        model.train()
        perm = torch.randperm(n, generator=gen).to(device)
        # summed loss, correct, samples (this rank)
        stats = torch.zeros(3, dtype=torch.float64, device=device)
        for i in range(steps):
            batch = perm[i * args.batch_size:(i + 1) * args.batch_size]
            shard = batch[rank::ws]
            logits = model(x_tr[shard])
            loss_sum = loss_fn(logits, y_tr[shard])
            opt.zero_grad(set_to_none=True)
            # Scaled so the reducer's average over ranks is the mean over the global batch.
            (loss_sum * (ws / len(batch))).backward()
            opt.step()
            stats += torch.tensor([loss_sum.item(), (logits.argmax(1) == y_tr[shard]).sum().item(),
                                   len(shard)], dtype=torch.float64, device=device)
            bar.update()
        comm.all_reduce(stats)
        model.eval()
        held_out = evaluate(model, comm, x_te, y_te)
        if rank == 0:
            tqdm.write(f"epoch {epoch:3d}/{args.epochs}  loss {stats[0] / stats[2]:.4f}  "
                       f"train acc {stats[1] / stats[2]:.4f}  held-out acc {held_out:.4f}",
                       file=sys.stdout)
            sys.stdout.flush()  # keep the lines in order with the bar (stderr) in a shared pipe
    bar.close()

    final = evaluate(model, comm, x_te, y_te)
    digest = parameter_digest(model).to(device)
    gathered = torch.empty(ws, digest.numel(), dtype=digest.dtype, device=device)
    comm.all_gather(gathered, digest)
    digest, gathered = digest.cpu(), gathered.cpu()
    same = bool((gathered == gathered[0]).all())
    finite = all(bool(torch.isfinite(p).all()) for p in model.parameters())
    elapsed = time.perf_counter() - start
    if rank == 0:
        print(f"final held-out accuracy: {final:.4f}")
        hexdigest = digest.numpy().tobytes().hex()[:16]
        if ws == 1:
            print(f"parameters sha256 {hexdigest}... (one rank: nothing to compare)")
        elif same:
            print(f"parameters identical on all {ws} ranks (sha256 {hexdigest}...)")
        else:
            bad = [r for r in range(ws) if not torch.equal(gathered[r], gathered[0])]
            print(f"parameters DIFFER: ranks {bad} disagree with rank 0")
        print(f"backend {comm.backend}, {ws} rank(s), wall time {elapsed:.1f} s", flush=True)
    if args.save_params is not None and rank == 0:
        torch.save([p.detach().cpu() for p in model.parameters()], args.save_params)
    if not same:
        log.error("parameters differ across ranks")
    if not finite:
        log.error("training diverged: non-finite parameters (lower --lr or raise --batch-size)")
    comm.close()
    return 0 if same and finite else 1


if __name__ == "__main__":
    sys.exit(main())

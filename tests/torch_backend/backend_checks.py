"""One job that checks the "gradcomm" torch.distributed backend against torch's gloo.

Every rank runs ``init_process_group("gradcomm")`` (the transport from ``GRADCOMM_BACKEND``) and a
torch gloo group over the same ranks (``new_group(backend="gloo")``), then does the same work on
both and compares: every function of torch.distributed, the works' futures and errors, DDP (with
and without ``gradient_as_bucket_view``, ``no_sync``, comm hooks including torch's PowerSGD),
FSDP2 with bf16 mixed precision, DTensor ``redistribute`` and ZeroRedundancyOptimizer. One launch
checks all of it (process start-up dominates a check's cost).

Run as a spawned rank (``check_all(rank, world_size)``, torchrun's variables set) or as a script
under ``mpiexec -n N`` (no torchrun variable: gradcomm's launcher detection and rendezvous). Each
check's name is printed by rank 0 as ``CHECK <name>``; a mismatch raises AssertionError.

Results must equal bit for bit at 2 ranks (a sum of two values does not depend on the order);
at 3 and 4 ranks the transports sum in other orders than torch's gloo, so within float32
rounding (float16 rounding for the fp16 compression hook).
"""

from __future__ import annotations

import datetime
import os
import sys
import warnings
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn

import gradcomm  # noqa: F401 - registers the backend

# torch 2.13 deprecates all_gather_into_tensor and reduce_scatter_tensor for *_single
warnings.filterwarnings("ignore", category=FutureWarning)
_checks: list[tuple[str, Callable[[dist.ProcessGroup, dist.ProcessGroup], None]]] = []


def check(fn: Callable[[dist.ProcessGroup, dist.ProcessGroup], None]) -> Callable[..., None]:
    _checks.append((fn.__name__, fn))
    return fn


def in_subgroups(fn: Callable[..., None]) -> Callable[..., None]:
    """Also run this check on sub-groups of ranks ``0..2`` (see :func:`check_all`): it reaches
    ranks only through its groups and :data:`_where`."""
    _subgroup_checks.add(fn.__name__)
    return fn


class _Where:
    """This rank's place in the groups the running check was given."""

    rank = 0
    size = 1


_where = _Where()
_subgroup_checks: set[str] = set()


def same(a: torch.Tensor, b: torch.Tensor, what: str, half: bool = False) -> None:
    if _where.size == 2:
        assert torch.equal(a, b), f"{what}: {a} != {b}"
    elif half:
        torch.testing.assert_close(a, b, rtol=2e-3, atol=2e-3, msg=what)
    else:
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=what)


def both(fn: Callable[[dist.ProcessGroup], torch.Tensor], gc: dist.ProcessGroup,
         gloo: dist.ProcessGroup, what: str, half: bool = False) -> None:
    same(fn(gc), fn(gloo), what, half)


def data(seed: int, *shape: int, dtype: torch.dtype = torch.float32,
         rank: int | None = None) -> torch.Tensor:
    """Rank ``rank``'s (default: this rank's) random tensor of ``seed``."""
    g = torch.Generator().manual_seed(seed * 1000 + (_where.rank if rank is None else rank))
    return torch.randn(*shape, generator=g).to(dtype)


# ----------------------------------------------------------------------------- collectives
@check
def collectives(gc: dist.ProcessGroup, gloo: dist.ProcessGroup) -> None:
    r, n = dist.get_rank(), dist.get_world_size()
    for op in (dist.ReduceOp.SUM, dist.ReduceOp.MAX, dist.ReduceOp.MIN, dist.ReduceOp.PRODUCT,
               dist.ReduceOp.AVG):
        def ar(g: dist.ProcessGroup, op: dist.ReduceOp = op) -> torch.Tensor:
            t = data(1, 5, 3)
            dist.all_reduce(t, op=op, group=g)
            return t
        both(ar, gc, gloo, f"all_reduce {op}")
    both(lambda g: _run(lambda t: dist.all_reduce(t, group=g), torch.arange(7, dtype=torch.int64)
                        * (r + 1)), gc, gloo, "all_reduce int64")
    both(lambda g: _run(lambda t: dist.broadcast(t, src=n - 1, group=g), data(2, 9)), gc, gloo,
         "broadcast")

    def all_gather(g: dist.ProcessGroup) -> torch.Tensor:
        out = [torch.empty(4) for _ in range(n)]
        dist.all_gather(out, data(3, 4), group=g)
        return torch.cat(out)
    both(all_gather, gc, gloo, "all_gather")

    out = [torch.empty(i + 1, 2) for i in range(n)]  # gloo refuses uneven sizes
    dist.all_gather(out, data(3, r + 1, 2), group=gc)
    assert torch.equal(torch.cat(out), torch.cat([data(3, i + 1, 2, rank=i) for i in range(n)]))

    def into_tensor(g: dist.ProcessGroup) -> torch.Tensor:
        out = torch.empty(n * 3, 2)
        dist.all_gather_into_tensor(out, data(4, 3, 2), group=g)
        return out
    both(into_tensor, gc, gloo, "all_gather_into_tensor")

    def reduce_scatter(g: dist.ProcessGroup) -> torch.Tensor:
        out = torch.empty(3)
        dist.reduce_scatter(out, list(data(5, n, 3).unbind(0)), group=g)
        return out
    both(reduce_scatter, gc, gloo, "reduce_scatter")

    for op in (dist.ReduceOp.SUM, dist.ReduceOp.AVG):
        def rs_tensor(g: dist.ProcessGroup, op: dist.ReduceOp = op) -> torch.Tensor:
            out = torch.empty(2, 3)
            dist.reduce_scatter_tensor(out, data(6, 2 * n, 3), op=op, group=g)
            return out
        both(rs_tensor, gc, gloo, f"reduce_scatter_tensor {op}")

    def all_to_all(g: dist.ProcessGroup) -> torch.Tensor:
        out = [torch.empty(2) for _ in range(n)]
        dist.all_to_all(out, list(data(7, n, 2).unbind(0)), group=g)
        return torch.cat(out)
    both(all_to_all, gc, gloo, "all_to_all")

    def a2a_single(g: dist.ProcessGroup) -> torch.Tensor:
        ins = [(r + j) % 3 + 1 for j in range(n)]      # rows rank r sends to rank j
        outs = [(j + r) % 3 + 1 for j in range(n)]     # rows rank r gets from rank j
        out = torch.empty(sum(outs), 2)
        dist.all_to_all_single(out, data(8, sum(ins), 2), outs, ins, group=g)
        return out
    both(a2a_single, gc, gloo, "all_to_all_single uneven")

    def reduce(g: dist.ProcessGroup) -> torch.Tensor:
        t = data(9, 6)
        dist.reduce(t, dst=n - 1, group=g)
        return t if r == n - 1 else torch.zeros(1)
    both(reduce, gc, gloo, "reduce")

    def gather(g: dist.ProcessGroup) -> torch.Tensor:
        out = [torch.empty(3) for _ in range(n)] if r == 0 else None
        dist.gather(data(10, 3), out, dst=0, group=g)
        return torch.cat(out) if out else torch.zeros(1)
    both(gather, gc, gloo, "gather")

    def scatter(g: dist.ProcessGroup) -> torch.Tensor:
        out = torch.empty(3)
        dist.scatter(out, list(data(11, n, 3).unbind(0)) if r == 1 else None, src=1, group=g)
        return out
    both(scatter, gc, gloo, "scatter")


def _run(fn: Callable[[torch.Tensor], object], t: torch.Tensor) -> torch.Tensor:
    fn(t)
    return t


@check
def point_to_point_and_objects(gc: dist.ProcessGroup, gloo: dist.ProcessGroup) -> None:
    r, n = dist.get_rank(), dist.get_world_size()
    nxt, prv = (r + 1) % n, (r - 1) % n
    # both ranks send first, then receive: the backend must not block the posting thread
    got = torch.empty(1000)
    send = dist.isend(torch.full((1000,), float(r)), nxt, group=gc)
    recv = dist.irecv(got, prv, group=gc)
    send.wait(), recv.wait()
    assert torch.equal(got, torch.full((1000,), float(prv)))
    ops = [dist.P2POp(dist.isend, torch.full((5,), r + 0.5), nxt, group=gc),
           dist.P2POp(dist.irecv, got[:5], prv, group=gc)]
    for w in dist.batch_isend_irecv(ops):
        w.wait()
    assert torch.equal(got[:5], torch.full((5,), prv + 0.5))
    if r == 0:
        dist.send(torch.arange(4.0), 1, group=gc, tag=3)
    elif r == 1:
        t = torch.empty(4)
        assert dist.recv(t, 0, group=gc, tag=3) == 0
        assert torch.equal(t, torch.arange(4.0))
    # recv and irecv without src: rank 0 takes the others' messages as they come
    if r == 0:
        senders = []
        for _ in range(n - 1):
            t = torch.empty(3)
            sender = dist.recv(t, group=gc, tag=5)
            assert torch.equal(t, torch.full((3,), float(sender))), (sender, t)
            u = torch.empty(3)
            work = dist.irecv(u, group=gc, tag=6)
            work.wait()
            assert torch.equal(u, torch.full((3,), -float(work._source_rank()))), u
            senders.append(sender)
        assert sorted(senders) == list(range(1, n)), senders
    else:
        dist.send(torch.full((3,), float(r)), 0, group=gc, tag=5)
        dist.send(torch.full((3,), -float(r)), 0, group=gc, tag=6)
    objs: list[object] = [None] * n
    dist.all_gather_object(objs, {"rank": r, "t": [r] * r}, group=gc)
    assert objs == [{"rank": i, "t": [i] * i} for i in range(n)]
    box = [{"from": 0}] if r == 0 else [None]
    dist.broadcast_object_list(box, src=0, group=gc)
    assert box == [{"from": 0}]
    out: list[object] = [None]
    dist.scatter_object_list(out, [i * 10 for i in range(n)] if r == 0 else None, src=0,
                             group=gc)
    assert out == [r * 10]
    gathered: list[object] | None = [None] * n if r == 0 else None
    dist.gather_object(f"r{r}", gathered, dst=0, group=gc)
    assert r != 0 or gathered == [f"r{i}" for i in range(n)]
    dist.barrier(group=gc)
    # coalesced all-reduces (the coalescing manager's fast path)
    ts = [data(12, 3), data(13, 2, 2)]
    refs = [t.clone() for t in ts]
    with dist._coalescing_manager(group=gc, async_ops=True) as cm:
        for t in ts:
            dist.all_reduce(t, group=gc)
    cm.wait()
    for t in refs:
        dist.all_reduce(t, group=gloo)
    for a, b in zip(ts, refs, strict=True):
        same(a, b, "coalesced all_reduce")


#: Iterations per way of sending in sustained_point_to_point.
SUSTAINED_ITERATIONS = 1000


@check
def sustained_point_to_point(gc: dist.ProcessGroup, gloo: dist.ProcessGroup) -> None:
    """Ranks 0 and 1 ping-pong SUSTAINED_ITERATIONS messages each way of sending, at sizes
    crossing MPI's eager limit. A lost completion shows as a hang or a stale value (a queue of
    CPython that can block past its timeout once lost one in about 2000 messages). Run at 2
    ranks only: more would share the 2 cores of the test machine, and the engine under test is
    each rank's own."""
    r = dist.get_rank()
    if dist.get_world_size() != 2:
        return
    peer, first = 1 - r, r == 0
    limit = datetime.timedelta(seconds=30)
    for way in ("send/recv", "isend/irecv", "batch_isend_irecv"):
        for i in range(SUSTAINED_ITERATIONS):
            n = 1 + (i * 37) % 6000
            mine, got = torch.full((n,), float(i * 4 + r)), torch.empty(n)
            if way == "send/recv":
                if first:
                    dist.send(mine, peer, group=gc)
                    dist.recv(got, peer, group=gc)
                else:
                    dist.recv(got, peer, group=gc)
                    dist.send(mine, peer, group=gc)
            elif way == "isend/irecv":
                works = [dist.isend(mine, peer, group=gc), dist.irecv(got, peer, group=gc)]
                for w in works:
                    w.wait(limit)
            else:
                for w in dist.batch_isend_irecv([dist.P2POp(dist.isend, mine, peer, group=gc),
                                                 dist.P2POp(dist.irecv, got, peer, group=gc)]):
                    w.wait(limit)
            assert torch.all(got == i * 4 + peer), (way, i, got[:3])


@check
def works_and_errors(gc: dist.ProcessGroup, gloo: dist.ProcessGroup) -> None:
    n = dist.get_world_size()
    t = torch.ones(3)
    work = dist.all_reduce(t, group=gc, async_op=True)
    fut = work.get_future()
    value = fut.then(lambda f: f.value()[0] * 2).wait()  # completes by itself, tensors as value
    assert torch.equal(value, torch.full((3,), 2.0 * n)), value
    assert work.wait(timeout=__import__("datetime").timedelta(seconds=30)) is True
    assert work.is_completed() and work.is_success() and work.exception() is None
    # an op gradcomm refuses: raised at once
    try:
        dist.all_reduce(torch.ones(2, dtype=torch.int32), op=dist.ReduceOp.BXOR, group=gc)
    except ValueError as exc:
        assert "BXOR" in str(exc)
    else:
        raise AssertionError("BXOR did not raise")
    # a collective that fails on every rank: the work, its future and a chained future fail
    work = gc.allreduce([torch.ones(2).to_sparse()])  # gradcomm refuses sparse tensors
    chained = work.get_future().then(lambda f: f.value())
    for waiter in (work.wait, work.get_future().wait, chained.wait):
        try:
            waiter()
        except Exception as exc:  # noqa: BLE001 - the error type is the transport's
            assert "sparse" in str(exc), exc
        else:
            raise AssertionError("a failed collective's wait returned")
    assert work.is_completed() and not work.is_success() and work.exception() is not None
    # the group still works afterwards
    t = torch.ones(1)
    dist.all_reduce(t, group=gc)
    assert t.item() == n


# ----------------------------------------------------------------------------- DDP
class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(12, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU())
        self.head = nn.Linear(32, 3)
        self.register_buffer("steps", torch.zeros(1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.steps += 1
        return self.head(self.body(x))


class Branchy(Net):
    """Net whose head can be left out of a forward (its parameters then get no gradient)."""

    def forward(self, x: torch.Tensor, skip_head: bool = False) -> torch.Tensor:
        h = self.body(x)
        return h[:, :3] if skip_head else self.head(h)


def train_ddp(group: dist.ProcessGroup, hook: str, view: bool, steps: int = 4) -> torch.Tensor:
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook

    torch.manual_seed(_where.rank + 1)  # DDP must broadcast rank 0's parameters
    # Tiny buckets (several all-reduces in flight), except for PowerSGD: its hook posts
    # all-reduces from future callbacks, which race with the next bucket's on any CPU backend
    # (torch's gloo aborts on a size mismatch too), so it gets one bucket.
    cap = 25.0 if hook == "powersgd" else 0.002
    model = nn.parallel.DistributedDataParallel(
        Net(), process_group=group, bucket_cap_mb=cap, gradient_as_bucket_view=view)
    if hook == "fp16":
        model.register_comm_hook(group, default_hooks.fp16_compress_hook)
    elif hook == "powersgd":
        state = powerSGD_hook.PowerSGDState(process_group=group, matrix_approximation_rank=2,
                                            start_powerSGD_iter=2, random_seed=7)
        model.register_comm_hook(state, powerSGD_hook.powerSGD_hook)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    for step in range(steps):
        x, y = data(20 + step, 8, 12), data(40 + step, 8, 3)
        if step % 2 == 0:  # gradient accumulation: no all-reduce in the first micro-batch
            with model.no_sync():
                nn.functional.mse_loss(model(x[:4]), y[:4]).backward()
            nn.functional.mse_loss(model(x[4:]), y[4:]).backward()
        else:
            nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


@in_subgroups
@check
def ddp(gc: dist.ProcessGroup, gloo: dist.ProcessGroup) -> None:
    for hook in ("none", "fp16", "powersgd"):
        for view in (False, True):
            if hook != "none" and not view:
                continue
            both(lambda g, h=hook, v=view: train_ddp(g, h, v), gc, gloo,
                 f"DDP hook={hook} gradient_as_bucket_view={view}", half=hook == "fp16")
    for flag in ("find_unused_parameters", "static_graph"):
        both(lambda g, f=flag: train_ddp_flag(g, f), gc, gloo, f"DDP {flag}")


def train_ddp_flag(group: dist.ProcessGroup, flag: str) -> torch.Tensor:
    """DDP with ``flag``; the head is left out of every other step's loss (unused parameters)."""
    torch.manual_seed(0)
    model = nn.parallel.DistributedDataParallel(Branchy(), process_group=group, **{flag: True})
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    for step in range(4):
        skip = step % 2 == 0 and flag == "find_unused_parameters"
        model(data(100 + step, 8, 12), skip_head=skip).sum().backward()
        opt.step()
        opt.zero_grad()
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


@in_subgroups
@check
def zero_redundancy_optimizer(gc: dist.ProcessGroup, gloo: dist.ProcessGroup) -> None:
    from torch.distributed.optim import ZeroRedundancyOptimizer

    def train(g: dist.ProcessGroup) -> torch.Tensor:
        torch.manual_seed(0)
        model = nn.parallel.DistributedDataParallel(Net(), process_group=g)
        opt = ZeroRedundancyOptimizer(model.parameters(), torch.optim.Adam, process_group=g,
                                      lr=0.01)
        for step in range(3):
            nn.functional.mse_loss(model(data(60 + step, 8, 12)), data(70, 8, 3)).backward()
            opt.step()
            opt.zero_grad()
        return torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    both(train, gc, gloo, "ZeroRedundancyOptimizer")


# ----------------------------------------------------------------------------- FSDP2, DTensor
@in_subgroups
@check
def fsdp2_mixed_precision(gc: dist.ProcessGroup, gloo: dist.ProcessGroup) -> None:
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    def train(g: dist.ProcessGroup) -> torch.Tensor:
        torch.manual_seed(0)
        model = Net()
        mesh = DeviceMesh.from_group(g, "cpu")
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        for layer in model.body:
            if isinstance(layer, nn.Linear):
                fully_shard(layer, mesh=mesh, mp_policy=policy)
        fully_shard(model, mesh=mesh, mp_policy=policy)
        opt = torch.optim.AdamW(model.parameters(), lr=0.01)
        for step in range(3):
            out = model(data(80 + step, 8, 12))
            nn.functional.mse_loss(out.float(), data(90, 8, 3)).backward()
            opt.step()
            opt.zero_grad()
        return torch.cat([p.full_tensor().detach().reshape(-1) for p in model.parameters()])
    both(train, gc, gloo, "FSDP2 bf16 params, fp32 reduce")


@in_subgroups
@check
def dtensor_redistribute(gc: dist.ProcessGroup, gloo: dist.ProcessGroup) -> None:
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor

    n = _where.size
    mesh = DeviceMesh.from_group(gc, "cpu")
    full = torch.arange(4.0 * n * 6).reshape(4 * n, 6)
    cases = [(Shard(0), Replicate()), (Shard(0), Shard(1)), (Replicate(), Shard(0)),
             (Shard(1), Shard(0))]
    for src, dst in cases:
        d = distribute_tensor(full, mesh, [src]).redistribute(mesh, [dst])
        assert torch.equal(d.full_tensor(), full), (src, dst)
    local = torch.full((2, 2 * n), float(_where.rank + 1))
    total = sum(range(1, n + 1))
    partial = DTensor.from_local(local, mesh, [Partial()])
    assert torch.equal(partial.redistribute(mesh, [Replicate()]).to_local(),
                       torch.full((2, 2 * n), float(total)))
    shard = partial.redistribute(mesh, [Shard(1)]).to_local()
    assert torch.equal(shard, torch.full((2, 2), float(total))), shard
    # a matmul over a sharded DTensor equals the one-process result
    w = distribute_tensor(torch.arange(6.0 * 5).reshape(6, 5), mesh, [Shard(0)])
    x = distribute_tensor(full, mesh, [Shard(1)])
    torch.testing.assert_close((x @ w).full_tensor(), full @ torch.arange(6.0 * 5).reshape(6, 5))


@check
def two_dim_mesh(gc: dist.ProcessGroup, gloo: dist.ProcessGroup) -> None:
    """At 4 ranks: HSDP (replicate x shard) on a 2x2 mesh of "gradcomm" sub-groups equals
    FSDP2 on torch's gloo group, and 2-D DTensor layouts round-trip."""
    if dist.get_world_size() != 4:
        return
    from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    assert dist.get_backend(mesh.get_group("shard")) == "gradcomm"
    full = torch.arange(8.0 * 6).reshape(8, 6)
    for placements in ([Shard(0), Shard(1)], [Replicate(), Shard(0)], [Shard(1), Replicate()]):
        d = distribute_tensor(full, mesh, placements)
        assert torch.equal(d.redistribute(mesh, [Shard(1), Shard(0)]).full_tensor(), full)

    def train(m: DeviceMesh) -> torch.Tensor:
        torch.manual_seed(0)
        model = Net()
        fully_shard(model, mesh=m)
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        for step in range(3):
            nn.functional.mse_loss(model(data(120 + step, 8, 12)), data(130, 8, 3)).backward()
            opt.step()
            opt.zero_grad()
        return torch.cat([p.full_tensor().detach().reshape(-1) for p in model.parameters()])

    torch.testing.assert_close(train(mesh), train(DeviceMesh.from_group(gloo, "cpu")),
                               rtol=1e-5, atol=1e-6, msg="HSDP 2x2 against FSDP2 on gloo")


@check
def new_group_of_some_ranks(gc: dist.ProcessGroup, gloo: dist.ProcessGroup) -> None:
    r, n = dist.get_rank(), dist.get_world_size()
    members = list(range(1, n))  # every rank but 0
    sub = dist.new_group(members, backend="gradcomm")
    if r in members:
        t = torch.tensor([float(r)])
        dist.all_reduce(t, group=sub)
        assert t.item() == sum(members), t
        assert dist.get_backend(sub) == "gradcomm"
    pairs, _ = dist.new_subgroups_by_enumeration([[i, (i + 1) % n] for i in range(0, n - 1, 2)]
                                                 if n % 2 == 0 else [[0, 1]])
    if pairs is not None:
        t = torch.ones(2)
        dist.all_reduce(t, group=pairs)
        assert torch.equal(t, torch.full((2,), 2.0))


def check_all(rank: int, world_size: int) -> list[str]:
    """Run every check; return their names (rank 0 prints them as it goes). At 4 ranks the
    checks marked :func:`in_subgroups` run again on "gradcomm" and gloo sub-groups of ranks
    0..2 (names ``<check>@3``), so one launch also checks 3 ranks."""
    dist.init_process_group("gradcomm")
    assert (dist.get_rank(), dist.get_world_size()) == (rank, world_size)
    assert dist.get_backend() == "gradcomm"
    gloo = dist.new_group(backend="gloo")
    gc = dist.group.WORLD
    assert gc is not None
    runs: list[tuple[str, dist.ProcessGroup | None, dist.ProcessGroup | None]] = [
        (name, gc, gloo) for name, _ in _checks]
    if world_size == 4:
        members = [0, 1, 2]
        sub_gc = dist.new_group(members, backend="gradcomm")
        sub_gloo = dist.new_group(members, backend="gloo")
        mine = rank in members
        runs += [(f"{name}@3", sub_gc if mine else None, sub_gloo if mine else None)
                 for name, _ in _checks if name in _subgroup_checks]
    funcs = dict(_checks)
    done = []
    try:
        for name, g, ref in runs:
            if g is not None and ref is not None:
                _where.rank, _where.size = g.rank(), g.size()
                funcs[name.split("@")[0]](g, ref)
            dist.barrier(group=gloo)
            if rank == 0:
                print(f"CHECK {name}", flush=True)
            done.append(name)
    finally:
        dist.destroy_process_group()
    return done


if __name__ == "__main__":
    names = check_all(int(os.environ.get("PMI_RANK", os.environ.get("OMPI_COMM_WORLD_RANK", 0))),
                      int(os.environ.get("PMI_SIZE", os.environ.get("OMPI_COMM_WORLD_SIZE", 1))))
    print(f"RESULT ok {len(names)} checks", flush=True)
    sys.exit(0)

"""The checks that need a GPU, as plain scripts: ``python tests/_support/gpu_jobs.py JOB`` (no
pytest; the repository root on PYTHONPATH, as ``scripts/gpu_check.sh`` sets it).

``scripts/gpu_check.sh`` runs each job under its own time budget, at one rank or under
``mpiexec -n 2`` / ``torch.distributed.run``; tests/comm/test_gpu.py runs some of them too. A job
prints ``RESULT <job> ok rank=<r> ...`` on every rank when its values are right, or
``RESULT <job> skip: <why>`` when the machine lacks what the job is about (a CUDA-aware MPI);
anything else raises, and under ``mpiexec`` one failing rank aborts the job.

Jobs: ``nccl-1``, ``nccl-2-one-gpu``, ``cupy-nccl-1``, ``mpi-cuda`` (2 ranks, staged or CUDA-aware
as the environment says), ``mpi-cuda-aware`` (skips unless the MPI is CUDA-aware),
``reducer-mpi-cuda`` (2 ranks).
"""

from __future__ import annotations

import math
import os
import sys
import time
import traceback
import warnings

import torch
import torch.distributed as dist

import gradcomm
from gradcomm import BackendUnavailableError, ReduceOp, SlowPathWarning
from gradcomm.comm import Launcher, LaunchInfo

__all__ = ["collective_checks", "grad_check", "main"]


def grad_check(comm: gradcomm.Communicator) -> float:
    """Gradients after one backward equal one process's on the global batch; max rel. error."""
    torch.manual_seed(0)
    dev = comm.device
    x = torch.randn(8 * comm.world_size, 12, device=dev)
    y = torch.randn(8 * comm.world_size, 3, device=dev)

    def make() -> torch.nn.Module:
        torch.manual_seed(1)
        return torch.nn.Sequential(
            torch.nn.Linear(12, 32), torch.nn.Tanh(), torch.nn.Linear(32, 3)
        ).to(dev)

    ref = make()
    torch.nn.functional.mse_loss(ref(x), y).backward()
    model = make()
    reducer = gradcomm.GradientReducer(model, comm, bucket_cap_mb=0.001)  # several buckets
    shard = slice(8 * comm.rank, 8 * (comm.rank + 1))
    torch.nn.functional.mse_loss(model(x[shard]), y[shard]).backward()
    worst = 0.0
    for p, q in zip(model.parameters(), ref.parameters(), strict=True):
        assert p.grad is not None and q.grad is not None
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-6)
        worst = max(worst, float(((p.grad - q.grad).abs() / q.grad.abs().clamp_min(1e-12)).max()))
    del reducer
    return worst


def collective_checks(comm: gradcomm.Communicator) -> None:
    """Values of every collective on CUDA tensors, fp32/fp16/bf16, and no slow-path warning."""
    r, n, dev = comm.rank, comm.world_size, comm.device
    nccl_family = comm.backend in ("nccl", "cupy-nccl")
    with warnings.catch_warnings():
        if nccl_family:  # NCCL reduces 16-bit floats itself: no slow path, no warning
            warnings.simplefilter("error", SlowPathWarning)
        for dtype in (torch.float32, torch.float16, torch.bfloat16):
            assert not (nccl_family and comm.supports(dtype).is_slow), comm.supports(dtype)
            t = torch.full((1000,), float(r + 1), dtype=dtype, device=dev)
            comm.all_reduce(t)
            assert bool((t == n * (n + 1) / 2).all()), (dtype, t[:4])
            t = torch.full((33,), float(r + 1), dtype=dtype, device=dev)
            comm.all_reduce(t, "avg", async_op=True).wait()
            assert bool((t == (n + 1) / 2).all()), (dtype, t[:4])
    m = torch.tensor([r, -r], dtype=torch.int64, device=dev)
    comm.all_reduce(m, ReduceOp.MAX)
    assert m.tolist() == [n - 1, 0]
    b = torch.arange(10, device=dev, dtype=torch.float32) * (1 if r == n - 1 else 0)
    comm.broadcast(b, src=n - 1)
    assert b.tolist() == list(map(float, range(10)))
    out = torch.empty(n, 4, device=dev)
    comm.all_gather(out, torch.full((4,), float(r), device=dev))
    assert out[:, 0].tolist() == list(map(float, range(n)))
    nc = torch.ones(6, 4, device=dev).t()  # non-contiguous: copy-in, copy-out
    comm.all_reduce(nc)
    assert bool((nc == n).all())
    comm.barrier()


def _backend_hooks(comm: gradcomm.Communicator) -> None:
    """Drive the transport of a 1-rank communicator directly (the public methods issue no
    collective at world_size 1): every op and dtype through ``_all_reduce``, then the others."""
    dev = comm.device
    for dtype in (torch.float32, torch.float16, torch.bfloat16, torch.int64):
        ops = (ReduceOp.SUM, ReduceOp.AVG, ReduceOp.MIN, ReduceOp.MAX, ReduceOp.PRODUCT)
        for op in ops if dtype.is_floating_point else (ReduceOp.SUM, ReduceOp.MAX):
            t = torch.arange(16, device=dev).to(dtype)
            work = comm._all_reduce(t, op, f"direct {op.name} {dtype}")  # type: ignore[attr-defined]
            work.wait()
            assert work.is_completed() and torch.equal(t, torch.arange(16, device=dev).to(dtype))
    b = torch.arange(5, device=dev, dtype=torch.float64)
    comm._broadcast(b, 0, "direct broadcast").wait()  # type: ignore[attr-defined]
    out = torch.empty(5, device=dev, dtype=torch.float64)
    comm._all_gather(out, b, "direct all_gather").wait()  # type: ignore[attr-defined]
    assert torch.equal(out, b)
    comm._barrier("direct barrier").wait()  # type: ignore[attr-defined]


def _nccl_1() -> str:
    with gradcomm.init("nccl", rank=0, world_size=1, timeout=60) as comm:
        assert comm.device == torch.device("cuda", 0) and torch.cuda.current_device() == 0
        collective_checks(comm)
        grad_check(comm)
        launch = LaunchInfo(0, 1, 0, 1, Launcher.EXPLICIT)
        comm._group = comm._make_group(dist.HashStore(), launch, 60.0)  # type: ignore[attr-defined]
        _backend_hooks(comm)  # NCCLWork over real WorkNCCL: polls, then torch's wait()
    return f"NCCL {'.'.join(map(str, torch.cuda.nccl.version()))}"


def _nccl_2_one_gpu() -> str:
    """Two ranks on one GPU: the default device raises before the rendezvous; an explicit
    ``cuda:0`` on both ranks must raise too (NCCL: duplicate GPU), within the timeout."""
    start = time.monotonic()
    try:
        gradcomm.init("nccl", timeout=20)
    except BackendUnavailableError as exc:
        assert "CUDA device" in str(exc), exc
    else:
        raise AssertionError("nccl with 2 ranks on 1 GPU did not raise")
    first = time.monotonic() - start
    try:
        with gradcomm.init("nccl", device="cuda:0", timeout=20) as comm:
            comm.all_reduce(torch.ones(4, device="cuda:0"))
            comm.barrier()
    except (RuntimeError, BackendUnavailableError) as exc:
        why = " ".join(str(exc).split())[:70]
    else:
        raise AssertionError("two nccl ranks on one GPU reduced without an error")
    return f"default device raised in {first:.1f} s; cuda:0 on both raised: {why}"


def _cupy_nccl_1() -> str:
    import cupy  # type: ignore[import-not-found, unused-ignore]

    from gradcomm.comm.backends.cupy_nccl import as_tensor

    with gradcomm.init("cupy-nccl", rank=0, world_size=1, timeout=60) as comm:
        side = comm._stream  # type: ignore[attr-defined]
        assert side.cuda_stream != torch.cuda.current_stream().cuda_stream
        collective_checks(comm)
        _backend_hooks(comm)
        x = cupy.arange(5, dtype=cupy.float32)
        view = as_tensor(x)
        comm._all_reduce(view, ReduceOp.SUM, "cupy").wait()  # type: ignore[attr-defined]
        view.mul_(2)  # the view is the array's memory
        assert cupy.asnumpy(x).tolist() == [0.0, 2.0, 4.0, 6.0, 8.0]
        version = comm.nccl_version  # type: ignore[attr-defined]
    return f"CuPy {cupy.__version__}, NCCL {version}"


def _mpi_cuda(require_aware: bool) -> str:
    comm = gradcomm.init("mpi", device="cuda", timeout=60)  # both ranks share GPU 0
    with comm:
        aware = bool(getattr(comm, "cuda_aware", False))
        if require_aware and not aware:
            return "skip: " + comm._cuda_reason  # type: ignore[attr-defined]
        assert comm.device == torch.device("cuda", comm.local_rank % torch.cuda.device_count())
        assert torch.cuda.current_device() == comm.device.index
        collective_checks(comm)
        worst = grad_check(comm)
    return f"cuda_aware={aware} grad_rel_err={worst:.1e}"


def _reducer_mpi_cuda() -> str:
    """The reducer on CUDA over MPI in every mode against the same run on the CPU."""
    from tests._support.reducer_common import batch, loss_fn, make_model

    cases = {
        "overlap, many buckets": dict(bucket_cap_mb=0.002, first_bucket_cap_mb=0.0005,
                                      in_place_min_mb=math.inf),
        "end of backward": dict(bucket_cap_mb=0.002, overlap=False, in_place_min_mb=math.inf),
        "views": dict(bucket_cap_mb=0.002, gradient_as_bucket_view=True,
                      in_place_min_mb=math.inf),
        "in place": dict(bucket_cap_mb=0.002, in_place_min_mb=0.0009),
        "fp16": dict(bucket_cap_mb=0.002, comm_hook="fp16_compress", in_place_min_mb=math.inf),
        "bf16": dict(bucket_cap_mb=0.002, comm_hook="bf16_compress", in_place_min_mb=0.0009),
    }
    gpu = gradcomm.init("mpi", device="cuda", timeout=60)
    cpu = gradcomm.init("mpi", timeout=60)
    rank, worst = gpu.rank, 0.0
    with gpu, cpu, warnings.catch_warnings():
        warnings.simplefilter("ignore", SlowPathWarning)
        for name, options in cases.items():
            grads = []
            for comm in (cpu, gpu):
                model = make_model(seed=rank).to(comm.device)
                reducer = gradcomm.GradientReducer(model, comm, **options)  # type: ignore[arg-type]
                x, y = batch(rank)
                loss_fn(model, x.to(comm.device), y.to(comm.device)).backward()
                grads.append({n: p.grad.cpu() for n, p in model.named_parameters()
                              if p.grad is not None})
                reducer.remove()
            tol = 2e-2 if name in ("fp16", "bf16") else 1e-4
            assert grads[0].keys() == grads[1].keys(), name
            for key, want in grads[0].items():
                torch.testing.assert_close(grads[1][key], want, rtol=tol, atol=tol * 1e-2,
                                           msg=lambda m, n=name, k=key: f"{n} {k}: {m}")
                scale = want.abs().max().clamp_min(1e-12)
                worst = max(worst, float((grads[1][key] - want).abs().max() / scale))
    return f"{len(cases)} modes, worst rel. diff {worst:.1e}"


JOBS = {
    "nccl-1": _nccl_1,
    "nccl-2-one-gpu": _nccl_2_one_gpu,
    "cupy-nccl-1": _cupy_nccl_1,
    "mpi-cuda": lambda: _mpi_cuda(False),
    "mpi-cuda-aware": lambda: _mpi_cuda(True),
    "reducer-mpi-cuda": _reducer_mpi_cuda,
}


def main(argv: list[str]) -> int:
    """Run the job named in ``argv[0]``; print its RESULT line; 0 on success, 1 on error."""
    if len(argv) != 1 or argv[0] not in JOBS:
        print(f"usage: gpu_jobs.py JOB, JOB one of {', '.join(JOBS)}", file=sys.stderr)
        return 64
    name = argv[0]
    rank = os.environ.get("RANK") or os.environ.get("PMI_RANK") or "0"
    try:
        detail = JOBS[name]()
    except BaseException:  # noqa: BLE001 - reported, and under mpiexec the job must end
        traceback.print_exc()
        sys.stdout.flush()
        sys.stderr.flush()
        if "PMI_RANK" in os.environ or "OMPI_COMM_WORLD_RANK" in os.environ:
            from mpi4py import MPI

            MPI.COMM_WORLD.Abort(1)
        return 1
    if detail.startswith("skip: "):
        print(f"RESULT {name} {detail}", flush=True)
    else:
        print(f"RESULT {name} ok rank={rank} {detail}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

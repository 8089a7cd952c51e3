"""The MPI backend's checks beyond the conformance suite (``tests/comm/suite_collectives.py``):
every op on every dtype MPI reduces (8- and 16-bit integers, bool), 0-d and strided tensors, async
half-precision scratch buffers, and half precision at sizes MPI splits
(``tests/comm/suite_collectives.py`` runs it on every MPI run).

Each rank's input is a known function of (rank, dtype), so every rank computes the reference from
all ranks' inputs itself; a wrong value raises AssertionError naming the case.
"""

from __future__ import annotations

import numpy as np
import torch

import gradcomm
from gradcomm.comm.backends.mpi.communicator import MPICommunicator

N = 37
#: checks :func:`every_op_and_dtype` makes: 44 all-reduces (10 dtypes x 5 ops, no AVG of integers
#: or bool), 2 odd shapes, 6 broadcasts, 4 all-gathers, a barrier, 3 async, 2 large half runs
CHECKS = 62
INT_DTYPES = [torch.int8, torch.uint8, torch.int16, torch.int32, torch.int64]
FLOAT_DTYPES = [torch.float32, torch.float64]
HALF_DTYPES = [torch.float16, torch.bfloat16]
OPS = [gradcomm.ReduceOp.SUM, gradcomm.ReduceOp.AVG, gradcomm.ReduceOp.MIN,
       gradcomm.ReduceOp.MAX, gradcomm.ReduceOp.PRODUCT]


def rank_input(rank: int, dtype: torch.dtype) -> torch.Tensor:
    """The tensor rank ``rank`` contributes (small values, so integer products never overflow)."""
    idx = torch.arange(N)
    if dtype == torch.bool:
        return (idx + rank) % 3 == 0
    if dtype == torch.uint8:
        return ((idx + rank) % 3 + 1).to(dtype)
    if not dtype.is_floating_point:
        return ((idx * 7 + 3 * rank) % 5 - 2).to(dtype)
    gen = torch.Generator().manual_seed(1000 + rank)
    return (torch.rand(N, generator=gen, dtype=torch.float64) * 4 - 2).to(dtype)


def reference(op: gradcomm.ReduceOp, dtype: torch.dtype, world: int) -> np.ndarray:
    """Reduce every rank's input in float64 (int64 for integers) with numpy."""
    wide = np.float64 if dtype.is_floating_point else np.int64
    stack = np.stack([rank_input(r, dtype).to(torch.float64).numpy().astype(wide)
                      for r in range(world)])
    reduced: np.ndarray
    if op is gradcomm.ReduceOp.SUM:
        reduced = stack.sum(0)
    elif op is gradcomm.ReduceOp.AVG:
        reduced = stack.sum(0) / world
    elif op is gradcomm.ReduceOp.MIN:
        reduced = stack.min(0)
    elif op is gradcomm.ReduceOp.MAX:
        reduced = stack.max(0)
    else:
        reduced = stack.prod(0)
    return reduced


def ulp(values: torch.Tensor) -> torch.Tensor:
    """Spacing of float16/bfloat16 numbers at ``values`` (as float64)."""
    mant = 10 if values.dtype == torch.float16 else 7
    tiny = 2.0 ** -24 if values.dtype == torch.float16 else 2.0 ** -133
    mag = values.to(torch.float64).abs()
    exp = torch.floor(torch.log2(torch.where(mag > 0, mag, torch.ones_like(mag))))
    return torch.clamp(2.0 ** (exp - mant), min=tiny)


def every_op_and_dtype(comm: gradcomm.Communicator) -> tuple[int, int, int]:
    """Run the checks on this rank; ``(rank, world size, number of checks made)``."""
    assert isinstance(comm, MPICommunicator), type(comm)
    rank, world = comm.rank, comm.world_size
    checks = 0

    # all_reduce: every op and dtype.
    for dtype in INT_DTYPES + FLOAT_DTYPES + HALF_DTYPES + [torch.bool]:
        for op in OPS:
            if op is gradcomm.ReduceOp.AVG and not dtype.is_floating_point:
                continue
            t = rank_input(rank, dtype).clone()
            comm.all_reduce(t, op)
            ref = reference(op, dtype, world)
            case = f"all_reduce {op.name} {dtype} world={world}"
            assert t.dtype == dtype and t.shape == (N,), case
            if dtype == torch.bool:
                expect = torch.from_numpy(ref != 0)  # SUM/MAX: any, PRODUCT/MIN: all
                assert torch.equal(t, expect), f"{case}: {t} != {expect}"
            elif dtype in HALF_DTYPES:
                # fp32 reference cast back to the dtype; allow one unit in the last place.
                expect = torch.from_numpy(ref).to(torch.float32).to(dtype)
                err = (t.to(torch.float64) - expect.to(torch.float64)).abs()
                assert bool((err <= ulp(expect)).all()), f"{case}: max err {err.max()}"
            elif dtype.is_floating_point:
                tol = 1e-6 if dtype == torch.float32 else 1e-12
                np.testing.assert_allclose(t.numpy(), ref, rtol=tol, atol=tol, err_msg=case)
            else:
                expect = torch.from_numpy(ref).to(dtype)
                assert torch.equal(t, expect), f"{case}: {t} != {expect}"
            checks += 1

    # all_reduce of a non-contiguous tensor (a transposed view) and of a 0-d tensor.
    base = torch.arange(12, dtype=torch.float32).reshape(3, 4) * (rank + 1)
    view = base.t()
    comm.all_reduce(view)
    total = sum(range(1, world + 1))
    assert torch.equal(base, torch.arange(12, dtype=torch.float32).reshape(3, 4) * total), base
    scalar = torch.tensor(float(rank))
    comm.all_reduce(scalar, "max")
    assert scalar.item() == world - 1, scalar
    checks += 2

    # broadcast from the last rank (non-zero src), several dtypes, and a non-contiguous tensor.
    src = world - 1
    for dtype in [torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.bool]:
        t = rank_input(rank, dtype).clone()
        comm.broadcast(t, src=src)
        assert torch.equal(t, rank_input(src, dtype)), f"broadcast {dtype} from {src}: {t}"
        checks += 1
    grid = torch.full((4, 6), float(rank))
    comm.broadcast(grid[:, ::2], src=src)
    assert torch.equal(grid[:, ::2], torch.full((4, 3), float(src))), grid
    assert torch.equal(grid[:, 1::2], torch.full((4, 3), float(rank))), "broadcast wrote outside"
    checks += 1

    # all_gather: rank order, several dtypes, a 2-D output.
    for dtype in [torch.float32, torch.bfloat16, torch.int16, torch.bool]:
        out = torch.empty(world, N, dtype=dtype)
        comm.all_gather(out, rank_input(rank, dtype))
        expect = torch.stack([rank_input(r, dtype) for r in range(world)])
        assert torch.equal(out, expect), f"all_gather {dtype}: {out}"
        checks += 1

    # barrier
    comm.barrier()
    checks += 1

    # async: several collectives in flight, polled with is_completed(), then waited.
    tensors = [torch.full((1000 * (i + 1),), float(rank + i)) for i in range(3)]
    works = [comm.all_reduce(t, "sum", async_op=True, label=f"bucket {i}")
             for i, t in enumerate(tensors)]
    gathered = torch.empty(world * 2, dtype=torch.int64)
    works.append(comm.all_gather(gathered, torch.tensor([rank, -rank]), async_op=True))
    while not all(w.is_completed() for w in works):
        pass
    for w in works:
        w.wait()
    for i, t in enumerate(tensors):
        total_i = float(sum(r + i for r in range(world)))
        assert bool((t == total_i).all()), f"async bucket {i}: {t[:3]} != {total_i}"
    assert gathered.tolist() == [v for r in range(world) for v in (r, -r)], gathered
    checks += 2

    # async half precision AVG: the scratch buffers of overlapping ops must not be shared.
    halves = [torch.full((513,), float(rank + 2 * i), dtype=torch.bfloat16) for i in range(3)]
    works = [comm.all_reduce(h, "avg", async_op=True) for h in halves]
    for w in reversed(works):
        w.wait()
    for i, h in enumerate(halves):
        mean = sum(r + 2 * i for r in range(world)) / world
        assert bool((h.float() == torch.tensor(mean).bfloat16().float()).all()), (i, h[:3])
    checks += 1

    # Half precision at a size MPI splits into many pieces (and odd), bit-identical on all ranks;
    # then mixed sizes, so the float32 scratch buffers are reused at other sizes.
    for dtype in HALF_DTYPES:
        big = 300_001
        gen = torch.Generator().manual_seed(7 + rank)
        x = (torch.rand(big, generator=gen, dtype=torch.float64) * 4 - 2).to(dtype)
        every = torch.empty(world, big, dtype=dtype)
        comm.all_gather(every, x)
        expect = every.to(torch.float32).sum(0).to(dtype)
        comm.all_reduce(x)
        err = (x.to(torch.float64) - expect.to(torch.float64)).abs()
        assert bool((err <= ulp(expect)).all()), f"large {dtype} SUM: max err {err.max()}"
        if world == 2:  # one rounding per element: exactly the float32 reference
            assert torch.equal(x, expect), f"large {dtype} SUM differs from fp32 reference"
        bits = torch.empty(world, big, dtype=torch.int16)
        comm.all_gather(bits, x.view(torch.int16))
        assert bool((bits == bits[0]).all()), f"large {dtype} SUM differs between ranks"
        for size in (2000, 100, 513, 4000, 100):
            y = torch.full((size,), float(rank + 1), dtype=dtype)
            comm.all_reduce(y, "avg")
            assert bool((y.float() == (world + 1) / 2).all()), f"{dtype} avg of {size}: {y[:3]}"
        checks += 1

    return rank, world, checks

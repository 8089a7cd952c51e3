"""The collective interface on every backend, as rank-agnostic tests (the module tier,
:mod:`tests._support.rank_suite`; run by ``tests/comm/test_rank_suites.py``): one conformance
suite (every op and dtype of all_reduce, broadcast, all_gather, barrier, odd layouts, async works,
bad input, close), the other collectives against the torch reference (``coll_cases``), and the
MPI backend's own paths (every dtype MPI reduces, the device-buffer path without a GPU,
collectives left pending by the caller).

Every rank's input is a known function of its rank, so each rank computes the reference result
of every collective locally. The inputs are small integers stored in each dtype: every sum,
product and average is then exact (or correctly rounded once), independent of the order in which
the transport combines ranks, so results are compared exactly.
"""

from __future__ import annotations

import logging
import tempfile
import time
import warnings
import weakref
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

import gradcomm
from gradcomm import SlowPathWarning
from gradcomm.comm import Communicator, ReduceOp, SupportLevel, Work

from tests._support import coll_cases, rank_suite
from tests._support.collective_checks import (
    check_any_dtype_moves,
    check_awkward_targets,
    check_callbacks_on_completed_works,
    check_complex,
    check_sign_bits,
)
from tests._support.mpi_adapters import FakeAdapter, FakeDeviceArray, device_adapters
from tests._support.mpi_backend_collectives import CHECKS as MPI_DTYPE_CHECKS
from tests._support.mpi_backend_collectives import every_op_and_dtype

N = 1031  # odd, so no transport gets a conveniently divisible size
EXACT_DTYPES = [torch.float32, torch.float64, torch.int32, torch.int64]
HALF_DTYPES = [torch.float16, torch.bfloat16]


def rank_input(rank: int, dtype: torch.dtype, n: int = N) -> torch.Tensor:
    """Rank ``rank``'s input: integers in [-3, 3] (products of up to 3 ranks stay exact)."""
    return ((torch.arange(n) * 7 + 3 * rank + 1) % 7 - 3).to(dtype)


def reference(op: ReduceOp, world_size: int, dtype: torch.dtype, n: int = N) -> torch.Tensor:
    """The expected result of all-reducing every rank's :func:`rank_input`, computed in float64."""
    stack = torch.stack([rank_input(r, torch.float64, n) for r in range(world_size)])
    if op is ReduceOp.SUM:
        out = stack.sum(0)
    elif op is ReduceOp.AVG:
        out = stack.sum(0) / world_size
    elif op is ReduceOp.PRODUCT:
        out = stack.prod(0)
    elif op is ReduceOp.MIN:
        out = stack.min(0).values
    else:
        out = stack.max(0).values
    return out.to(dtype)


# ----------------------------------------------------------------------------- shared checks
def _wait_for(flag: Path, limit: float = 60.0) -> None:
    """Wait until another rank creates ``flag`` (at most ``limit`` seconds)."""
    deadline = time.monotonic() + limit
    while not flag.exists() and time.monotonic() < deadline:
        time.sleep(0.01)


def check_reductions(comm: Communicator, dtypes: list[torch.dtype]) -> None:
    """Every ReduceOp on every dtype, against the reference; AVG on integers raises TypeError."""
    for dtype in dtypes:
        for op in ReduceOp:
            t = rank_input(comm.rank, dtype)
            if op is ReduceOp.AVG and not dtype.is_floating_point:
                with pytest.raises(TypeError, match="AVG"):
                    comm.all_reduce(t, op)
                assert torch.equal(t, rank_input(comm.rank, dtype))  # untouched
                continue
            work = comm.all_reduce(t, op)
            assert work.is_completed()
            assert t.dtype == dtype and t.shape == (N,)
            expected = reference(op, comm.world_size, dtype)
            assert torch.equal(t, expected), f"{op} on {dtype}: {t[:8]} != {expected[:8]}"
        # Op given by name, and a value that float64 cannot hold (no float path for int64).
        if dtype is torch.int64:
            big = torch.full((5,), 2**53 + 1, dtype=torch.int64)
            comm.all_reduce(big, "sum")
            assert big.tolist() == [(2**53 + 1) * comm.world_size] * 5


def check_broadcast_gather_barrier(comm: Communicator) -> None:
    rank, ws = comm.rank, comm.world_size
    src = 1 % ws
    t = torch.full((4, 3), float(rank), dtype=torch.float64) + torch.arange(12.0).view(4, 3)
    comm.broadcast(t, src=src)
    assert torch.equal(t, torch.arange(12.0, dtype=torch.float64).view(4, 3) + src)

    ints = torch.arange(5, dtype=torch.int64) * (rank + 1)
    out = torch.empty(ws, 5, dtype=torch.int64)
    comm.all_gather(out, ints)
    assert torch.equal(out, torch.stack([torch.arange(5) * (r + 1) for r in range(ws)]))

    flat = torch.empty(ws * 5, dtype=torch.int64)  # a flat output works too
    comm.all_gather(flat, ints)
    assert torch.equal(flat, out.view(-1))

    comm.barrier()
    comm.barrier()


def check_non_contiguous(comm: Communicator) -> None:
    rank, ws = comm.rank, comm.world_size
    base = torch.arange(24.0).view(4, 6) * (rank + 1)
    view = base[:, ::2]  # non-contiguous, shares storage with base
    assert not view.is_contiguous()
    comm.all_reduce(view, ReduceOp.SUM)
    total = sum(r + 1 for r in range(ws))
    expected = torch.arange(24.0).view(4, 6) * (rank + 1)
    expected[:, ::2] = torch.arange(24.0).view(4, 6)[:, ::2] * total
    assert torch.equal(base, expected)  # written back into the view; the gaps untouched

    mat = (torch.arange(6.0).view(2, 3) + 10 * rank).t()  # transposed
    comm.broadcast(mat, src=0)
    assert torch.equal(mat, torch.arange(6.0).view(2, 3).t())

    out = torch.zeros(3, 2 * ws).t()  # non-contiguous output of all_gather
    comm.all_gather(out, torch.full((3, 2), float(rank)).t())
    expected_out = torch.cat([torch.full((2, 3), float(r)) for r in range(ws)])
    assert torch.equal(out, expected_out)


def check_async(comm: Communicator, handshake: Path) -> None:
    """Rank 0's async all-reduce is pending until the others join; wait() then completes it;
    callbacks on completed works; several works in flight."""
    t = torch.full((N,), float(comm.rank + 1))
    flag = handshake / "rank0-checked"
    if comm.rank == 0:
        work = comm.all_reduce(t, ReduceOp.AVG, async_op=True)
        # The other ranks have not issued theirs yet (they wait for the flag file); alone, a rank
        # issues no collective and the work is complete at once.
        assert work.is_completed() == (comm.world_size == 1)
        flag.touch()
        work.wait()
    else:
        _wait_for(flag)
        work = comm.all_reduce(t, ReduceOp.AVG, async_op=True)
        work.wait()
    assert work.is_completed()
    work.wait()  # waiting again is a no-op
    assert torch.equal(t, torch.full((N,), (comm.world_size + 1) / 2))
    # a callback added to a completed work runs at once (it used to raise RuntimeError), under
    # no_grad; its error is raised by every wait(), as for a pending work, not by add_callback
    ran: list[bool] = []
    work.add_callback(lambda: ran.append(torch.is_grad_enabled()))
    assert ran == [False]

    def bad() -> None:
        raise ValueError("deliberate late callback failure")

    work.add_callback(bad)
    work.add_callback(lambda: ran.append(True))  # later callbacks still run
    assert ran == [False, True]
    for _ in range(2):
        with pytest.raises(ValueError, match="deliberate late"):
            work.wait()
    # an inference tensor accepts in-place updates only in inference mode, where callbacks run
    # (the mode was lost for callbacks added after the collective was posted)
    with torch.inference_mode():
        inf = torch.ones(2)
    for async_op in (True, False):
        w = comm.all_reduce(inf, async_op=async_op)
        w.add_callback(lambda: inf.mul_(0.5))
        w.wait()
    assert inf.tolist() == [comm.world_size**2 / 4] * 2
    pending = comm.all_reduce(torch.ones(1), async_op=True)
    with pytest.raises(TypeError, match="callable"):
        pending.add_callback(5)  # type: ignore[arg-type]
    pending.wait()
    # no collective is issued for an empty tensor: the work is complete at once
    empty = comm.all_reduce(torch.ones(0), async_op=True)
    seen: list[str] = []
    empty.add_callback(lambda: seen.append("empty"))
    empty.wait()
    assert seen == ["empty"]

    # Several in flight at once, each its own buffer; waited in reverse order.
    bufs = [torch.full((7,), float(i * (comm.rank + 1))) for i in range(4)]
    works = [comm.all_reduce(b, async_op=True) for b in bufs]
    works += [comm.broadcast(torch.zeros(1), src=0, async_op=True)]
    for w in reversed(works):
        w.wait()
    total = sum(r + 1 for r in range(comm.world_size))
    for i, b in enumerate(bufs):
        assert torch.equal(b, torch.full((7,), float(i * total)))


def check_bad_input(comm: Communicator) -> None:
    t = torch.ones(3)
    # supports() checks its device argument as init() does (torch's own errors leaked before)
    with pytest.raises(ValueError, match="'tpu' is not a torch device"):
        comm.supports(torch.float32, "tpu")
    with pytest.raises(TypeError, match=r"str or torch\.device, got int"):
        comm.supports(torch.float32, 5)  # type: ignore[arg-type]
    assert comm.supports(torch.float32, "cpu") == comm.supports(torch.float32, torch.device("cpu"))
    with pytest.raises(TypeError, match=r"torch\.Tensor"):
        comm.all_reduce([1.0, 2.0])  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"torch\.Tensor"):
        comm.broadcast(3.0)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="dense"):
        comm.all_reduce(torch.eye(3).to_sparse())
    for _ in range(2):  # the second time, the (dtype, device) verdict comes from a cache
        with pytest.raises(ValueError, match="meta"):
            comm.all_reduce(torch.ones(3, device="meta"))
        with pytest.raises(ValueError, match="meta"):
            comm.broadcast(torch.ones(3, device="meta"))
        for dtype in (torch.bool, torch.uint16, torch.float8_e4m3fn):
            if not comm.supports(dtype).is_supported:
                with pytest.raises(TypeError, match=str(dtype)):
                    comm.all_reduce(torch.zeros(3, dtype=dtype))
    with pytest.raises(ValueError, match="unknown reduction op"):
        comm.all_reduce(t, "mean")
    with pytest.raises(TypeError, match="ReduceOp"):
        comm.all_reduce(t, 0)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="src"):
        comm.broadcast(t, src=comm.world_size)
    with pytest.raises(TypeError, match="src"):
        comm.broadcast(t, src=0.0)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="world_size"):
        comm.all_gather(torch.empty(comm.world_size * 3 + 1), t)
    with pytest.raises(TypeError, match="dtype"):
        comm.all_gather(torch.empty(comm.world_size * 3, dtype=torch.float64), t)
    assert torch.equal(t, torch.ones(3))


def check_closed(comm: Communicator) -> None:
    comm.close()
    comm.close()  # idempotent
    assert comm.closed
    t = torch.ones(2)
    for call in (
        lambda: comm.all_reduce(t),
        lambda: comm.broadcast(t),
        lambda: comm.all_gather(torch.empty(2 * comm.world_size), t),
        comm.barrier,
        lambda: comm.supports(torch.float32),
    ):
        with pytest.raises(RuntimeError, match="closed"):
            call()


def _mpi_only(run: rank_suite.Run) -> bool:
    return run.backend == "mpi"


# ----------------------------------------------------------------------------- the suite
def test_supports_what_the_suite_reduces(comm: Communicator) -> None:
    assert comm.supports(torch.float32).level is SupportLevel.NATIVE
    if comm.backend == "gloo":
        for dtype in HALF_DTYPES:
            assert comm.supports(dtype).level is SupportLevel.EMULATED_SLOW
    assert not comm.supports(torch.float32, "meta").is_supported
    assert [d for d in EXACT_DTYPES + HALF_DTYPES if not comm.supports(d).is_supported] == []


def test_bad_input_raises_and_keeps_the_ranks_in_step(comm: Communicator) -> None:
    check_bad_input(comm)
    t = torch.ones(2)
    comm.all_reduce(t)  # bad input issued no collective on any rank
    assert t.tolist() == [comm.world_size] * 2


def test_every_reduce_op_and_dtype(comm: Communicator) -> None:
    check_reductions(comm, EXACT_DTYPES + HALF_DTYPES)


def test_bool_reductions_are_a_logical_or_and(comm: Communicator) -> None:
    """On backends that reduce bool (mpi, gloo, as torch's gloo does): SUM and MAX are a logical
    or, PRODUCT and MIN a logical and; AVG is refused."""
    if not comm.supports(torch.bool).is_supported:
        pytest.skip(f"{comm.backend} does not reduce bool")

    def mine(rank: int) -> torch.Tensor:  # each rank's own pattern of True
        return (torch.arange(12) + rank) % (comm.world_size + 1) != 0

    every = torch.stack([mine(r) for r in range(comm.world_size)])
    for op, expected in ((ReduceOp.SUM, every.any(0)), (ReduceOp.MAX, every.any(0)),
                         (ReduceOp.PRODUCT, every.all(0)), (ReduceOp.MIN, every.all(0))):
        t = mine(comm.rank)
        comm.all_reduce(t, op)
        assert t.dtype == torch.bool and torch.equal(t, expected), (op, t, expected)
    with pytest.raises(TypeError, match="AVG"):
        comm.all_reduce(mine(comm.rank), ReduceOp.AVG)


def test_broadcast_all_gather_barrier(comm: Communicator) -> None:
    check_broadcast_gather_barrier(comm)


def test_non_contiguous_tensors(comm: Communicator) -> None:
    check_non_contiguous(comm)


def test_negative_and_conjugate_views(comm: Communicator) -> None:
    check_sign_bits(comm)


def test_any_dtype_moves(comm: Communicator) -> None:
    check_any_dtype_moves(comm)


def test_awkward_targets(comm: Communicator) -> None:
    check_awkward_targets(comm)


def test_complex(comm: Communicator) -> None:
    check_complex(comm)


def test_callbacks_on_completed_works(comm: Communicator) -> None:
    check_callbacks_on_completed_works(comm)


def test_async_works(comm: Communicator) -> None:
    handshake = comm.broadcast_object(tempfile.mkdtemp() if comm.rank == 0 else None)
    check_async(comm, Path(str(handshake)))


def test_closed_communicator_refuses_every_call(comm: Communicator) -> None:
    child = comm.split(0)  # the run's communicator stays open for the tests after this one
    assert child is not None
    check_closed(child)


@rank_suite.only(lambda run: run.backend == "threads")
def test_thread_ranks_issued_the_same_collectives(comm: Communicator) -> None:
    mine = comm.group.calls[comm.rank]  # type: ignore[attr-defined]  # read before the next one
    everyone = comm.all_gather_object(mine)
    assert everyone[0] > 0 and everyone == [everyone[0]] * comm.world_size, everyone


# ----------------------------------------------------------------------------- other collectives
def _dtypes(comm: Communicator) -> list[torch.dtype]:
    """The dtypes the other collectives are checked in: gloo without int16."""
    extra = [torch.bool] if comm.backend == "gloo" else [torch.int16, torch.bool]
    return coll_cases.FLOATS + coll_cases.INTS + coll_cases.HALF + extra


def test_bad_input_of_the_other_collectives(comm: Communicator) -> None:
    assert (coll_cases.check_bad_reduce_scatter(comm) + coll_cases.check_bad_all_to_all(comm)
            + coll_cases.check_bad_rooted(comm) + coll_cases.check_bad_all_gather_uneven(comm)
            ) > 0


def test_supports_per_collective(comm: Communicator) -> None:
    assert coll_cases.check_supports(comm) > 0


def test_reduce_scatter(comm: Communicator) -> None:
    assert coll_cases.check_reduce_scatter(comm, _dtypes(comm)) > 0


def test_all_to_all(comm: Communicator) -> None:
    assert coll_cases.check_all_to_all(comm, _dtypes(comm)) > 0


def test_reduce_gather_scatter(comm: Communicator) -> None:
    assert coll_cases.check_rooted(comm, _dtypes(comm)) > 0


def test_all_gather_uneven(comm: Communicator) -> None:
    assert coll_cases.check_all_gather_uneven(comm, _dtypes(comm)) > 0


def test_object_collectives(comm: Communicator) -> None:
    assert coll_cases.check_objects(comm) > 0


@rank_suite.only(_mpi_only)
def test_other_collectives_through_the_device_buffer_path(comm: Communicator) -> None:
    few = [torch.float32, torch.int32, torch.bfloat16]
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", SlowPathWarning)  # the staging path says it is slow
            for adapter in device_adapters():
                comm._adapter = adapter  # type: ignore[attr-defined]
                assert sum(coll_cases.run_all(comm, few).values()) > 0
    finally:
        comm._adapter = None  # type: ignore[attr-defined]


def test_all_gather_with_input_aliasing_output(comm: Communicator) -> None:
    """MPI rejects (or silently mis-reads) a send buffer inside the receive buffer; the base class
    sends a copy instead, so both idioms give the right values."""
    n, r = comm.world_size, comm.rank
    want = torch.tensor([v for k in range(n) for v in (10.0 * k, 10.0 * k + 1)])
    out = torch.zeros(n * 2)
    out[2 * r : 2 * r + 2] = torch.tensor([10.0 * r, 10.0 * r + 1])
    comm.all_gather(out, out[2 * r : 2 * r + 2])  # the in-place idiom: this rank's own slot
    assert torch.equal(out, want), out
    out2 = torch.zeros(n * 2)
    out2[:2] = torch.tensor([10.0 * r, 10.0 * r + 1])
    comm.all_gather(out2, out2[:2])  # overlapping another rank's slot
    assert torch.equal(out2, want), out2


# ----------------------------------------------------------------------------- MPI's own paths
@rank_suite.only(_mpi_only)
def test_mpi_every_op_on_every_dtype_it_reduces(comm: Communicator) -> None:
    """8- and 16-bit integers and bool too, 0-d and strided tensors, async half-precision scratch
    buffers, half precision at sizes MPI splits (``mpi_backend_collectives``)."""
    assert every_op_and_dtype(comm) == (comm.rank, comm.world_size, MPI_DTYPE_CHECKS)


def _check_fake_adapter(comm: Communicator, adapter: FakeAdapter) -> None:
    rank, world = comm.rank, comm.world_size
    total = float(sum(range(1, world + 1)))
    t = torch.full((1000,), float(rank + 1))
    comm.all_reduce(t)
    assert bool((t == total).all()), f"{adapter.staged=}: float32 all_reduce gave {t[:4]}"
    assert adapter.events == ["prepare torch.float32", "finish"], adapter.events
    adapter.events.clear()

    h = torch.full((300,), float(rank + 1), dtype=torch.bfloat16)
    comm.all_reduce(h, "avg", async_op=True).wait()
    assert bool((h.float() == total / world).all()), f"{adapter.staged=}: bf16 avg gave {h[:4]}"
    # fp16/bf16 are upcast on the torch side first: the adapter sees float32.
    assert adapter.events == ["prepare torch.float32", "finish"], adapter.events
    adapter.events.clear()

    b = torch.full((7,), float(rank))
    comm.broadcast(b, src=world - 1)
    assert bool((b == world - 1).all()), f"{adapter.staged=}: broadcast gave {b}"
    out = torch.empty(world, 3, dtype=torch.int64)
    comm.all_gather(out, torch.full((3,), rank, dtype=torch.int64))
    assert out[:, 0].tolist() == list(range(world)), f"{adapter.staged=}: all_gather gave {out}"
    assert adapter.events.count("finish") == 3, adapter.events  # broadcast 1, all_gather 2


def _check_real_adapter(comm: Communicator, cuda_aware: bool) -> None:
    """The real DeviceBufferAdapter on CPU tensors: fake device arrays, or host staging."""
    from gradcomm.comm.backends.mpi.device import DeviceBufferAdapter

    syncs: list[int] = []
    comm._adapter = DeviceBufferAdapter(  # type: ignore[attr-defined]
        cuda_aware, synchronize=lambda: syncs.append(1),
        to_array=lambda wire: FakeDeviceArray(wire.numpy()))
    rank, world = comm.rank, comm.world_size
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", SlowPathWarning)
        t = torch.full((5000,), float(rank + 1))
        comm.all_reduce(t, "max")
        h = torch.full((33,), float(rank + 1), dtype=torch.bfloat16)
        comm.all_reduce(h, "sum")
        b = torch.arange(10) * (rank + 1)
        comm.broadcast(b, src=world - 1)
        out = torch.empty(world, 4, dtype=torch.float16)
        comm.all_gather(out, torch.full((4,), float(rank), dtype=torch.float16))
    total = world * (world + 1) / 2
    assert bool((t == world).all()) and bool((h.float() == total).all()), (cuda_aware, t, h)
    assert torch.equal(b, torch.arange(10) * world), (cuda_aware, b)
    assert out[:, 0].tolist() == [float(r) for r in range(world)], (cuda_aware, out)
    assert len(syncs) == 5, syncs  # one synchronize per prepared buffer (all_gather: two)


@rank_suite.only(lambda run: run.backend == "mpi" and run.world_size > 1)
def test_mpi_device_buffer_path_with_fake_adapters(comm: Communicator) -> None:
    """The device-buffer path without a GPU: zero-copy and staged fake adapters, then the real
    ``DeviceBufferAdapter`` (CUDA-aware or staged) on CPU tensors. (Alone, a rank issues no
    collective: nothing would reach the adapter.)"""
    try:
        for staged in (False, True):
            adapter = FakeAdapter(staged)
            comm._adapter = adapter  # type: ignore[attr-defined]
            _check_fake_adapter(comm, adapter)
        for cuda_aware in (True, False):
            _check_real_adapter(comm, cuda_aware)
    finally:
        comm._adapter = None  # type: ignore[attr-defined]


# Collectives left pending by the caller: rank 0 acts while the others are late. Written for two
# ranks (and, being about MPI's buffers, not about rank counts), they run on mpi-2 only.
def _pending_run(run: rank_suite.Run) -> bool:
    return run.id == "mpi-2"


@rank_suite.only(_pending_run)
def test_mpi_dropped_pending_works_keep_their_buffers(comm: Communicator) -> None:
    """Rank 1 joins 0.5 s late, so rank 0's async all-reduces are still pending when their Work
    (and, for one, the tensor itself) is dropped: MPI still writes into those buffers, so the
    communicator keeps them alive until the collective completes, and a dropped work's copy-back
    into a non-contiguous tensor still happens."""
    r = comm.rank
    if r == 1:
        time.sleep(0.5)
    gone = torch.ones(4096)
    ref = weakref.ref(gone)
    comm.all_reduce(gone, async_op=True)  # Work dropped at once
    del gone
    if r == 0:
        assert ref() is not None, "the tensor of a pending all_reduce was freed while MPI used it"
    strided = torch.ones(64, 2)[:, 0]  # non-contiguous: reduced in a copy, written back after
    comm.all_reduce(strided, async_op=True)
    for _ in range(100):  # later collectives finish the dropped ones
        # The last element counts the ranks that are done, so that all leave the loop together
        # (a rank leaving alone would pair its next collective with another rank's probe).
        done = ref() is None and torch.equal(strided, torch.full((64,), 2.0))
        probe = torch.tensor([1.0, 1.0, 1.0, float(done)])
        comm.all_reduce(probe)
        assert torch.equal(probe[:3], torch.full((3,), 2.0)), probe
        if probe[3] == comm.world_size:
            break
    else:
        raise AssertionError(f"after 100 collectives, dropped tensor freed: {ref() is None}; "
                             f"copy-back into the strided tensor: {strided[:4].tolist()}...")


@rank_suite.only(_pending_run)
def test_mpi_a_short_wait_times_out_and_the_collective_completes_later(comm: Communicator
                                                                       ) -> None:
    """Rank 1 joins 1.5 s late; rank 0's ``wait(timeout=0.3)`` times out. While that collective
    is pending, a new one raises RuntimeError at once; once it completes (a second ``wait()``),
    the communicator works again, on both ranks."""
    r = comm.rank
    t = torch.full((5,), float(r + 1))
    if r == 1:
        time.sleep(1.5)
        comm.all_reduce(t)
    else:
        work = comm.all_reduce(t, async_op=True)
        with pytest.raises(gradcomm.CollectiveTimeoutError):
            work.wait(timeout=0.3)
        with pytest.raises(RuntimeError, match=r"unusable.*still pending"):
            comm.all_reduce(torch.ones(2))
        work.wait()
    assert torch.equal(t, torch.full((5,), 3.0)), t
    after = torch.full((2,), float(r))
    comm.all_reduce(after)  # usable again
    assert torch.equal(after, torch.ones(2)), after


LATE = 0.25  # seconds rank 1 is late in each swap


@rank_suite.only(_pending_run)
def test_mpi_pending_collectives_keep_memory_swapped_out_of_their_tensors(comm: Communicator
                                                                          ) -> None:
    """Rank 1 joins 0.25 s late; rank 0 replaces the memory of each tensor it handed to a pending
    collective (``t.data = ...`` or ``t.set_(...)``). MPI still writes into the old memory, so
    the collective keeps that memory alive (not just the tensor object); the tensor's new memory
    stays untouched on these contiguous paths; a dropped work whose copy-back fails (the tensor
    got smaller memory) logs a warning, and the next collectives run on every rank. (Were rank 1
    not late enough, a swap would follow completion and the check pass without testing: the
    delay only has to outlast rank 0's few allocations.)"""
    r, n = comm.rank, comm.world_size
    comm.all_reduce(torch.ones(2))
    size = 1 << 18  # 1 MiB of float32: freed memory goes back to the allocator's pool
    cases: list[tuple[str, Callable[[torch.Tensor], Work]]] = [
        ("all_reduce 1-D", lambda t: comm.all_reduce(t, async_op=True)),
        ("all_reduce 2-D", lambda t: comm.all_reduce(t.view(512, -1), async_op=True)),
        ("all_reduce MAX", lambda t: comm.all_reduce(t, "max", async_op=True)),
        ("broadcast", lambda t: comm.broadcast(t, src=1, async_op=True)),
    ]
    for name, start in cases:
        for how in ("data", "set_"):
            if r == 1:
                time.sleep(LATE)  # rank 0's collective stays pending meanwhile
            t = torch.full((size,), float(r + 1))
            handle = t if name != "all_reduce 2-D" else t.view(512, -1)
            work = start(t)
            if r == 0:
                new = torch.full(handle.shape, -5.0)  # new memory of the same shape
                if how == "data":
                    handle.data = new
                else:
                    handle.set_(new)
                del t
                fresh = [torch.full((size,), 7.0) for _ in range(4)]  # may reuse freed memory
            work.wait()
            if r == 0:
                assert all(torch.equal(f, torch.full((size,), 7.0)) for f in fresh), \
                    f"{name} ({how}) wrote into memory allocated after the swap"
                assert torch.equal(handle, torch.full(handle.shape, -5.0)), \
                    f"{name} ({how}) wrote into the tensor's new memory"
    for how in ("data", "set_"):
        if r == 1:
            time.sleep(LATE)
        src = torch.full((size,), float(r))
        out = torch.empty(n * size)
        work = comm.all_gather(out, src, async_op=True)
        if r == 0:
            if how == "data":
                src.data, out.data = torch.zeros(1), torch.zeros(1)
            else:
                src.set_(torch.zeros(1))
                out.set_(torch.zeros(1))
            fresh = [torch.full((size,), 7.0) for _ in range(4)]
        work.wait()
        if r == 0:
            assert all(torch.equal(f, torch.full((size,), 7.0)) for f in fresh), \
                f"all_gather ({how}) wrote into memory allocated after the swap"
    # A dropped work whose copy-back (non-contiguous tensor) fails because the tensor got smaller
    # memory: the error is logged, and the later collectives run on every rank, in step.
    warned: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            warned.append(record.getMessage())

    keep = Keep(logging.WARNING)
    logging.getLogger("gradcomm.comm").addHandler(keep)
    try:
        if r == 1:
            time.sleep(LATE)
        strided = torch.ones(8, 4)[:, ::2]
        comm.all_reduce(strided, async_op=True)  # Work dropped
        if r == 0:
            strided.data = torch.zeros(1)
        for _ in range(5):
            probe = torch.ones(3)
            comm.all_reduce(probe)
            assert torch.equal(probe, torch.full((3,), float(n))), probe
    finally:
        logging.getLogger("gradcomm.comm").removeHandler(keep)
    if r == 0:
        assert any("completion step failed" in w for w in warned), warned

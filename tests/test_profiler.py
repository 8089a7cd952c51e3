"""The communication profiler: records, summaries (nccl-tests' busbw), Chrome traces, opt-in."""

from __future__ import annotations

import itertools
import json
import os
from pathlib import Path
from typing import Any

import pytest
import torch

import gradcomm
from gradcomm.comm.backends.threads import ThreadCommunicator, ThreadGroup
from gradcomm.hooks._control import CONTROL_LABEL
from gradcomm.profiler import OpRecord, Profiler, bus_factor, profile

from tests._support.dist_utils import run_mpi, run_processes


def _workload(comm: gradcomm.Communicator, prof: Profiler) -> None:
    """Step 0: two labelled all-reduces (one async, one non-contiguous AVG); step 1: the rest."""
    a = torch.full((1000,), float(comm.rank + 1))
    comm.all_reduce(a, label="bucket 0")
    b = torch.ones(8, 4, dtype=torch.float64).t()  # non-contiguous
    work = comm.all_reduce(b, op="avg", async_op=True, label="bucket 1")
    work.wait()
    prof.step()
    out = torch.zeros(comm.world_size * 6, dtype=torch.int32)
    comm.all_gather(out, torch.full((6,), comm.rank, dtype=torch.int32))
    comm.broadcast(torch.ones(3, dtype=torch.bfloat16), src=0)
    comm.barrier()
    n = comm.world_size
    assert torch.equal(a, torch.full((1000,), float(n * (n + 1) // 2)))
    assert torch.equal(b, torch.ones(4, 8, dtype=torch.float64))


def _check_records(records: list[OpRecord], rank: int, n: int, backend: str) -> None:
    got = [(r.op, r.bytes, r.count, r.dtype, r.label, r.step, r.async_op) for r in records]
    assert got == [
        ("all_reduce", 4000, 1000, "float32", "bucket 0", 0, False),
        ("all_reduce", 256, 32, "float64", "bucket 1", 0, True),
        ("all_gather", n * 6 * 4, n * 6, "int32", None, 1, False),  # nccl-tests: whole output
        ("broadcast", 6, 3, "bfloat16", None, 1, False),
        ("barrier", 0, 0, "", None, 1, False),
    ]
    for r in records:
        assert (r.rank, r.world_size, r.backend) == (rank, n, backend)
        assert r.duration > 0 and r.start >= 0
    starts = [r.start for r in records]
    assert starts == sorted(starts)


def _run_threads(n: int) -> list[Any]:
    def body(comm: ThreadCommunicator) -> Profiler:
        assert comm.profiler is None  # off by default
        with profile(comm) as prof:
            assert comm.profiler is prof
            _workload(comm, prof)
        assert comm.profiler is None
        comm.all_reduce(torch.ones(4))  # after the block: not recorded
        return prof

    return ThreadGroup(n).run(body)


def test_records_on_threads() -> None:
    for rank, prof in enumerate(_run_threads(3)):
        _check_records(prof.records, rank, 3, "threads")


def test_bus_factor_is_nccl_tests_definition() -> None:
    assert bus_factor("all_reduce", 4) == pytest.approx(2 * 3 / 4)
    assert bus_factor("all_gather", 4) == pytest.approx(3 / 4)
    assert bus_factor("broadcast", 4) == 1.0
    assert bus_factor("all_reduce", 1) == 0.0
    for op in ("reduce_scatter", "all_to_all", "gather", "scatter"):
        assert bus_factor(op, 4) == pytest.approx(3 / 4)
    assert bus_factor("reduce", 4) == 1.0
    with pytest.raises(ValueError, match="unknown collective"):
        bus_factor("reduce_gather", 2)
    with pytest.raises(ValueError, match="world_size"):
        bus_factor("all_reduce", 0)


def test_summary_math() -> None:
    prof = _run_threads(3)[1]
    recs = prof.records
    step0, step1 = prof.steps()
    assert (step0.step, step1.step) == (0, 1)
    (ar,) = step0.ops
    ar_recs = [r for r in recs if r.op == "all_reduce"]
    t = sum(r.duration for r in ar_recs)
    assert (ar.op, ar.calls, ar.bytes) == ("all_reduce", 2, 4256)
    assert ar.time == pytest.approx(t)
    assert ar.algbw == pytest.approx(4256 / t / 1e9)
    assert ar.busbw == pytest.approx(ar.algbw * 2 * 2 / 3)
    assert [o.op for o in step1.ops] == ["all_gather", "broadcast", "barrier"]
    gather = step1.ops[0]
    assert gather.busbw == pytest.approx(gather.algbw * 2 / 3)
    assert step1.ops[1].busbw == pytest.approx(step1.ops[1].algbw)
    total = prof.summary()
    assert total.step is None and total.total.calls == 5
    assert total.total.bytes == sum(r.bytes for r in recs)
    t_all = sum(r.duration for r in recs)
    assert total.total.busbw == pytest.approx(
        sum(r.bytes * bus_factor(r.op, 3) for r in recs) / t_all / 1e9)
    assert total.wall >= max(r.duration for r in recs)
    table = prof.table(0)
    assert "all_reduce" in table and "busbw(GB/s)" in table and "broadcast" not in table


def _check_trace(trace: dict[str, Any], records: list[OpRecord], rank: int) -> None:
    trace = json.loads(json.dumps(trace))  # valid JSON
    events = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert len(events) == len(records)
    assert [e["name"] for e in events] == [
        "all_reduce bucket 0", "all_reduce bucket 1", "all_gather", "broadcast", "barrier"]
    for e, r in zip(events, records, strict=True):
        assert e["pid"] == rank
        assert e["dur"] == pytest.approx(r.duration * 1e6)
        assert e["args"]["bytes"] == r.bytes
    lanes: dict[int, list[tuple[float, float]]] = {}
    for e in events:
        lanes.setdefault(e["tid"], []).append((e["ts"], e["ts"] + e["dur"]))
    for spans in lanes.values():  # no overlap within a lane
        assert all(a[1] <= b[0] + 1e-3 for a, b in itertools.pairwise(spans))
    assert trace["otherData"]["rank"] == rank


def test_chrome_trace_threads(tmp_path: Path) -> None:
    prof = _run_threads(2)[1]
    _check_trace(prof.chrome_trace(), prof.records, 1)
    path = prof.export_chrome_trace(tmp_path / "sub" / "t-{rank}.json")
    assert path == tmp_path / "sub" / "t-1.json"
    _check_trace(json.loads(path.read_text()), prof.records, 1)


def test_world_size_one_records_nothing_and_bad_env() -> None:
    comm = gradcomm.init("gloo", rank=0, world_size=1)
    with comm, profile(comm) as prof:
        comm.all_reduce(torch.ones(3))
    assert prof.records == []
    with pytest.raises(ValueError, match="GRADCOMM_PROFILE"):
        gradcomm.init("gloo", rank=0, world_size=1, env={"GRADCOMM_PROFILE": "maybe"})
    with pytest.raises(TypeError):
        profile(object()).__enter__()  # type: ignore[arg-type]


# ----------------------------------------------------------------------------- real gloo
def _gloo_context_manager(rank: int, world_size: int, trace_dir: str) -> list[OpRecord]:
    with gradcomm.init("gloo", timeout=60) as comm:
        assert comm.profiler is None  # GRADCOMM_PROFILE unset: off
        with profile(comm, trace_path=os.path.join(trace_dir, "cm-{rank}.json")) as prof:
            _workload(comm, prof)
        return prof.records


@pytest.mark.slow
@pytest.mark.multiprocess
def test_gloo_two_processes(tmp_path: Path) -> None:
    results = run_processes(_gloo_context_manager, 2, str(tmp_path), timeout=90,
                            env={"GRADCOMM_PROFILE": "0"})
    for rank, records in enumerate(results):
        _check_records(records, rank, 2, "gloo")
        trace = json.loads((tmp_path / f"cm-{rank}.json").read_text())
        _check_trace(trace, records, rank)


def _gloo_env(rank: int, world_size: int) -> str:
    comm = gradcomm.init("gloo", timeout=60)
    assert isinstance(comm.profiler, Profiler)
    comm.all_reduce(torch.ones(16), label="bucket 0")
    comm.all_reduce(torch.ones(16), label="bucket 1")
    comm.close()
    path = comm.profiler.trace_file
    assert path is not None
    return str(path)


@pytest.mark.slow
@pytest.mark.multiprocess
def test_gloo_env_writes_trace_per_rank_at_close(tmp_path: Path) -> None:
    paths = run_processes(_gloo_env, 2, timeout=90, env={
        "GRADCOMM_PROFILE": "1", "GRADCOMM_PROFILE_DIR": str(tmp_path)})
    assert paths == [str(tmp_path / "gradcomm-trace-rank0.json"),
                     str(tmp_path / "gradcomm-trace-rank1.json")]
    for rank, path in enumerate(paths):
        trace = json.loads(Path(path).read_text())
        events = [e for e in trace["traceEvents"] if e["ph"] == "X"]
        assert [(e["name"], e["args"]["bytes"], e["pid"]) for e in events] == [
            ("all_reduce bucket 0", 64, rank), ("all_reduce bucket 1", 64, rank)]
        assert trace["otherData"]["summary"]["total"]["calls"] == 2


# ----------------------------------------------------------------------------- real MPI
_MPI_SCRIPT = """
import json, sys
import torch
import gradcomm
from gradcomm.profiler import profile

with gradcomm.init("mpi", timeout=60) as comm, profile(comm) as prof:
    comm.all_reduce(torch.ones(256), label="bucket 0")
    comm.all_reduce(torch.ones(8, dtype=torch.float64), async_op=True, label="bucket 1").wait()
    out = torch.zeros(2 * comm.world_size)
    comm.all_gather(out, torch.ones(2))
trace = prof.chrome_trace()
rows = [[e["name"], e["args"]["bytes"], e["args"]["dtype"], e["pid"]]
        for e in trace["traceEvents"] if e["ph"] == "X"]
with open(sys.argv[1].replace("RANK", str(comm.rank)), "w") as f:
    json.dump({"rows": rows, "backend": prof.backend}, f)
"""


@pytest.mark.slow
@pytest.mark.mpi
def test_mpi_backend_under_mpiexec(tmp_path: Path) -> None:
    script = tmp_path / "profile_mpi.py"
    script.write_text(_MPI_SCRIPT)
    run_mpi(script, 2, [str(tmp_path / "out-RANK.json")], timeout=90)
    for rank in range(2):
        got = json.loads((tmp_path / f"out-{rank}.json").read_text())
        assert got["backend"] == "mpi"
        assert got["rows"] == [["all_reduce bucket 0", 1024, "float32", rank],
                               ["all_reduce bucket 1", 64, "float64", rank],
                               ["all_gather", 16, "float32", rank]]


def _reducer_two_steps(comm: ThreadCommunicator,
                       hook: str = "allreduce") -> list[tuple[int | None, str | None]]:
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
    reducer = gradcomm.GradientReducer(model, comm, bucket_cap_mb=1e-5, first_bucket_cap_mb=1e-5,
                                       comm_hook=hook)
    model(torch.randn(5, 4)).sum().backward()  # the first backward also checks the comm hook
    with profile(comm) as prof:
        for _ in range(2):
            model(torch.randn(5, 4) * (comm.rank + 1)).sum().backward()
    reducer.remove()
    return [(r.step, r.label) for r in prof.records]


def test_reducer_marks_one_profiler_step_per_backward() -> None:
    results = ThreadGroup(2).run(_reducer_two_steps)
    for records in results:
        assert isinstance(records, list)
        steps = [step for step, _ in records]
        per_step = len(records) // 2
        assert per_step >= 3  # the tiny cap gives one bucket per parameter
        assert steps == [0] * per_step + [1] * per_step
        for step in (0, 1):
            labels = [label for s, label in records if s == step]
            # Every bucket; the last one carries the reducer's control values (presence flags,
            # failures): no control all-reduce of its own.
            assert all(label is not None and label.startswith("bucket") for label in labels)
            assert all("control" not in label for label in labels[:-1])
            assert labels[-1].endswith("with the control values")
            assert CONTROL_LABEL not in labels


def test_reducer_sends_the_control_tensor_alone_through_another_hook_or_past_2_ranks() -> None:
    # A comm hook sees only gradients: the control values get an all-reduce of their own; so
    # they do at 3 ranks, where a longer bucket could regroup the gradients' additions.
    results = ThreadGroup(2).run(lambda comm: _reducer_two_steps(comm, "fp16_compress"))
    results += ThreadGroup(3).run(_reducer_two_steps)
    for records in results:
        assert isinstance(records, list)
        labels = [label for step, label in records if step == 0]
        assert labels[-1] == CONTROL_LABEL
        assert all("control" not in (label or "") for label in labels[:-1])

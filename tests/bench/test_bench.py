"""Tests of gradcomm.bench: formulas, size sweeps, writers, plot, and tiny real sweeps (no timing
assertions: only that the output has nccl-tests' columns with positive, finite values)."""

from __future__ import annotations

import csv
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from gradcomm.bench import (
    SweepResult,
    SweepRow,
    algbw,
    busbw,
    busbw_factor,
    format_table,
    parse_dtype,
    parse_size,
    read_json,
    run_sweep,
    size_sweep,
    write_csv,
    write_json,
)
from gradcomm.bench.__main__ import main

from tests._support.dist_utils import (
    REPO_ROOT,
    benchmark_module,
    child_env,
    run_mpi,
    run_processes,
)

MiB = 1024**2


def _row(size: int = 1024, **kw: object) -> SweepRow:
    fields: dict[str, object] = dict(
        backend="gloo", transport="torch.distributed (gloo)", size=size, count=size // 4,
        type="float32", redop="sum", world_size=2, time_us=100.0, algbw=size / 1e9 / 1e-4,
        busbw=size / 1e9 / 1e-4, raw_time_us=80.0, raw_algbw=1.0, raw_busbw=1.0, wrong=0,
    )
    fields.update(kw)
    return SweepRow(**fields)  # type: ignore[arg-type]


# ----------------------------------------------------------------------------- formulas
@pytest.mark.parametrize("n", [1, 2, 3, 4, 8, 64])
def test_busbw_is_nccl_tests_definition(n: int) -> None:
    # nccl-tests doc/PERFORMANCE.md: algbw = S / t; all-reduce busbw = algbw * 2 (n - 1) / n.
    size, seconds = 3 * MiB, 1.5e-3
    assert algbw(size, seconds) == pytest.approx(size / seconds / 1e9, rel=1e-15)
    assert busbw(size, seconds, n) == pytest.approx(size / seconds / 1e9 * 2 * (n - 1) / n)
    assert busbw_factor(n) == pytest.approx(2 * (n - 1) / n)


def test_busbw_known_values() -> None:
    assert algbw(10**9, 1.0) == 1.0  # 1e9 bytes in one second is 1 GB/s (decimal GB)
    assert busbw(10**9, 1.0, 1) == 0.0  # one rank moves nothing
    assert busbw(10**9, 1.0, 2) == 1.0  # two ranks: busbw equals algbw
    assert busbw(10**9, 1.0, 8) == 1.75


@pytest.mark.parametrize("seconds", [0.0, -1.0, math.inf, math.nan])
def test_algbw_rejects_bad_time(seconds: float) -> None:
    with pytest.raises(ValueError, match="seconds"):
        algbw(8, seconds)


def test_busbw_factor_rejects_bad_world_size() -> None:
    with pytest.raises(ValueError, match="world_size"):
        busbw_factor(0)
    with pytest.raises(TypeError):
        busbw_factor(2.0)  # type: ignore[arg-type]


# ----------------------------------------------------------------------------- sizes and names
def test_default_sweep_is_powers_of_two_from_8_bytes() -> None:
    sizes = size_sweep(8, 64 * MiB, 2)
    assert sizes == [8 * 2**k for k in range(24)]
    assert sizes[-1] == 64 * MiB
    assert size_sweep(8, 256 * MiB, 2)[-1] == 256 * MiB


def test_sweep_rounds_to_whole_elements() -> None:
    assert size_sweep(2, 32, 2, element_size=4) == [4, 8, 16, 32]  # 2 B holds no float32
    assert size_sweep(10, 100, 3, element_size=8) == [8, 24, 88]  # 10, 30, 90 rounded down
    assert size_sweep(1, 3, 2, element_size=8) == []
    assert size_sweep(8, 8, 2) == [8]


@pytest.mark.parametrize(
    ("minb", "maxb", "factor", "match"),
    [(0, 8, 2, "minbytes"), (16, 8, 2, "maxbytes"), (8, 64, 1, "stepfactor")],
)
def test_sweep_rejects_bad_bounds(minb: int, maxb: int, factor: float, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        size_sweep(minb, maxb, factor)


def test_parse_size_accepts_nccl_tests_suffixes() -> None:
    assert parse_size("8") == 8
    assert parse_size("64K") == 64 * 1024
    assert parse_size("64M") == 64 * MiB
    assert parse_size("256MiB") == 256 * MiB
    assert parse_size("1g") == 1024**3
    for bad in ("", "1.5M", "-8", "12Q"):
        with pytest.raises(ValueError):
            parse_size(bad)


def test_parse_dtype_names() -> None:
    assert parse_dtype("float") is torch.float32
    assert parse_dtype("half") is torch.float16
    assert parse_dtype("torch.bfloat16") is torch.bfloat16
    with pytest.raises(ValueError, match="known"):
        parse_dtype("complex32")


# ----------------------------------------------------------------------------- writers
def test_json_round_trip(tmp_path: Path) -> None:
    rows = [_row(8, raw_time_us=None, raw_algbw=None, raw_busbw=None), _row(4096)]
    write_json(SweepResult({"world_size": 2}, rows), tmp_path / "r.json")
    back = read_json(tmp_path / "r.json")
    assert back.rows == rows
    assert back.meta == {"world_size": 2}
    doc = json.loads((tmp_path / "r.json").read_text())
    assert doc["rows"][1]["overhead_us"] == pytest.approx(20.0)
    assert doc["rows"][1]["overhead_ratio"] == pytest.approx(1.25)
    assert doc["rows"][0]["overhead_us"] is None


def test_read_json_rejects_other_files(tmp_path: Path) -> None:
    (tmp_path / "x.json").write_text('{"results": []}')
    with pytest.raises(ValueError, match="rows"):
        read_json(tmp_path / "x.json")
    (tmp_path / "y.json").write_text('{"rows": [{"size": 8}]}')
    with pytest.raises(ValueError, match="lacks"):
        read_json(tmp_path / "y.json")


def test_csv_has_one_line_per_row(tmp_path: Path) -> None:
    rows = [_row(8, raw_time_us=None, raw_algbw=None, raw_busbw=None), _row(1024)]
    write_csv(rows, tmp_path / "r.csv")
    with open(tmp_path / "r.csv", newline="") as fh:
        got = list(csv.DictReader(fh))
    assert [int(r["size"]) for r in got] == [8, 1024]
    assert got[0]["raw_time_us"] == ""
    assert float(got[1]["time_us"]) == 100.0
    for column in ("size", "count", "type", "redop", "time_us", "algbw", "busbw"):
        assert column in got[0]


def test_table_has_nccl_tests_columns() -> None:
    lines = format_table([_row(8), _row(16)])
    header = " ".join(lines[:3])
    for word in ("size", "count", "type", "redop", "time", "algbw", "busbw", "#wrong", "(GB/s)"):
        assert word in header
    assert lines[3].split()[:4] == ["8", "2", "float32", "sum"]
    assert len(lines) == 5


# ----------------------------------------------------------------------------- command line
def test_json_files_without_plot_is_a_usage_error(tmp_path: Path) -> None:
    with pytest.raises(SystemExit) as info:
        main([str(tmp_path / "r.json")])
    assert info.value.code == 2


@pytest.mark.parametrize(
    "args", [["-d", "complex64"], ["-o", "mean"], ["--backend", "nosuch"], ["-b", "1Q"],
             ["-b", "64", "-e", "8"], ["-f", "1"], ["-n", "0"], ["--device", "nosuch"],
             ["--device", "meta"], ["-d", "int32", "-o", "avg"], ["--timeout", "0"],
             ["-f", "nan"], ["-f", "inf"], ["--json", "/nonexistent/dir/r.json"],
             ["--csv", "/nonexistent/dir/r.csv"], ["--backend", "gloo", "--device", "cuda"],
             ["--json", "/tmp"],
             pytest.param(["--backend", "nccl"], marks=pytest.mark.skipif(
                 torch.cuda.is_available(), reason="nccl is usable where CUDA is"))],
)
def test_bad_options_are_usage_errors(args: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        main(args)
    assert info.value.code == 2
    assert "error:" in capsys.readouterr().err


class _InitCalled(Exception):
    pass


@pytest.mark.parametrize(("args", "device"), [([], None), (["--device", "cuda"], "cuda"),
                                                (["--device", "cuda:1"], "cuda:1"),
                                                (["--device", "cpu"], "cpu")])
def test_device_is_passed_to_init(
    args: list[str], device: str | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    import gradcomm.comm

    seen: list[dict[str, object]] = []

    def fake_init(backend: str, **kw: object) -> None:
        seen.append({"backend": backend, **kw})
        raise _InitCalled

    monkeypatch.setattr(gradcomm.comm, "init", fake_init)
    with pytest.raises(_InitCalled):
        main(["--backend", "gloo", *args])
    assert seen == [{"backend": "gloo", "timeout": 300.0, "device": device}]


def _device_rank(rank: int, world_size: int, out: str, device: str) -> int:
    return main(["-b", "8", "-e", "16", "-n", "1", "-w", "0", "-r", "1", "--backend", "gloo",
                 "--device", device, "--json", out, "--timeout", "60"])


@pytest.mark.slow
@pytest.mark.multiprocess
def test_device_cpu_sweep_records_device(tmp_path: Path) -> None:
    out = tmp_path / "cpu.json"
    assert run_processes(_device_rank, 1, str(out), "cpu", timeout=60) == [0]
    result = read_json(out)
    assert result.meta["device"] == "cpu" and result.meta["devices"] == {"gloo": "cpu"}
    assert [r.wrong for r in result.rows] == [0, 0]


@pytest.mark.slow
@pytest.mark.multiprocess
def test_device_the_backend_cannot_use_is_an_error(tmp_path: Path) -> None:
    # gloo works on the CPU only: --device cuda must fail clearly, not silently use the CPU.
    got = run_processes(_device_rank, 1, str(tmp_path / "x.json"), "cuda", timeout=60,
                        expect_errors=True)
    assert got[0][0] == "error", got
    assert "ValueError" in got[0][1] and "not cuda" in got[0][1], got


def test_plot_without_matplotlib_names_pip(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    write_json(SweepResult({}, [_row(8)]), tmp_path / "r.json")
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)  # import raises ImportError
    for args in (["--plot", str(tmp_path / "p.png"), str(tmp_path / "r.json")],  # plot only
                 ["--plot", str(tmp_path / "p.png"), "--backend", "gloo"]):  # sweep, then plot
        with pytest.raises(SystemExit) as info:
            main(args)
        assert info.value.code == 2
        assert "pip install matplotlib" in capsys.readouterr().err


def test_plot_from_json_files(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib", reason="the plot needs matplotlib (pip install matplotlib)")
    write_json(SweepResult({}, [_row(8), _row(1024)]), tmp_path / "a.json")
    write_json(SweepResult({}, [_row(8, backend="mpi", transport="mpi4py")]), tmp_path / "b.json")
    out = tmp_path / "p.png"
    assert main(["--plot", str(out), str(tmp_path / "a.json"), str(tmp_path / "b.json")]) == 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


# ----------------------------------------------------------------------------- real sweeps
def _git_head() -> str | None:
    done = subprocess.run(["git", "-C", str(REPO_ROOT), "rev-parse", "HEAD"], capture_output=True,
                          text=True, check=False)
    return done.stdout.strip() if done.returncode == 0 else None


def check_provenance(meta: dict[str, object], *, mpi_loaded: bool) -> None:
    """What every benchmark result must record (``gradcomm.bench.results.run_metadata``)."""
    assert meta["commit"] == _git_head()
    assert meta["dirty"] in ((True, False) if meta["commit"] else (None,))
    machine = meta["machine"]
    assert isinstance(machine, dict) and machine["cores"] == os.cpu_count()
    assert isinstance(machine["cpu"], str) and machine["cpu"]
    assert meta["torch"] == torch.__version__ and meta["python"]
    assert isinstance(meta["date_utc"], str) and meta["date_utc"].endswith("+00:00")
    mpi = meta["mpi"]
    assert isinstance(mpi, dict)
    if mpi_loaded:
        assert isinstance(mpi["library"], str) and mpi["library"], mpi
        assert mpi["mpi4py"]


def _check_rows(path: Path, backend: str, world_size: int) -> None:
    result = read_json(path)
    assert result.meta["world_size"] == world_size
    check_provenance(result.meta, mpi_loaded=backend == "mpi")
    rows = [r for r in result.rows if r.backend == backend]
    assert [r.size for r in rows] == [8, 16, 32, 64, 128, 256, 512, 1024]
    for r in rows:
        assert r.count == r.size // 4 and r.type == "float32" and r.redop == "sum"
        assert r.wrong == 0
        for value in (r.time_us, r.algbw, r.busbw, r.raw_time_us, r.raw_algbw, r.raw_busbw):
            assert value is not None and math.isfinite(value) and value > 0
        # busbw is derived from the reported time by nccl-tests' formula.
        assert r.busbw == pytest.approx(busbw(r.size, r.time_us * 1e-6, world_size))


def _sweep_rank(rank: int, world_size: int, out: str) -> int:
    return main(["-b", "8", "-e", "1K", "-n", "2", "-w", "1", "-r", "2", "--backend", "gloo",
                 "--json", out, "--timeout", "60", "--stat", "call-median"])


@pytest.mark.parametrize("op", ["sum", "avg", "min", "max", "product"])
def test_sweep_on_thread_ranks_checks_values(op: str) -> None:
    from gradcomm.comm.backends.threads import ThreadGroup

    def body(comm: object) -> list[SweepRow]:
        return run_sweep(comm, [4, 64], torch.float32, op, iters=2, warmup=1,  # type: ignore[arg-type]
                         repeats=2, stat="min")

    for rows in ThreadGroup(3, timeout=30).run(body):
        assert isinstance(rows, list)
        got = [(r.size, r.count, r.wrong, r.world_size) for r in rows]
        assert got == [(4, 1, 0, 3), (64, 16, 0, 3)]
        assert all(r.raw_time_us is None and r.time_us > 0 for r in rows)


def test_sweep_rejects_bad_arguments_before_any_collective() -> None:
    from gradcomm.comm.backends.threads import ThreadGroup

    comm = ThreadGroup(2).communicator(0)  # rank 1 never runs: a collective would time out
    with pytest.raises(ValueError, match="stat"):
        run_sweep(comm, [4], torch.float32, stat="mean")
    with pytest.raises(ValueError, match="multiple"):
        run_sweep(comm, [6], torch.float32)
    with pytest.raises(ValueError, match="iters"):
        run_sweep(comm, [4], torch.float32, iters=0)
    comm.close()


@pytest.mark.slow
@pytest.mark.multiprocess
def test_tiny_gloo_sweep_two_ranks(tmp_path: Path) -> None:
    out = tmp_path / "gloo.json"
    assert run_processes(_sweep_rank, 2, str(out), timeout=90) == [0, 0]
    _check_rows(out, "gloo", 2)


@pytest.mark.slow
@pytest.mark.mpi
def test_tiny_mpi_sweep_under_mpiexec(tmp_path: Path) -> None:
    pytest.importorskip("gradcomm.comm.backends.mpi", reason="the mpi backend is not in this tree")
    out = tmp_path / "mpi.json"
    proc = run_mpi("-m", 2, ["gradcomm.bench", "-b", "8", "-e", "1K", "-n", "2", "-w", "1",
                             "-r", "2", "--backend", "mpi", "--json", str(out)],
                   timeout=90)
    assert "busbw" in proc.stdout
    _check_rows(out, "mpi", 2)


# ----------------------------------------------------------------------------- step_time helpers
def _step_time_module() -> object:
    return benchmark_module("step_time")


def test_rotations_put_every_variant_first_in_turn() -> None:
    st = _step_time_module()
    orders = list(st.rotations(["a", "b", "c"], 4))  # type: ignore[attr-defined]
    assert orders == [["a", "b", "c"], ["b", "c", "a"], ["c", "a", "b"], ["a", "b", "c"]]


def test_old_algorithm_averages_once_after_backward() -> None:
    # A fake 2-rank sum (the other rank holds the same gradient): the average equals the local
    # gradient, and the flush runs exactly once per backward, after every gradient exists.
    st = _step_time_module()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
    reference = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
    reference.load_state_dict(model.state_dict())
    calls: list[int] = []

    def fake_sum(flat: torch.Tensor) -> None:
        calls.append(flat.numel())
        flat.mul_(2)

    st.OldAlgorithm(model, fake_sum, world_size=2)  # type: ignore[attr-defined]
    x = torch.randn(5, 4)
    for _ in range(2):
        model.zero_grad()
        reference.zero_grad()
        model(x).square().sum().backward()
        reference(x).square().sum().backward()
    assert calls == [sum(p.numel() for p in model.parameters())] * 2
    for p, q in zip(model.parameters(), reference.parameters(), strict=True):
        assert p.grad is not None and q.grad is not None
        torch.testing.assert_close(p.grad, q.grad, rtol=0, atol=0)


@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc/self/statm").exists(), reason="needs Linux /proc")
def test_retain_freed_memory_keeps_freed_pages_in_the_process() -> None:
    # In a child process (mallopt changes the whole process): free a 20 MiB tensor and see
    # whether its pages leave the process. glibc's defaults hand them back to the kernel at once
    # (a later step would fault them in again); the benchmark's setting keeps them.
    script = (
        "import os, sys, torch\n"
        f"sys.path.insert(0, {str(REPO_ROOT / 'benchmarks')!r})\n"
        "import step_time\n"
        "ok = step_time.retain_freed_memory() if sys.argv[1] == 'retain' else True\n"
        "def resident():\n"
        "    return int(open('/proc/self/statm').read().split()[1]) * os.sysconf('SC_PAGE_SIZE')\n"
        "x = torch.ones(5 * 2**20)\n"
        "before = resident()\n"
        "del x\n"
        "print('RESULT', ok, (before - resident()) // 2**20)\n"
    )
    released = {}
    for mode in ("retain", "glibc"):
        proc = subprocess.run([sys.executable, "-c", script, mode], capture_output=True,
                              text=True, timeout=60, env={**os.environ, "OMP_NUM_THREADS": "1"})
        assert proc.returncode == 0, proc.stderr
        ok, mib = proc.stdout.split("RESULT ")[1].split()
        assert ok == "True"
        released[mode] = int(mib)
    assert released["retain"] < 2 and released["glibc"] >= 18, released


@pytest.mark.parametrize("argv", [
    ["--models", ""], ["--models", ","], ["--models", "mlp,bogus"], ["--variants", "ddp,foo"],
    ["--first-bucket-cap-mb", "0"], ["--bucket-cap-mb", "-1"], ["--steps", "10"],
    ["--in-place-min-mb", "-1"], ["--in-place-min-mb", "nan"], ["--in-place-min-mb", "big"],
])
def test_step_time_rejects_bad_arguments_before_starting(argv: list[str]) -> None:
    st = _step_time_module()
    with pytest.raises(SystemExit) as info:
        st.parse_args(argv)  # type: ignore[attr-defined]
    assert info.value.code == 2


@pytest.mark.parametrize(("text", "want"), [("auto", None), ("inf", math.inf), ("0", 0.0),
                                            ("2.5", 2.5)])
def test_step_time_in_place_min_mb_values(text: str, want: float | None) -> None:
    st = _step_time_module()
    assert st.parse_args(["--in-place-min-mb", text]).in_place_min_mb == want  # type: ignore[attr-defined]


@pytest.mark.slow
@pytest.mark.mpi
@pytest.mark.parametrize("backend", ["gloo", "mpi"])
def test_call_overhead_script_runs_under_mpiexec(backend: str, tmp_path: Path) -> None:
    out = tmp_path / "co.json"
    proc = run_mpi(REPO_ROOT / "benchmarks" / "call_overhead.py", 2,
                   ["--backend", backend, "--bytes", "8", "4096", "--seconds", "0.01",
                    *(["--op", "all_reduce", "reduce_scatter"] if backend == "mpi" else []),
                    "--json", str(out)],
                   timeout=120)
    doc = json.loads(out.read_text())
    assert doc["meta"]["world_size"] == 2 and doc["meta"]["backend"] == backend
    check_provenance(doc["meta"], mpi_loaded=True)
    ops = ["all_reduce"] if backend == "gloo" else ["all_reduce", "reduce_scatter"]
    assert [(r["op"], r["bytes"]) for r in doc["overhead"]] == [
        (op, n) for op in ops for n in (8, 4096)]
    for r in doc["overhead"]:
        assert r["calls"] >= 30 and r["comm_us"] > 0 and r["baseline_us"] > 0, r
        assert math.isclose(r["diff_us"], r["comm_us"] - r["baseline_us"])
        assert math.isclose(r["ratio"], r["comm_us"] / r["baseline_us"])
        if backend == "mpi":  # the bare hand-off to a thread, and its ratio to mpi4py's call
            assert r["handoff_us"] > 0 and math.isclose(r["floor"],
                                                        r["handoff_us"] / r["baseline_us"]), r
        else:
            assert "handoff_us" not in r, r
    shown = subprocess.run([sys.executable, str(REPO_ROOT / "benchmarks" / "report.py"), str(out)],
                           capture_output=True, text=True, timeout=60, check=True).stdout
    first = doc["overhead"][0]
    assert f"| all_reduce | 8 | {first['calls']} | {first['comm_us']:.1f} |" in shown
    assert ("| floor | comm - handoff us |" in shown) == (backend == "mpi"), shown
    assert len([ln for ln in proc.stdout.splitlines() if ln.split()[:1] in (["all_reduce"],
                ["reduce_scatter"])]) == len(doc["overhead"]), proc.stdout


@pytest.mark.slow
@pytest.mark.mpi
@pytest.mark.parametrize("backend", ["gloo", "mpi"])
def test_step_breakdown_times_the_reducer_hooks_inside_backward(backend: str,
                                                                tmp_path: Path) -> None:
    out = tmp_path / "bd.json"
    proc = run_mpi(REPO_ROOT / "benchmarks" / "step_breakdown.py", 2,
                   ["--model", "conv", "--backend", backend, "--steps", "10", "--warmup", "1",
                    "--out", str(out)], timeout=240)
    doc = json.loads(out.read_text())
    assert doc["meta"]["world_size"] == 2 and doc["meta"]["backend"] == backend
    check_provenance(doc["meta"], mpi_loaded=True)
    job = doc["median_ms"]
    assert set(job) == {"local", f"old+{backend}", f"gradcomm+{backend}"}
    for name, phases in job.items():
        assert all(math.isfinite(ms) and ms >= 0 for ms in phases.values()), (name, phases)
        assert 0 < phases["forward"] < phases["step"] and 0 < phases["backward"] < phases["step"]
        # Only gradcomm's reducer has post-accumulate-grad hooks to bracket.
        assert (phases["hooks"] > 0) == name.startswith("gradcomm+"), (name, phases)
    gc = job[f"gradcomm+{backend}"]
    assert gc["hooks"] < gc["backward"]
    rows = {ln.split("|")[1].strip() for ln in proc.stdout.splitlines()
            if ln.startswith("| ") and "---" not in ln}
    assert rows == {"variant", *job}, proc.stdout
    shown = subprocess.run([sys.executable, str(REPO_ROOT / "benchmarks" / "report.py"), str(out)],
                           capture_output=True, text=True, timeout=60, check=True).stdout
    row = (f"| gradcomm+{backend} | {gc['forward']:.2f} | {gc['backward']:.2f} | "
           f"{gc['hooks']:.2f} |")
    assert row in shown and row in proc.stdout, (shown, proc.stdout)


@pytest.mark.parametrize("argv", [["--steps", "9"], ["--warmup", "-1"], ["--model", "big"],
                                  ["--backend", "nccl"], ["--out", "/"],
                                  ["--out", "/no/such/dir/bd.json"]])
def test_step_breakdown_rejects_bad_arguments_before_starting(argv: list[str]) -> None:
    step_breakdown = benchmark_module("step_breakdown")
    with pytest.raises(SystemExit) as info:
        step_breakdown.parse_args(argv)
    assert info.value.code == 2


@pytest.mark.slow
def test_step_breakdown_refuses_one_process() -> None:
    proc = subprocess.run([sys.executable, str(REPO_ROOT / "benchmarks" / "step_breakdown.py")],
                          capture_output=True, text=True, timeout=120,
                          env=child_env())
    assert proc.returncode == 2 and "mpiexec with 2 or more ranks" in proc.stderr, proc.stderr


@pytest.mark.slow
@pytest.mark.mpi
def test_consistency_overhead_script_runs_under_mpiexec(tmp_path: Path) -> None:
    # it shares call_overhead's timer: a change there must not break it
    out = tmp_path / "check.json"
    run_mpi(REPO_ROOT / "benchmarks" / "consistency_overhead.py", 2,
            ["--sizes", "8", "--calls", "10", "--json", str(out)], timeout=120)
    doc = json.loads(out.read_text())
    rows = doc["check_rows"]
    assert [(r["backend"], r["bytes"]) for r in rows] == [("gloo", 8), ("mpi", 8)]
    for r in rows:
        k = r["kinds"]
        assert set(k) == {"all_reduce off", "all_reduce detail", "all_gather off",
                          "all_gather detail"}, k
        for v in k.values():
            assert v["calls"] == 10 and 0 < v["p25_us"] <= v["median_us"], v
        assert math.isclose(r["detail_ratio"],
                            k["all_reduce detail"]["median_us"] / k["all_reduce off"]["median_us"])
    shown = subprocess.run([sys.executable, str(REPO_ROOT / "benchmarks" / "report.py"), str(out)],
                           capture_output=True, text=True, timeout=60, check=True).stdout
    assert f"| mpi | 8 | {k['all_reduce off']['median_us']:.1f} (" in shown, shown


@pytest.mark.slow
def test_call_overhead_refuses_one_process() -> None:
    # one process: nothing to compare (MPI is initialised to see that, so not in this process)
    proc = subprocess.run([sys.executable, str(REPO_ROOT / "benchmarks" / "call_overhead.py"),
                           "--seconds", "1"], capture_output=True, text=True, timeout=120,
                          env=child_env())
    assert proc.returncode == 2 and "mpiexec with 2 or more ranks" in proc.stderr, proc.stderr


@pytest.mark.parametrize(("argv", "says"), [
    (["--bytes", "6"], "multiple of 4"),  # would send 4 B and call it 6
    (["--seconds", "0"], "--seconds must be > 0 and at most 3600"),
    (["--seconds", "inf"], "--seconds must be > 0 and at most 3600"),  # no number of calls
    (["--seconds", "1e300"], "--seconds must be > 0 and at most 3600"),  # would never end
    (["--json", "/no/such/dir/co.json"], "no folder /no/such/dir"),  # not after the run
    (["--block", "0"], "--block must be >= 1"),
    (["--backend", "gloo", "--op", "broadcast"], "only all_reduce"),  # not timed silently
])
def test_call_overhead_rejects_what_it_cannot_measure(
    argv: list[str], says: str, monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    monkeypatch.setattr(sys, "argv", ["call_overhead.py", *argv])
    with pytest.raises(SystemExit) as info:
        benchmark_module("call_overhead").main()  # refused before MPI is touched
    assert info.value.code == 2 and says in capsys.readouterr().err


def test_plot_keeps_two_runs_of_the_same_sizes_apart(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib", reason="the plot needs matplotlib (pip install matplotlib)")
    from gradcomm.bench.plot import plot_busbw

    small = SweepResult({"date_utc": "2026-11-30T10:00:00+00:00"}, [_row(8), _row(1024)])
    large = SweepResult({"date_utc": "2026-11-30T10:05:00+00:00"}, [_row(1 << 20)])
    again = SweepResult({"date_utc": "2026-11-30T11:00:00+00:00"}, [_row(8), _row(1024)])
    joined = plot_busbw([small, large], tmp_path / "a.png")  # different sizes: one line
    assert [lb for lb in joined if lb.startswith("gradcomm")] == ["gradcomm gloo"]
    third = SweepResult({"date_utc": "2026-11-30T12:00:00+00:00"}, [_row(8)])
    apart = plot_busbw([small, large, again, third], tmp_path / "b.png")
    assert [lb for lb in apart if lb.startswith("gradcomm")] == [
        "gradcomm gloo (2026-11-30T10:00)", "gradcomm gloo (2026-11-30T11:00)",
        "gradcomm gloo (2026-11-30T12:00)"]


def test_report_reads_every_committed_result() -> None:
    files = sorted((REPO_ROOT / "benchmarks" / "results").glob("*.json"))
    assert files
    proc = subprocess.run([sys.executable, str(REPO_ROOT / "benchmarks" / "report.py"),
                           *map(str, files)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.count("### ") == len(files)


# ----------------------------------------------------------------------------- provenance
def test_run_metadata_records_commit_machine_and_versions(monkeypatch: pytest.MonkeyPatch) -> None:
    from gradcomm.bench.results import NOTE_ENV, run_metadata

    monkeypatch.setenv(NOTE_ENV, "machine shared with CI")
    meta = run_metadata(["mpiexec", "-n", "2", "python", "x.py"])
    check_provenance(meta, mpi_loaded=False)
    assert meta["command"] == "mpiexec -n 2 python x.py"
    assert meta["note"] == "machine shared with CI"
    assert len(meta["loadavg_start"]) == 3
    json.dumps(meta)  # a result file holds it as JSON
    monkeypatch.delenv(NOTE_ENV)
    assert run_metadata()["note"] is None


def test_run_metadata_does_not_start_mpi_and_reports_it_once_loaded() -> None:
    code = ("import sys, json\n"
            "from gradcomm.bench.results import run_metadata\n"
            "before = run_metadata()['mpi']\n"
            "assert 'mpi4py.MPI' not in sys.modules, 'run_metadata imported mpi4py.MPI'\n"
            "from mpi4py import MPI\n"
            "print(json.dumps([before, run_metadata()['mpi']]))\n")
    pytest.importorskip("mpi4py", reason="mpi4py is not installed (pip install mpi4py mpich)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                         check=True).stdout
    before, after = json.loads(out)
    assert before["library"] is None and before["mpi4py"]
    assert isinstance(after["library"], str) and after["library"]


def test_run_metadata_outside_a_checkout_records_no_commit(monkeypatch: pytest.MonkeyPatch,
                                                           tmp_path: Path) -> None:
    from gradcomm.bench import results

    monkeypatch.setattr(results, "_REPO", tmp_path)  # a copy of the package outside git
    meta = results.run_metadata()
    assert meta["commit"] is None and meta["dirty"] is None



def test_docs_results_page_is_generated_from_the_baselines() -> None:
    proc = subprocess.run([sys.executable, str(REPO_ROOT / "benchmarks" / "report.py"), "--docs",
                           str(REPO_ROOT / "docs" / "results.md"), "--check"],
                          capture_output=True, text=True, timeout=60, check=False)
    assert proc.returncode == 0, proc.stderr
    names = {p.name for p in (REPO_ROOT / "benchmarks" / "results").iterdir()}
    assert names == {"step_time.json", "step_breakdown.json", "call_overhead.json",
                     "allreduce.json", "allreduce_busbw.png", "collectives.json", "sendrecv.json",
                     "consistency_overhead.json", "sharded_memory.json", "elastic.json",
                     "torch_backend.json"}
    for name in names - {"allreduce_busbw.png"}:
        meta = json.loads((REPO_ROOT / "benchmarks" / "results" / name).read_text())["meta"]
        for key in ("commit", "dirty", "machine", "torch", "mpi", "date_utc", "command"):
            assert key in meta, (name, key)

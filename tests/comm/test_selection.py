"""Backend selection, timeouts and the registry: argument > GRADCOMM_BACKEND > auto."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import gradcomm
from gradcomm.comm import (
    BackendUnavailableError,
    Communicator,
    Launcher,
    LaunchInfo,
    available_backends,
    register_backend,
    select_backend,
)
from gradcomm.comm.backends.threads import ThreadGroup
from gradcomm.comm.launch import registry
from gradcomm.comm.launch.registry import known_backends
from gradcomm.comm.launch.selection import DEFAULT_TIMEOUT, init, resolve_timeout

from tests._support.dist_utils import REPO_ROOT, run_processes


@pytest.fixture(autouse=True)
def _private_registry(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each test registers into a copy of the registry, so nothing leaks between tests."""
    monkeypatch.setattr(registry, "_REGISTRY", dict(registry._REGISTRY))


# ----------------------------------------------------------------------------- selection order
def test_argument_beats_environment() -> None:
    choice = select_backend("MPI", {"GRADCOMM_BACKEND": "gloo"})
    assert (choice.name, choice.reason) == ("mpi", "the backend argument")


def test_environment_beats_auto() -> None:
    choice = select_backend(None, {"GRADCOMM_BACKEND": " Gloo "})
    assert (choice.name, choice.reason) == ("gloo", "GRADCOMM_BACKEND")


def test_auto_rule_on_this_machine() -> None:
    nccl = available_backends().get("nccl")
    expected = "nccl" if nccl is not None and nccl.available else "gloo"
    assert select_backend(None, {}).name == expected


def test_auto_is_gloo_without_usable_nccl() -> None:
    register_backend("nccl", _unused_factory, check=lambda: BackendUnavailableError("no CUDA"),
                     replace=True)
    assert select_backend(None, {}).name == "gloo"
    assert select_backend(None, {"GRADCOMM_BACKEND": ""}).name == "gloo"


def test_auto_is_nccl_when_usable() -> None:
    register_backend("nccl", _unused_factory, check=lambda: None, replace=True)
    choice = select_backend(None, {})
    assert choice.name == "nccl"
    assert choice.reason.startswith("auto")


def test_names_are_normalised() -> None:
    assert select_backend("CUPY_NCCL", {}).name == "cupy-nccl"
    with pytest.raises(TypeError):
        select_backend(3, {})  # type: ignore[arg-type]


def test_unknown_environment_backend_lists_known_names() -> None:
    with pytest.raises(ValueError, match="unknown gradcomm backend 'nosuch'") as info:
        init(env={"GRADCOMM_BACKEND": "nosuch"})
    for name in known_backends():
        assert name in str(info.value)
    assert "gloo" in str(info.value) and "mpi" in str(info.value)


def test_unknown_argument_backend_raises_value_error() -> None:
    with pytest.raises(ValueError, match=r"known backends: .*gloo"):
        init("glooo", env={})


# ----------------------------------------------------------------------------- timeout
@pytest.mark.parametrize(
    ("timeout", "env", "expected"),
    [
        (None, {}, DEFAULT_TIMEOUT),
        (None, {"GRADCOMM_TIMEOUT": ""}, DEFAULT_TIMEOUT),
        (None, {"GRADCOMM_TIMEOUT": "12.5"}, 12.5),
        (None, {"GRADCOMM_TIMEOUT": " 7 "}, 7.0),
        (3, {"GRADCOMM_TIMEOUT": "12.5"}, 3.0),  # the argument wins
        (0.25, {}, 0.25),
    ],
)
def test_timeout_resolution(timeout: float | None, env: dict[str, str], expected: float) -> None:
    assert resolve_timeout(timeout, env) == expected


@pytest.mark.parametrize("raw", ["abc", "0", "-1", "inf", "nan", "10s"])
def test_bad_environment_timeout(raw: str) -> None:
    with pytest.raises(ValueError, match="GRADCOMM_TIMEOUT"):
        resolve_timeout(None, {"GRADCOMM_TIMEOUT": raw})
    with pytest.raises(ValueError, match="GRADCOMM_TIMEOUT"):
        init("gloo", env={"GRADCOMM_TIMEOUT": raw})


@pytest.mark.parametrize("bad", [0, -2.0, float("inf"), float("nan")])
def test_bad_timeout_argument(bad: float) -> None:
    with pytest.raises(ValueError, match="timeout"):
        resolve_timeout(bad, {})


@pytest.mark.parametrize("huge", [1e9 + 1, 1e13, 8.7e13, 1e300])
def test_timeouts_beyond_the_maximum_are_a_value_error_not_a_crash_in_gloo(huge: float) -> None:
    # 1e13 s made gloo's context raise "Invalid timeout", 8.7e13 s an OverflowError in timedelta
    from gradcomm.comm.launch import selection

    assert selection.MAX_TIMEOUT == 1e9 and resolve_timeout(1e9, {}) == 1e9
    with pytest.raises(ValueError, match=r"at most 1e\+09 seconds"):
        resolve_timeout(huge, {})
    with pytest.raises(ValueError, match="GRADCOMM_TIMEOUT must be at most"):
        init("gloo", env={"GRADCOMM_TIMEOUT": repr(huge)})


def test_numpy_and_huge_int_timeouts() -> None:
    import numpy as np

    assert resolve_timeout(np.float32(5), {}) == 5.0 and resolve_timeout(np.int64(7), {}) == 7.0
    with pytest.raises(ValueError, match="positive, finite"):  # was an OverflowError
        resolve_timeout(10**400, {})


def test_the_largest_timeout_works_on_gloo() -> None:
    with init("gloo", timeout=1e9, env={}) as comm:
        t = torch.ones(3)
        comm.all_reduce(t)
        assert torch.equal(t, torch.ones(3))


@pytest.mark.parametrize("name", ["GRADCOMM_MPI_ABORT_ON_ERROR", "GRADCOMM_MPI_CUDA_AWARE"])
def test_process_switch_typos_raise_at_init_on_any_backend(
    name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # these two are read from os.environ where they apply (the mpi backend, CUDA buffers); a typo
    # used to pass silently on gloo or on the CPU
    monkeypatch.setenv(name, "tru")
    with pytest.raises(ValueError, match=f"{name} must be one of"):
        init("gloo", env={})
    monkeypatch.setenv(name, " OFF ")
    with init("gloo", env={}) as comm:
        assert comm.world_size == 1


def test_profile_dir_that_is_a_file_raises_at_init(tmp_path: Path) -> None:
    # it used to fail only when the trace was written, at close() after training
    afile = tmp_path / "afile"
    afile.write_text("x")
    env = {"GRADCOMM_PROFILE": "1", "GRADCOMM_PROFILE_DIR": str(afile)}
    with pytest.raises(ValueError, match=r"GRADCOMM_PROFILE_DIR=.* is not a directory"):
        init("gloo", env=env)
    newdir = tmp_path / "new" / "dir"
    with init("gloo", env={**env, "GRADCOMM_PROFILE_DIR": str(newdir)}) as comm:
        comm.all_reduce(torch.ones(2))
    assert (newdir / "gradcomm-trace-rank0.json").is_file()


@pytest.mark.parametrize("below", ["afile/sub", "afile/sub/deeper"])
def test_profile_dir_below_a_file_raises_at_init(tmp_path: Path, below: str) -> None:
    (tmp_path / "afile").write_text("x")
    env = {"GRADCOMM_PROFILE": "1", "GRADCOMM_PROFILE_DIR": str(tmp_path / below)}
    with pytest.raises(ValueError, match=r"is below .*afile.*, which is not a directory"):
        init("gloo", env=env)


def test_profile_dir_that_cannot_be_made_is_a_value_error_at_init(tmp_path: Path) -> None:
    # a name too long for the file system failed only when the trace was written, at close()
    env = {"GRADCOMM_PROFILE": "1", "GRADCOMM_PROFILE_DIR": str(tmp_path / ("a" * 300))}
    with pytest.raises(ValueError, match=r"GRADCOMM_PROFILE_DIR=.* cannot be used"):
        init("gloo", env=env)


def test_unknown_backend_names_its_source() -> None:
    with pytest.raises(ValueError, match=r"'nosuch' \(from GRADCOMM_BACKEND\)"):
        init(env={"GRADCOMM_BACKEND": "nosuch"})
    with pytest.raises(ValueError, match=r"'nosuch' \(from the backend argument\)"):
        init("nosuch", env={})


@pytest.mark.parametrize("bad", [True, "10", [1]])
def test_timeout_argument_of_wrong_type(bad: object) -> None:
    with pytest.raises(TypeError, match="timeout"):
        resolve_timeout(bad, {})  # type: ignore[arg-type]


# ----------------------------------------------------------------------------- registry
def test_available_backends_statuses() -> None:
    status = available_backends()
    assert list(status) == sorted(status)
    assert {"gloo", "mpi"} <= set(status)
    assert status["gloo"].available is torch.distributed.is_gloo_available()
    assert status["gloo"].name == "gloo"
    has_mpi4py = importlib.util.find_spec("mpi4py") is not None
    assert status["mpi"].available is has_mpi4py
    assert (status["mpi"].reason == "") is has_mpi4py


def test_unavailable_backend_reports_reason_and_raises_it() -> None:
    register_backend("broken", _unused_factory,
                     check=lambda: BackendUnavailableError("needs a frobnicator"))
    status = available_backends()["broken"]
    assert (status.available, status.reason) == (False, "needs a frobnicator")
    with pytest.raises(BackendUnavailableError, match="frobnicator"):
        init("broken", env={})


def _unused_factory(launch: LaunchInfo, timeout: float | None,
                    device: torch.device | None) -> Communicator:
    raise AssertionError("this factory must not be called")


def test_register_backend_with_custom_factory() -> None:
    calls: list[tuple[LaunchInfo, float | None, torch.device | None]] = []
    group = ThreadGroup(1)

    def factory(launch: LaunchInfo, timeout: float | None,
                device: torch.device | None) -> Communicator:
        calls.append((launch, timeout, device))
        return group.communicator(launch.rank)

    register_backend("My_Backend", factory)
    assert "my-backend" in known_backends()
    assert available_backends()["my-backend"].available

    comm = init("my-backend", timeout=5, env={})
    assert comm.rank == 0 and comm.world_size == 1
    assert calls == [(LaunchInfo(0, 1, 0, 1, Launcher.SINGLE), 5.0, None)]

    # Selected through the environment, with explicit placement and a device.
    comm = init(rank=0, world_size=1, device="cpu",
                env={"GRADCOMM_BACKEND": "MY_BACKEND", "GRADCOMM_TIMEOUT": "9"})
    assert calls[-1] == (LaunchInfo(0, 1, 0, 1, Launcher.EXPLICIT), 9.0, torch.device("cpu"))
    t = torch.tensor([4.0])
    comm.all_reduce(t)
    assert t.item() == 4.0 and group.calls == [0]
    comm.close()


def test_register_backend_bad_arguments() -> None:
    register_backend("dup", _unused_factory)
    with pytest.raises(ValueError, match="already registered"):
        register_backend("DUP", _unused_factory)
    register_backend("dup", _unused_factory, replace=True)  # allowed
    with pytest.raises(TypeError, match="factory"):
        register_backend("x", "not callable")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="check"):
        register_backend("x", _unused_factory, check=42)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="empty"):
        register_backend("  ", _unused_factory)
    assert "x" not in known_backends()


def test_gloo_world_size_one_through_init() -> None:
    with init("gloo", timeout=10, env={}) as comm:
        assert (comm.backend, comm.rank, comm.world_size) == ("gloo", 0, 1)
        t = torch.arange(3.0)
        comm.all_reduce(t, "avg")
        assert t.tolist() == [0.0, 1.0, 2.0]


def _init_from_env_argument(rank: int, world_size: int) -> list[float]:
    import os

    # The rendezvous address travels only in env=, not in the process environment.
    env = {k: os.environ.pop(k) for k in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE")}
    env["GRADCOMM_BACKEND"] = "gloo"
    with init(env=env, timeout=30) as comm:
        assert (comm.backend, comm.rank, comm.world_size) == ("gloo", rank, world_size)
        t = torch.full((3,), float(rank + 1))
        comm.all_reduce(t)
        return t.tolist()


@pytest.mark.slow
@pytest.mark.multiprocess
def test_init_reads_the_rendezvous_from_the_env_argument() -> None:
    out = run_processes(_init_from_env_argument, 2, timeout=90)
    assert out == [[3.0] * 3, [3.0] * 3]


# ----------------------------------------------------------------------------- missing mpi4py
_NO_MPI4PY = textwrap.dedent(
    """
    import sys
    sys.modules["mpi4py"] = None  # as if mpi4py were not installed
    import gradcomm
    status = gradcomm.available_backends()["mpi"]
    assert not status.available, status
    assert "pip install mpi4py" in status.reason, status.reason
    try:
        gradcomm.init("mpi", env={})
    except ImportError as exc:
        print("IMPORTERROR:", exc)
    else:
        raise SystemExit("init('mpi') did not raise ImportError")
    try:
        gradcomm.init(env={"GRADCOMM_BACKEND": "mpi"})
    except ImportError as exc:
        print("IMPORTERROR:", exc)
    """
)


@pytest.mark.slow
def test_mpi_backend_without_mpi4py_names_pip_command() -> None:
    proc = subprocess.run(
        [sys.executable, "-c", _NO_MPI4PY], capture_output=True, text=True, timeout=60,
        cwd=REPO_ROOT,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = [line for line in proc.stdout.splitlines() if line.startswith("IMPORTERROR:")]
    assert len(lines) == 2, proc.stdout
    assert all("pip install mpi4py" in line for line in lines)


@pytest.mark.slow
def test_import_gradcomm_does_not_import_mpi4py() -> None:
    code = "import sys, gradcomm; gradcomm.available_backends(); print('mpi4py' in sys.modules)"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=60, cwd=REPO_ROOT)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "False"


def test_top_level_init_is_the_same_function() -> None:
    assert gradcomm.init is init


@pytest.mark.parametrize("kwargs, exc, text", [
    ({"rank": 0.0, "world_size": 1}, TypeError, "rank must be an int, got float"),
    ({"rank": "0", "world_size": 1}, TypeError, "rank must be an int, got str"),
    ({"rank": 0, "world_size": 1.5}, TypeError, "world_size must be an int, got float"),
    ({"rank": True, "world_size": 1}, TypeError, "rank must be an int, got bool"),
    ({"rank": 0, "world_size": 1, "local_rank": 0.0}, TypeError, "local_rank must be an int"),
    ({"rank": 0, "world_size": 1, "device": "tpu"}, ValueError, "device 'tpu' is not a torch"),
    ({"rank": 0, "world_size": 1, "device": 3}, TypeError, "device must be a str or torch.device"),
])
def test_init_refuses_badly_typed_placement_and_device(kwargs: dict[str, object],
                                                       exc: type[Exception], text: str) -> None:
    # A float rank used to be accepted (comm.rank == 0.0) or to fail later with an unrelated
    # error; a device torch does not know raised torch's RuntimeError.
    with pytest.raises(exc, match=text):
        init("gloo", env={}, **kwargs)  # type: ignore[arg-type]


def test_init_accepts_numpy_integers_as_ints() -> None:
    import numpy as np

    with init("gloo", env={}, rank=np.int64(0), world_size=np.int64(1)) as comm:
        assert type(comm.rank) is int and comm.rank == 0 and comm.world_size == 1


@pytest.mark.parametrize("raw", ["maybe", "2", "yes please"])
def test_bad_abort_on_error_value_raises(raw: str) -> None:
    from gradcomm.comm.backends.mpi.abort import abort_on_error_enabled

    with pytest.raises(ValueError, match="GRADCOMM_MPI_ABORT_ON_ERROR"):
        abort_on_error_enabled({"GRADCOMM_MPI_ABORT_ON_ERROR": raw})
    for on in ("", "1", "TRUE", " on "):
        assert abort_on_error_enabled({"GRADCOMM_MPI_ABORT_ON_ERROR": on})
    for off in ("0", "false", "No", "OFF"):
        assert not abort_on_error_enabled({"GRADCOMM_MPI_ABORT_ON_ERROR": off})
    assert abort_on_error_enabled({})

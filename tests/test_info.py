"""``gradcomm info``: the report in-process, as a subprocess, and under real ``mpiexec -n 2``."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import gradcomm
from gradcomm.info import collect_info, format_info

from tests._support.dist_utils import child_env, run_mpi

# Variables that would make the child look launched (torchrun, MPI, SLURM) or pick a backend.
_LAUNCH_PREFIXES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "OMPI_", "PMI_",
                    "PMIX_", "MV2_", "SLURM_", "MPI_LOCAL", "GRADCOMM_")


def _clean_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(_LAUNCH_PREFIXES)}
    return child_env(extra, base=env)


def _run_info(*args: str, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "gradcomm", "info", *args], capture_output=True, text=True,
        env=_clean_env(**env), timeout=60, check=True,
    )


@pytest.mark.slow
def test_plain_json_single_process() -> None:
    report = json.loads(_run_info("--json").stdout)
    assert report["launch"] == {"launcher": "single", "rank": 0, "world_size": 1,
                                "local_rank": 0, "local_world_size": 1}
    assert report["backend"]["selected"] == "gloo"
    assert report["backend"]["reason"].startswith("auto")
    assert report["backend"]["available"] is True
    assert report["backends"]["gloo"] == {"available": True, "reason": ""}
    assert report["versions"]["gradcomm"] == gradcomm.__version__
    assert report["versions"]["torch"] == torch.__version__
    assert report["cuda"]["available"] is torch.cuda.is_available()


@pytest.mark.slow
def test_gradcomm_backend_env_is_reported_with_reason() -> None:
    report = json.loads(_run_info("--json", GRADCOMM_BACKEND="MPI").stdout)
    assert report["backend"]["selected"] == "mpi"
    assert report["backend"]["reason"] == "GRADCOMM_BACKEND"
    assert report["env"] == {"GRADCOMM_BACKEND": "MPI"}
    # the argument wins over the variable, as in gradcomm.init
    report = collect_info({"GRADCOMM_BACKEND": "mpi"}, backend="gloo", include_mpi=False)
    assert (report["backend"]["selected"], report["backend"]["reason"]) == (
        "gloo", "the backend argument")


def test_unknown_backend_is_reported_not_raised() -> None:
    report = collect_info({"GRADCOMM_BACKEND": "bogus"}, include_mpi=False)
    assert report["backend"]["selected"] == "bogus"
    assert report["backend"]["available"] is False
    assert "known backends: " in report["backend"]["error"] and "gloo" in report["backend"]["error"]
    assert "error: unknown gradcomm backend 'bogus' (from GRADCOMM_BACKEND)" in format_info(report)


def test_bad_switches_and_profile_dir_are_marked_invalid(tmp_path: Path) -> None:
    afile = tmp_path / "afile"
    afile.write_text("x")
    env = {"GRADCOMM_MPI_ABORT_ON_ERROR": "tru", "GRADCOMM_MPI_CUDA_AWARE": "maybe",
           "GRADCOMM_PROFILE": "1", "GRADCOMM_PROFILE_DIR": str(afile)}
    report = collect_info(env, include_mpi=False)
    assert sorted(report["env_errors"]) == sorted(env.keys() - {"GRADCOMM_PROFILE"})
    assert "GRADCOMM_MPI_ABORT_ON_ERROR must be one of" in report["env_errors"][
        "GRADCOMM_MPI_ABORT_ON_ERROR"]
    text = format_info(report)
    for name in env.keys() - {"GRADCOMM_PROFILE"}:
        line = next(row for row in text.splitlines() if row.strip().startswith(name))
        assert "INVALID" in line, text


@pytest.mark.slow
def test_text_output_single_process() -> None:
    lines = _run_info().stdout.splitlines()
    assert lines[0].startswith("gradcomm ")
    rows = {line.split()[0]: line.split(None, 1)[1] for line in lines[1:] if line.strip()}
    assert rows["launcher"] == "single"
    assert rows["rank"] == "0 of 1"
    assert rows["backend"].startswith("gloo (auto")
    assert not any(line.startswith("[rank") for line in lines)


def test_collect_info_reads_torchrun_env_and_reports_bad_env() -> None:
    env = {"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2",
           "GRADCOMM_BACKEND": "gloo"}
    report = collect_info(env, include_mpi=False)
    assert report["launch"] == {"launcher": "torchrun", "rank": 3, "world_size": 4,
                                "local_rank": 1, "local_world_size": 2}
    assert report["backend"]["reason"] == "GRADCOMM_BACKEND"
    assert report["versions"]["mpi_library"] is None
    assert report["cuda_aware_mpi"]["available"] is None
    json.dumps(report)  # serialisable
    text = format_info(report)
    assert re.search(r"^rank +3 of 4$", text, re.MULTILINE)
    bad = collect_info({"RANK": "0"}, include_mpi=False)  # no WORLD_SIZE: reported, not raised
    assert "WORLD_SIZE" in bad["launch"]["error"]
    assert "error:" in format_info(bad)


def test_bad_gradcomm_values_are_flagged_with_inits_error() -> None:
    env = {"GRADCOMM_TIMEOUT": "soon", "GRADCOMM_PROFILE": "maybe", "GRADCOMM_BACKEND": "gloo",
           "GRADCOMM_DEBUG": "loud"}
    report = collect_info(env, include_mpi=False)
    assert sorted(report["env_errors"]) == ["GRADCOMM_DEBUG", "GRADCOMM_PROFILE",
                                            "GRADCOMM_TIMEOUT"]
    fixes = {"GRADCOMM_TIMEOUT": {}, "GRADCOMM_DEBUG": {"GRADCOMM_TIMEOUT": "5"},
             "GRADCOMM_PROFILE": {"GRADCOMM_TIMEOUT": "5", "GRADCOMM_DEBUG": "off"}}
    for name, fixed in fixes.items():  # init checks them in this order
        with pytest.raises(ValueError) as info:
            gradcomm.init(env={**env, **fixed})
        assert report["env_errors"][name] == str(info.value)
    text = format_info(report)
    assert re.search(r"^GRADCOMM_TIMEOUT +soon  \[INVALID: ", text, re.MULTILINE), text
    assert re.search(r"^GRADCOMM_PROFILE +maybe  \[INVALID: ", text, re.MULTILINE), text
    good = collect_info({"GRADCOMM_TIMEOUT": "30", "GRADCOMM_PROFILE": "1"}, include_mpi=False)
    assert good["env_errors"] == {}
    assert "INVALID" not in format_info(good)


@pytest.mark.slow
def test_info_does_not_initialise_mpi() -> None:
    pytest.importorskip("mpi4py", reason="mpi4py is not installed (pip install mpi4py mpich)")
    code = (
        "from gradcomm.info import collect_info\n"
        "r = collect_info({})\n"
        "from mpi4py import MPI\n"
        "print(MPI.Is_initialized(), r['versions']['mpi_library'] is not None,\n"
        "      '--init-mpi' in r['cuda_aware_mpi']['reason'])\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env=_clean_env(), timeout=60, check=True).stdout.split()
    assert out == ["False", "True", "True"]


def _write_cli_script(tmp_path: Path) -> Path:
    script = tmp_path / "gradcomm_cli.py"
    script.write_text("import sys\nfrom gradcomm.__main__ import main\nsys.exit(main())\n")
    return script


@pytest.mark.slow
@pytest.mark.mpi
def test_info_under_mpiexec_json(tmp_path: Path) -> None:
    script = _write_cli_script(tmp_path)
    out = run_mpi(script, 2, ["info", "--json", "--init-mpi"], timeout=90,
                  env={"GRADCOMM_BACKEND": "gloo"})
    reports = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
    assert sorted(r["launch"]["rank"] for r in reports) == [0, 1]
    for r in reports:
        assert r["launch"]["world_size"] == 2
        assert r["launch"]["launcher"] in ("mpich", "open-mpi", "pmix", "mvapich2")
        assert (r["backend"]["selected"], r["backend"]["reason"]) == ("gloo", "GRADCOMM_BACKEND")
        assert r["versions"]["mpi_library"]  # the MPI library's own banner
        assert "MPI was not initialised" not in r["cuda_aware_mpi"]["reason"]  # --init-mpi
    only0 = run_mpi(script, 2, ["info", "--json", "--rank0", "--no-mpi"], timeout=90)
    reports = [json.loads(line) for line in only0.stdout.splitlines() if line.startswith("{")]
    assert [r["launch"]["rank"] for r in reports] == [0]


@pytest.mark.slow
@pytest.mark.mpi
def test_info_under_mpiexec_text_prefixes_ranks(tmp_path: Path) -> None:
    out = run_mpi(_write_cli_script(tmp_path), 2, ["info", "--no-mpi"], timeout=90)
    lines = [line for line in out.stdout.splitlines() if line.startswith("[rank")]
    assert {line.split("]")[0] for line in lines} == {"[rank 0", "[rank 1"}
    assert any(re.fullmatch(r"\[rank 1\] rank +1 of 2", line) for line in lines)

"""The MPI backend under real ``mpiexec`` (scripts in ``tests/mpi_scripts/``), plus its edges.

Each script checks values itself and prints ``RESULT ...`` lines that these tests parse; every run
is bounded by ``run_mpi``'s timeout, which kills the whole job.
"""

from __future__ import annotations

import re
import sys
import time

import pytest

from tests._support import ranks
from tests._support.dist_utils import (
    MPI_SCRIPTS,
    _mpiexec_flags,
    child_env,
    free_port,
    plain_python,
    require_mpi,
    run_command,
    run_mpi,
)
from tests._support.mpi_backend_collectives import every_op_and_dtype

SCRIPTS = MPI_SCRIPTS
# checks every_op_and_dtype makes: 44 all-reduces (10 dtypes x 5 ops, no AVG of integers or
# bool), 2 odd shapes, 6 broadcasts, 4 all-gathers, a barrier, 3 async, 2 large half runs
CHECKS = 62


def _results(output: str, prefix: str) -> list[str]:
    """The ``RESULT <prefix>...`` records in ``output`` (ranks' lines may be interleaved)."""
    found = re.findall(rf"RESULT {prefix}.*?(?=RESULT |\n|$)", output)
    return [line.rstrip() for line in found]


@pytest.mark.parametrize("comm_runner", [ranks.MPI], indirect=True)
@pytest.mark.parametrize("n", [2, 3])
def test_collectives_every_op_and_dtype(comm_runner: ranks.RankRunner, n: int) -> None:
    # the conformance suite (test_communicator.py) runs on mpi too; these are MPI's extra dtypes
    results = comm_runner(every_op_and_dtype, n, timeout=90, comm_timeout=30)
    assert results == [(r, n, CHECKS) for r in range(n)]


@pytest.mark.slow
@pytest.mark.mpi
@pytest.mark.parametrize("case", ["same", "size"])
def test_launch_settings_that_disagree_with_mpi_raise_on_every_rank(case: str) -> None:
    # "same": every rank passed rank=0; rank 0's values matched MPI's, so it used to wait forever
    # in MPI_Comm_dup for rank 1, which had raised.
    out = run_mpi(SCRIPTS / "mpi_backend_launch_mismatch.py", 2, [case], timeout=60).stdout
    lines = _results(out, "mismatch")
    assert len(lines) == 2, out
    wrong = "MPI rank 1 of 2: explicit settings say rank 0 of 2" if case == "same" else \
        "MPI rank 0 of 2: explicit settings say rank 0 of 3"
    for line in lines:
        assert "RuntimeError: the launch settings disagree with MPI" in line, out
        assert wrong in line, out


@pytest.mark.slow
@pytest.mark.mpi
def test_device_buffer_path_with_fake_adapters() -> None:
    out = run_mpi(SCRIPTS / "mpi_backend_staging.py", 2, timeout=60).stdout
    for mode in ("zero-copy", "staged", "real-adapter"):
        assert len(_results(out, f"staging {mode} ok")) == 2, out


@pytest.mark.slow
def test_world_size_one_plain_python_issues_no_collective() -> None:
    require_mpi()
    proc = plain_python(
        f"import runpy; runpy.run_path({str(SCRIPTS / 'mpi_backend_single.py')!r}, "
        "run_name='__main__')"
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert _results(proc.stdout, "single") == ["RESULT single calls=0 launcher=single"], proc.stdout


@pytest.mark.slow
@pytest.mark.mpi
def test_world_size_one_mpiexec_issues_no_collective() -> None:
    import torch

    out = run_mpi(SCRIPTS / "mpi_backend_single.py", 1, timeout=60).stdout
    (line,) = _results(out, "single")
    assert line.startswith("RESULT single calls=0 launcher="), out
    assert not line.endswith("launcher=single"), f"mpiexec -n 1 was not detected: {line}"
    # The same script checks that device="cuda" without CUDA raises BackendUnavailableError.
    if not torch.cuda.is_available():
        (cuda,) = _results(out, "cuda-unavailable")
        assert "torch.cuda.is_available() is False" in cuda, cuda


@pytest.mark.slow
@pytest.mark.mpi
def test_timeout_raises_and_job_ends_non_zero() -> None:
    # Rank 1 sleeps 600 s after skipping the collective; only the abort hook ends it in time.
    proc = run_mpi(SCRIPTS / "mpi_backend_timeout.py", 2, ["2"], timeout=40, check=False)
    out = proc.stdout
    assert proc.returncode != 0, out
    (line,) = _results(out, "timeout")
    assert "all_reduce #1 SUM bucket 0 of 8 torch.float32" in line, line
    elapsed = float(re.search(r"elapsed=([0-9.]+)", line).group(1))  # type: ignore[union-attr]
    assert elapsed >= 2.0, f"timed out before the 2 s limit: {line}"
    assert "CollectiveTimeoutError" in out, out
    (broken,) = _results(out, "broken")
    assert "unusable" in broken and "timed out" in broken, broken


@pytest.mark.slow
@pytest.mark.mpi
def test_gloo_under_mpiexec_stalled_rank_ends_the_job() -> None:
    # The gloo rendezvous initialised MPI; without the abort hook rank 0 would time out, then
    # hang in MPI_Finalize at exit waiting for rank 1 (asleep for 600 s).
    start = time.monotonic()
    proc = run_mpi(SCRIPTS / "mpi_backend_timeout.py", 2, ["2", "gloo"], timeout=60, check=False)
    elapsed = time.monotonic() - start
    out = proc.stdout
    assert proc.returncode != 0, out
    (line,) = _results(out, "timeout")
    assert "all_reduce #1 SUM bucket 0 of 8 torch.float32" in line and "gloo" in line, line
    assert float(re.search(r"elapsed=([0-9.]+)", line).group(1)) >= 2.0, line  # type: ignore[union-attr]
    assert elapsed < 40, (elapsed, out)  # the job ended long before rank 1 woke up


@pytest.mark.slow
@pytest.mark.mpi
@pytest.mark.parametrize("backend", ["mpi", "gloo"])
def test_all_gather_with_input_aliasing_output(backend: str) -> None:
    # MPI rejects (or silently mis-reads) a send buffer inside the receive buffer; the base
    # class sends a copy instead, so both idioms give the right values on every backend.
    proc = run_mpi(SCRIPTS / "mpi_backend_allgather_alias.py", 2, [backend], timeout=60)
    assert len(_results(proc.stdout, "alias-ok")) == 2, proc.stdout


@pytest.mark.slow
@pytest.mark.mpi
@pytest.mark.parametrize("case", ["dropped", "short-wait", "swapped"])
def test_pending_collectives_keep_their_buffers_and_block_only_while_pending(case: str) -> None:
    proc = run_mpi(SCRIPTS / "mpi_backend_pending.py", 2, [case], timeout=60)
    assert sorted(_results(proc.stdout, "pending")) == [
        f"RESULT pending {case} ok rank={r}" for r in range(2)
    ], proc.stdout


@pytest.mark.slow
@pytest.mark.mpi
def test_uncaught_error_aborts_the_job() -> None:
    # Rank 0 would wait 300 s in its barrier; the abort hook ends the job when rank 1 raises.
    proc = run_mpi(SCRIPTS / "mpi_backend_abort.py", 2, ["300"], timeout=40, check=False)
    out = proc.stdout
    assert proc.returncode != 0, out
    assert "deliberate failure on rank 1" in out, out
    # gradcomm's own line (the launcher's "application called MPI_Abort" can be lost in teardown).
    assert "gradcomm: uncaught ValueError on rank 1: aborting the MPI job" in out, out
    assert not _results(out, "barrier-timeout"), out


@pytest.mark.slow
@pytest.mark.mpi
def test_abort_hook_opt_out() -> None:
    # Without the hook, rank 0 is left in its barrier until the (short) timeout.
    proc = run_mpi(
        SCRIPTS / "mpi_backend_abort.py", 2, ["3"], timeout=40, check=False,
        env={"GRADCOMM_MPI_ABORT_ON_ERROR": "0"},
    )
    out = proc.stdout
    assert proc.returncode != 0, out
    assert "deliberate failure on rank 1" in out, out
    assert _results(out, "barrier-timeout"), out
    assert "MPI_Abort" not in out.split("RESULT barrier-timeout")[0], out
    assert "aborting the MPI job" not in out, out


@pytest.mark.slow
@pytest.mark.mpi
def test_gloo_rendezvous_through_mpi() -> None:
    out = run_mpi(
        SCRIPTS / "mpi_backend_gloo_rendezvous.py", 2, timeout=60,
        env={"GRADCOMM_BACKEND": "gloo"},
    ).stdout
    assert sorted(_results(out, "gloo")) == [
        "RESULT gloo rank=0 world=2 sum=36.0", "RESULT gloo rank=1 world=2 sum=36.0"
    ], out


@pytest.mark.slow
def test_missing_mpi4py_names_pip_install() -> None:
    # Both through gradcomm.init (the registry's check) and importing the backend module directly.
    proc = plain_python(
        "import sys\n"
        "sys.modules['mpi4py'] = None\n"
        "import gradcomm\n"
        "try:\n"
        "    gradcomm.init('mpi')\n"
        "except ImportError as exc:\n"
        "    print('INIT', exc)\n"
        "try:\n"
        "    import gradcomm.comm.backends.mpi.communicator\n"
        "except ImportError as exc:\n"
        "    print('MODULE', exc)\n"
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = proc.stdout.splitlines()
    assert [line.split()[0] for line in lines] == ["INIT", "MODULE"], proc.stdout
    assert all("pip install mpi4py" in line for line in lines), proc.stdout


_BAD_ONE_RANK = {  # case: what every rank's message must contain
    "profile": "GRADCOMM_PROFILE must be one of",
    "abort": "GRADCOMM_MPI_ABORT_ON_ERROR must be one of",
    "cuda_aware": "GRADCOMM_MPI_CUDA_AWARE must be one of",
    "timeout_env": "GRADCOMM_TIMEOUT must be a number of seconds",
    "backend_env": "glooo",
    "timeout_arg": "timeout must be a positive, finite number",
    "device_arg": "device 'tpu' is not a torch device",
    "other_backend": "the ranks chose different backends",
    "device_meta": "backend works on c",
    "env_arg": "env must be a mapping of str to str",
    "timeout_int": "timeout must be a positive, finite number",
    "store_one_rank": "the ranks chose different store addresses",
    "rank_out_of_range": "rank must be in [0, ",
    "rank_without_size": "give rank and world_size together",
    "placement_with_store": "the launch settings disagree with MPI on 1 of 2 ranks",
    "debug_env": "GRADCOMM_DEBUG must be 'off' or 'detail' (any case), got 'verbose'",
    "other_debug": "the ranks chose different debug levels (rank 0: off; rank 1: detail)",
}
_RAISED_AS = {"env_arg": "TypeError", "placement_with_store": "RuntimeError"}  # else ValueError


@pytest.mark.slow
@pytest.mark.mpi
@pytest.mark.parametrize(
    ("backend", "case"),
    # the mpi backend uses no store: a MASTER_ADDR on one rank is harmless there
    [(b, c) for b in ("mpi", "gloo") for c in sorted(_BAD_ONE_RANK)
     if (b, c) != ("mpi", "store_one_rank")],
)
def test_a_setting_bad_on_one_rank_raises_on_every_rank(backend: str, case: str) -> None:
    # Each case hung until killed before init agreed on its settings across MPI ranks (the
    # store case: until the store's timeout).
    n = 3 if case in ("profile", "other_backend") else 2
    out = run_mpi(SCRIPTS / "init_bad_setting_one_rank.py", n, [backend, case], timeout=60).stdout
    lines = _results(out, "badset")
    assert len(lines) == n, out
    kind = _RAISED_AS.get(case, "ValueError")
    for line in lines:
        assert f"{kind}: " in line and _BAD_ONE_RANK[case] in line, out
        rank = int(re.search(r"rank=(\d+)", line).group(1))  # type: ignore[union-attr]
        if case not in ("other_backend", "store_one_rank", "placement_with_store",
                        "other_debug") and \
                rank != n - 1:  # the others name the rank that had the problem
            assert f"gradcomm.init failed on 1 of {n} ranks (rank {n - 1}: {kind}:" in line, out
    total = n * (n + 1) // 2
    assert sorted(_results(out, "after")) == [f"RESULT after rank={r} {total}" for r in range(n)]


@pytest.mark.slow
@pytest.mark.mpi
def test_a_process_local_communicator_on_one_rank_does_not_wait_for_the_others() -> None:
    out = run_mpi(SCRIPTS / "init_without_agreement.py", 2, ["local_only"], timeout=60).stdout
    assert sorted(_results(out, "noagree")) == [
        "RESULT noagree local_only rank=0 3", "RESULT noagree local_only rank=0 local [1.0, 1.0]",
        "RESULT noagree local_only rank=1 3"], out


@pytest.mark.slow
@pytest.mark.mpi
def test_init_after_mpi4py_was_imported_without_mpi_init() -> None:
    port = str(free_port())
    out = run_mpi(SCRIPTS / "init_without_agreement.py", 2, ["info_first", port], timeout=60).stdout
    assert sorted(_results(out, "noagree")) == [
        f"RESULT noagree info_first rank={r} [3.0, 3.0, 3.0]" for r in range(2)], out


@pytest.mark.slow
@pytest.mark.mpi
@pytest.mark.multiprocess
def test_torchrun_started_by_mpiexec_does_not_initialise_mpi() -> None:
    # torchrun's variables win; its workers were not started by MPI, where PMI_Init fails
    exe = require_mpi()
    env = child_env({"OMP_NUM_THREADS": "1"})
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    cmd = [exe, *_mpiexec_flags(exe), "-n", "1", sys.executable, "-m", "torch.distributed.run",
           "--nproc-per-node", "2", "--master-port", str(free_port()),
           str(SCRIPTS / "init_without_agreement.py"), "torchrun_inside"]
    out = run_command(cmd, timeout=120, env=env).stdout
    assert sorted(_results(out, "noagree")) == [
        f"RESULT noagree torchrun_inside rank={r} [3.0, 3.0, 3.0] mpi4py=False"
        for r in range(2)], out


@pytest.mark.slow
@pytest.mark.mpi
def test_a_rank_that_never_joins_the_settings_check_is_a_timeout_not_a_hang() -> None:
    start = time.monotonic()
    out = run_mpi(SCRIPTS / "init_without_agreement.py", 2, ["local_vs_global"], timeout=60,
                  check=False).stdout
    lines = sorted(_results(out, "noagree"))
    assert lines[0].startswith("RESULT noagree local_vs_global rank=0 CollectiveTimeoutError: "
                               "gradcomm.init: not every rank reached the settings check "
                               "within 3 s"), out
    assert lines[1] == "RESULT noagree local_vs_global rank=1 world=1", out
    assert time.monotonic() - start < 45, out


@pytest.mark.slow
@pytest.mark.mpi
@pytest.mark.parametrize("backend", ["mpi", "gloo"])
def test_a_correct_placement_given_on_one_rank_only_still_works(backend: str) -> None:
    # the rank with rank=/world_size= used to skip the settings check while the others ran it:
    # their collectives paired with the wrong ones (IndexError/ValueError on mpi, a hang on gloo)
    out = run_mpi(SCRIPTS / "init_without_agreement.py", 2, ["explicit_on_one_rank", backend],
                  timeout=60).stdout
    assert sorted(_results(out, "noagree")) == [
        f"RESULT noagree explicit_on_one_rank rank={r} [3.0, 3.0]" for r in range(2)], out


@pytest.mark.slow
@pytest.mark.mpi
def test_init_after_a_timed_out_settings_check_is_refused_not_garbled() -> None:
    out = run_mpi(SCRIPTS / "init_without_agreement.py", 2, ["retry_after_timeout"], timeout=60,
                  check=False).stdout
    lines = sorted(_results(out, "noagree"))
    assert len(lines) == 3, out
    assert lines[0].startswith("RESULT noagree retry_after_timeout rank=0 t=10 RuntimeError: "
                               "gradcomm.init: an earlier settings check"), out
    assert lines[1].startswith("RESULT noagree retry_after_timeout rank=0 t=2 "
                               "CollectiveTimeoutError: gradcomm.init: not every rank"), out
    assert lines[2].startswith("RESULT noagree retry_after_timeout rank=1 t=3 "
                               "CollectiveTimeoutError: gradcomm.init: not every rank"), out

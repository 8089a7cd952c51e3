"""A rank that dies or stops calling mid-backward never hangs the others.

The last rank fails inside a gradient hook in the middle of ``loss.backward()``: it is SIGKILLed
(``kill``), raises an uncaught ValueError (``raise``) or sleeps for ten minutes (``stall``). The
timeout comes from ``gradcomm.init(timeout=)`` or from ``GRADCOMM_TIMEOUT``. Checked with real
processes:

* gloo, ranks started like torchrun: every survivor raises a RuntimeError naming the all-reduce and
  the bucket (CollectiveTimeoutError when the peer stalls; the transport's connection error, or
  the timeout, when it died), within the timeout plus a generous margin, and exits non-zero.
* mpi, under ``mpiexec``: the whole job ends, non-zero, within the timeout plus a margin after the
  failure -- no rank is left spinning (a SIGKILLed rank makes mpiexec end the job; a stalled one
  is ended by the abort hook once a survivor's CollectiveTimeoutError goes uncaught).

Times are only bounded from above, generously (the machine is shared); never asserted exactly.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time

import pytest

from tests._support.dist_utils import MPI_SCRIPTS, child_env, free_port, popen_rank, run_mpi

SCRIPT = MPI_SCRIPTS / "failure_kill.py"
TIMEOUT = 2.0  # the collective timeout given to gradcomm, seconds
MARGIN = 30.0  # generous: start-up and scheduling on a shared 2-core machine


def _records(output: str, prefix: str) -> list[dict[str, str]]:
    """The ``RESULT <prefix> k=v ... [message=text]`` records (ranks' lines may interleave)."""
    out = []
    for line in re.findall(rf"RESULT {prefix} .*?(?=RESULT |\n|$)", output):
        head, _, message = line.partition(" message=")
        fields = dict(re.findall(r"(\w+)=(\S+)", head))
        if message:
            fields["message"] = message.strip()
        out.append(fields)
    return out


def _run_torchrun_like(world_size: int, args: list[str], env: dict[str, str],
                       limit: float) -> tuple[list[int | None], list[float], str]:
    """Start ``world_size`` ranks with torchrun's variables; once one exits non-zero, give the
    others ``TIMEOUT + MARGIN`` s to end by themselves, then kill what is left (torchrun stops
    the job when a worker fails). The last rank (the victim) is not waited for.

    Returns each rank's exit code (None: killed), the wall time at which it ended, and the output.
    """
    port = free_port()
    procs = []
    for rank in range(world_size):
        full = child_env({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
                          "RANK": str(rank), "WORLD_SIZE": str(world_size),
                          "LOCAL_RANK": str(rank), "LOCAL_WORLD_SIZE": str(world_size),
                          "OMP_NUM_THREADS": "1", "GRADCOMM_BACKEND": "gloo", **env})
        procs.append(popen_rank([sys.executable, str(SCRIPT), *args], env=full,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                start_new_session=True))
    codes: list[int | None] = [None] * world_size
    ended = [float("inf")] * world_size
    deadline = time.time() + limit
    try:
        # stop when every survivor ended (the victim, the last rank, may still be stalled)
        while time.time() < deadline and any(c is None for c in codes[:-1]):
            for rank, p in enumerate(procs):
                if codes[rank] is None and p.poll() is not None:
                    codes[rank], ended[rank] = p.returncode, time.time()
                    if p.returncode != 0:
                        deadline = min(deadline, ended[rank] + TIMEOUT + MARGIN)
            time.sleep(0.05)
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
        outputs = [p.communicate()[0] for p in procs]
    return codes, ended, "\n".join(outputs)


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.timeout(200)
@pytest.mark.parametrize(("mode", "source"), [("kill", "arg"), ("raise", "arg"), ("stall", "env")])
def test_gloo_rank_fails_mid_backward(mode: str, source: str) -> None:
    world_size = 3
    args = [mode, source, str(TIMEOUT)]
    env = {"GRADCOMM_TIMEOUT": str(TIMEOUT)} if source == "env" else {}
    codes, ended, out = _run_torchrun_like(world_size, args, env, limit=120)
    assert len(_records(out, "step0 ok")) == world_size, out
    (victim,) = _records(out, "victim")
    failed_at = float(victim["t"])
    errors = {int(r["rank"]): r for r in _records(out, "error")}
    assert sorted(errors) == list(range(world_size - 1)), out  # every survivor raised
    for rank, rec in errors.items():
        assert codes[rank] not in (None, 0), (rank, codes, out)  # exited non-zero, by itself
        assert ended[rank] - failed_at < TIMEOUT + MARGIN, (rank, ended[rank] - failed_at, out)
        assert float(rec["elapsed"]) < TIMEOUT + MARGIN, rec
        # named by the collective that noticed the dead peer: a bucket, or the control tensor
        # sent after the last one (which gloo may refuse first)
        assert "all_reduce" in rec["message"], rec
        assert "bucket" in rec["message"] or "control tensor" in rec["message"], rec
        if mode == "stall":
            assert rec["type"] == "CollectiveTimeoutError", rec
            assert f"within {TIMEOUT} s" in rec["message"], rec
            assert float(rec["elapsed"]) < 2 * TIMEOUT, rec  # one timeout, not one per bucket
        else:
            assert rec["type"] in ("CollectiveTimeoutError", "RuntimeError"), rec
    assert f"timeout={TIMEOUT}" in out
    if mode == "raise":  # the victim itself ended with its own error
        assert codes[-1] == 1 and "deliberate failure on rank 2 mid-backward" in out, (codes, out)


@pytest.mark.slow
@pytest.mark.mpi
@pytest.mark.timeout(200)
@pytest.mark.parametrize(("mode", "source"), [("kill", "env"), ("raise", "env"), ("stall", "arg")])
def test_mpi_rank_fails_mid_backward_ends_the_job(mode: str, source: str) -> None:
    world_size = 3
    env = {"GRADCOMM_BACKEND": "mpi"}
    if source == "env":
        env["GRADCOMM_TIMEOUT"] = str(TIMEOUT)
    proc = run_mpi(SCRIPT, world_size, [mode, source, str(TIMEOUT)], timeout=150, env=env,
                   check=False)
    ended = time.time()
    out = proc.stdout
    assert proc.returncode != 0, out
    # The victim finished step 0, whose all-reduces need every rank (the others' lines may be
    # lost: MPI_Abort can kill a rank before mpiexec forwards its output).
    assert {r["rank"] for r in _records(out, "step0 ok")} >= {str(world_size - 1)}, out
    assert f"timeout={TIMEOUT}" in out
    (victim,) = _records(out, "victim")
    # the whole job (the victim included, when it only stalled) ended soon after the failure
    assert ended - float(victim["t"]) < TIMEOUT + MARGIN, (ended - float(victim["t"]), out)
    if mode == "stall":
        errors = _records(out, "error")
        assert errors, out
        for rec in errors:
            assert rec["type"] == "CollectiveTimeoutError", rec
            assert "all_reduce" in rec["message"] and "bucket" in rec["message"], rec
            # One timeout, not one per bucket already sent (MPI cannot cancel them, so waiting
            # on each in turn after the first timed out would add a full timeout apiece).
            assert float(rec["elapsed"]) < 2 * TIMEOUT, rec
        # Only the abort hook can end the job this soon: the victim is still asleep. (mpiexec's
        # own "MPI_Abort" banner is not asserted: the launcher may drop it while tearing down.)
    if mode == "raise":  # the abort hook printed the victim's traceback, then ended the job
        assert "deliberate failure on rank 2 mid-backward" in out, out

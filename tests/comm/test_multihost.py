"""Jobs across two simulated hosts: torchrun (2 nodes x 2 ranks) and MPICH's mpiexec (hydra,
starting the second host's ranks through an ssh stand-in), for every /etc/hosts variant: the
example trains across the hosts on the Debian variant (its own name on 127.0.1.1), and on the
others init and an all-reduce check the same address choice and launch detection.

Nothing is set for the network: no MASTER_ADDR (mpiexec), no GLOO_SOCKET_IFNAME, no
NCCL_SOCKET_IFNAME. torchrun is given the first host's address, as its users must. Each host is
a network namespace (see ``netns_hosts``); the tests skip, saying why, where those cannot be
made (not root, no ``ip``).
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest

from tests._support.dist_utils import MULTIHOST_SCRIPTS, REPO_ROOT, child_env, popen_rank
from tests._support.netns_hosts import HOSTS_VARIANTS, SimulatedHosts, namespace_problem

SCRIPTS = MULTIHOST_SCRIPTS
EXAMPLE = REPO_ROOT / "examples" / "train_digits.py"
BIN = Path(sys.executable).parent
RUN_TIMEOUT = 200.0  # seconds per launch; one takes about 30-60 s on 2 busy cores
_CLEARED = ("MASTER_", "GLOO_", "NCCL_", "GRADCOMM_", "RANK", "WORLD_SIZE", "LOCAL_", "PMI_",
            "OMPI_", "TORCHELASTIC_", "HYDRA_")

pytestmark = [pytest.mark.multihost, pytest.mark.multiprocess, pytest.mark.slow,
              pytest.mark.timeout(RUN_TIMEOUT + 60)]


def _env(**extra: str) -> dict[str, str]:
    """This process's environment without any launcher's or transport's settings."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(_CLEARED)}
    return child_env({"OMP_NUM_THREADS": "1", **extra}, base=env)


def _simulated(variant: str, workdir: Path) -> Iterator[SimulatedHosts]:
    """Yield the two hosts of ``variant``; torn down afterwards, whatever happened."""
    problem = namespace_problem()
    if problem is not None:
        pytest.skip(f"cannot simulate hosts: {problem}")
    made = SimulatedHosts.create(variant, workdir)
    try:
        yield made
    finally:
        made.destroy()


@pytest.fixture(params=HOSTS_VARIANTS)
def hosts(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[SimulatedHosts]:
    yield from _simulated(request.param, tmp_path)


@pytest.fixture
def plain_hosts(tmp_path: Path) -> Iterator[SimulatedHosts]:
    """Both hosts' names on their addresses (the variant that needs no help)."""
    yield from _simulated("own-address", tmp_path)


@pytest.fixture
def debian_hosts(tmp_path: Path) -> Iterator[SimulatedHosts]:
    """Each host's own name on 127.0.1.1 (the Debian/Ubuntu default)."""
    yield from _simulated("loopback-127.0.1.1", tmp_path)


def _run_all(hosts: SimulatedHosts, cmds: Sequence[list[str]],
             env: dict[str, str]) -> list[tuple[int, str]]:
    """Run the commands at once; ``(exit status, output)`` each. After RUN_TIMEOUT s every
    process in the hosts is killed and the test fails with what they printed."""
    procs = [popen_rank(c, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              env=env, cwd=REPO_ROOT, start_new_session=True) for c in cmds]
    deadline = time.monotonic() + RUN_TIMEOUT
    results = []
    try:
        for p in procs:
            try:
                out, _ = p.communicate(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                hosts.kill_all()
                outs = []
                for q in procs:
                    if q.poll() is None:
                        os.killpg(q.pid, signal.SIGKILL)
                    try:
                        outs.append(q.communicate(timeout=10)[0])
                    except subprocess.TimeoutExpired:
                        outs.append("(output still held open by a process)")
                pytest.fail(f"not finished within {RUN_TIMEOUT} s:\n" + "\n----\n".join(outs))
            results.append((p.returncode, out))
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait(10)
    return results


def _mpiexec(hosts: SimulatedHosts, cmd: list[str]) -> list[str]:
    """``mpiexec -n 4`` from the first host, 2 ranks per host, the second started via ssh."""
    pytest.importorskip("mpi4py", reason="mpi4py is not installed (pip install mpi4py mpich)")
    exe = BIN / "mpiexec"
    if not exe.exists() or "HYDRA" not in subprocess.run(
            [str(exe), "--version"], capture_output=True, text=True, timeout=20).stdout:
        pytest.skip("needs MPICH's hydra mpiexec beside this Python (pip install mpich)")
    return hosts.command(0, [
        str(exe), "-launcher", "ssh", "-launcher-exec", str(hosts.wrapper),
        "-hosts", f"{hosts.names[0]}:2,{hosts.names[1]}:2", "-n", "4", sys.executable, *cmd,
    ])


def _check_training(out: str, backend: str, launcher: str, hosts: SimulatedHosts) -> None:
    assert f"backend {backend}, 4 rank(s)" in out, out
    assert "parameters identical on all 4 ranks" in out, out
    final = re.findall(rf"final held-out accuracy: ([0-9.]+)\s+parameters identical on all 4 "
                       rf"ranks \(sha256 [0-9a-f]+\.\.\.\)\s+backend {backend},", out)
    assert len(final) == 1 and float(final[0]) > 0.8, out  # one epoch reaches about 0.9
    # Ranks 0-1 on the first host, 2-3 on the second, local ranks 0-1 on each.
    for rank in range(4):
        line = (rf"\[rank {rank}\] train_digits INFO: {launcher} launcher, backend {backend}, "
                rf"rank {rank} of 4, local rank {rank % 2}, device cpu, "
                rf"host {hosts.names[rank // 2]}\n")
        assert len(re.findall(line, out)) == 1, (line, out)


def _check_all_reduce(out: str, backend: str, launcher: str, hosts: SimulatedHosts) -> None:
    # Ranks 0-1 on the first host, 2-3 on the second, local ranks 0-1 on each; (1 + 2 + 3 + 4)
    for rank in range(4):
        line = (f"RESULT backend={backend} rank={rank} of 4 local={rank % 2} "
                f"host={hosts.names[rank // 2]} launcher={launcher} sum=10\n")
        assert out.count(line) == 1, (line, out)


#: The /etc/hosts variant on which the example trains across the hosts (once per launcher); on
#: the others, init and an all-reduce check the same address choice and launch detection.
TRAINED_ON = "loopback-127.0.1.1"


def test_torchrun_two_hosts_gloo(hosts: SimulatedHosts) -> None:
    torchrun = str(BIN / "torchrun")
    job = ([str(EXAMPLE), "--backend", "gloo", "--epochs", "1", "--timeout", "60"]
           if hosts.variant == TRAINED_ON else [str(SCRIPTS / "init_allreduce.py"), "gloo", "60"])
    cmds = [hosts.command(i, [
        torchrun, "--nnodes", "2", "--node-rank", str(i), "--nproc-per-node", "2",
        "--master-addr", hosts.addresses[0], "--master-port", "29400", *job,
    ]) for i in range(2)]
    (code0, out0), (code1, out1) = _run_all(hosts, cmds, _env())
    assert (code0, code1) == (0, 0), out0 + "\n----\n" + out1
    if hosts.variant == TRAINED_ON:
        _check_training(out0 + out1, "gloo", "torchrun", hosts)
    else:
        _check_all_reduce(out0 + out1, "gloo", "torchrun", hosts)


def test_torchrun_master_addr_name_that_is_loopback_on_its_own_host(
    debian_hosts: SimulatedHosts,
) -> None:
    # --master-addr gchosta: 127.0.1.1 on the first host, its real address on the second. The
    # first host's ranks reach the store through loopback, so they must find the address that
    # routes to the other host instead of binding gloo to 127.0.1.1.
    hosts = debian_hosts
    torchrun = str(BIN / "torchrun")
    cmds = [hosts.command(i, [
        torchrun, "--nnodes", "2", "--node-rank", str(i), "--nproc-per-node", "2",
        "--master-addr", hosts.names[0], "--master-port", "29400",
        str(SCRIPTS / "init_allreduce.py"), "gloo", "60",
    ]) for i in range(2)]
    results = _run_all(hosts, cmds, _env())
    out = "\n----\n".join(o for _, o in results)
    assert [code for code, _ in results] == [0, 0], out
    _check_all_reduce(out, "gloo", "torchrun", hosts)


@pytest.mark.mpi
def test_mpiexec_two_hosts_gloo_and_mpi(hosts: SimulatedHosts) -> None:
    trained = hosts.variant == TRAINED_ON
    cmd = _mpiexec(hosts, [str(SCRIPTS / "digits_backends.py"), "gloo,mpi", "--",
                           "--epochs", "1", "--timeout", "60"] if trained else
                   [str(SCRIPTS / "init_allreduce.py"), "gloo,mpi", "60"])
    [(code, out)] = _run_all(hosts, [cmd], _env())
    assert code == 0, out
    for backend in ("gloo", "mpi"):
        if trained:
            _check_training(out, backend, "mpich", hosts)
        else:
            _check_all_reduce(out, backend, "mpich", hosts)


@pytest.mark.mpi
def test_unreachable_interface_raises_on_every_rank(plain_hosts: SimulatedHosts) -> None:
    # GLOO_SOCKET_IFNAME=lo would bind gloo to loopback, which no other host reaches. Every rank
    # must raise, naming the interface and the variable, within the timeout (not wait for gloo).
    timeout = 20.0
    cmd = _mpiexec(plain_hosts, [str(SCRIPTS / "init_allreduce.py"), "gloo", str(timeout)])
    start = time.monotonic()
    [(code, out)] = _run_all(plain_hosts, [cmd], _env(GLOO_SOCKET_IFNAME="lo",
                                          GRADCOMM_MPI_ABORT_ON_ERROR="0"))
    assert code != 0, out
    # Rank 0 finds no address to publish on lo, and says so on every rank.
    failed = re.findall(r"INIT FAILED rank=(\d) after=([0-9.]+) RuntimeError: rank 0 has no "
                        r"non-loopback IPv4 address on GLOO_SOCKET_IFNAME=lo for the other hosts; "
                        r"set GLOO_SOCKET_IFNAME", out)
    assert sorted(int(r) for r, _ in failed) == [0, 1, 2, 3], out
    assert all(float(after) <= timeout + 5 for _, after in failed), out
    assert "RESULT" not in out, out
    assert time.monotonic() - start < RUN_TIMEOUT


def test_torchrun_unreachable_interface_raises_on_both_nodes(plain_hosts: SimulatedHosts) -> None:
    timeout = 20.0
    torchrun = str(BIN / "torchrun")
    cmds = [plain_hosts.command(i, [
        torchrun, "--nnodes", "2", "--node-rank", str(i), "--nproc-per-node", "2",
        "--master-addr", plain_hosts.addresses[0], "--master-port", "29400",
        str(SCRIPTS / "init_allreduce.py"), "gloo", str(timeout),
    ]) for i in range(2)]
    results = _run_all(plain_hosts, cmds, _env(GLOO_SOCKET_IFNAME="lo"))
    out = "\n----\n".join(o for _, o in results)
    assert all(code != 0 for code, _ in results), out
    failed = re.findall(r"INIT FAILED rank=(\d) after=([0-9.]+) RuntimeError: network check "
                        r"failed: .*?; set GLOO_SOCKET_IFNAME", out)
    assert sorted(int(r) for r, _ in failed) == [0, 1, 2, 3], out
    assert all(float(after) <= timeout + 5 for _, after in failed), out


@pytest.mark.mpi
def test_split_by_host_and_hierarchical_all_reduce_across_hosts(
    plain_hosts: SimulatedHosts,
) -> None:
    # 2 hosts x 2 ranks by hostname: intra = the host's 2 ranks, inter = one rank per host.
    cmd = _mpiexec(plain_hosts, [str(SCRIPTS / "hierarchical.py"), "gloo,mpi"])
    [(code, out)] = _run_all(plain_hosts, [cmd], _env())
    assert code == 0, out
    for backend in ("gloo", "mpi"):
        found = sorted(re.findall(rf"RESULT {backend} rank=(\d) intra=(\d)/2 inter=(\d)/2 ok",
                                  out))
        assert found == [("0", "0", "0"), ("1", "1", "0"), ("2", "0", "1"), ("3", "1", "1")], out

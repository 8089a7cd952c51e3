"""``python -m gradcomm.bench`` across two hosts simulated with network namespaces (root only).

Builds the two namespaces of ``tests/_support/netns_hosts.py`` (a veth pair, a hostname and an
/etc/hosts each), runs the sweep under MPICH's hydra ``mpiexec`` with 2 ranks per host -- the
second host's ranks started through the ssh stand-in -- with no network variable set, and tears
everything down. Extra arguments go to the sweep::

    python benchmarks/multihost_sweep.py --variant loopback-127.0.1.1 -- \\
        --backend gloo --backend mpi -e 4M --json benchmarks/results/multihost_sweep.json

The veth pair is a kernel-internal link (no wire, no NIC): the numbers measure gradcomm's
overhead over the raw transport on a real TCP path between network stacks, not a network.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # the test harness, tests._support

from tests._support.netns_hosts import HOSTS_VARIANTS, SimulatedHosts, namespace_problem

_CLEARED = ("MASTER_", "GLOO_", "NCCL_", "GRADCOMM_", "RANK", "WORLD_SIZE", "LOCAL_", "PMI_")


def main() -> int:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    p.add_argument("--variant", choices=HOSTS_VARIANTS, default="loopback-127.0.1.1",
                   help="/etc/hosts variant of both hosts (default: the Debian 127.0.1.1 one)")
    p.add_argument("--timeout", type=float, default=900.0, help="seconds before the job is killed")
    p.add_argument("sweep", nargs=argparse.REMAINDER, help="arguments after -- go to the sweep")
    args = p.parse_args()
    problem = namespace_problem()
    if problem is not None:
        p.error(f"cannot simulate hosts: {problem}")
    sweep = args.sweep[1:] if args.sweep[:1] == ["--"] else args.sweep
    env = {k: v for k, v in os.environ.items() if not k.startswith(_CLEARED)}
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
    with tempfile.TemporaryDirectory() as tmp:
        hosts = SimulatedHosts.create(args.variant, Path(tmp))
        try:
            mpiexec = str(Path(sys.executable).parent / "mpiexec")
            cmd = hosts.command(0, [
                mpiexec, "-launcher", "ssh", "-launcher-exec", str(hosts.wrapper),
                "-hosts", f"{hosts.names[0]}:2,{hosts.names[1]}:2", "-n", "4",
                sys.executable, "-m", "gradcomm.bench", *sweep,
            ])
            print(f"# hosts {hosts.names} at {hosts.addresses}, /etc/hosts variant "
                  f"{args.variant}, 2 ranks each", flush=True)
            return subprocess.run(cmd, env=env, cwd=REPO, timeout=args.timeout).returncode
        finally:
            hosts.destroy()


if __name__ == "__main__":
    sys.exit(main())

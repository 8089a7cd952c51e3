"""Two hosts simulated on one machine: Linux network namespaces joined by a veth pair.

Each simulated host is a network namespace with its own address on a private /24 (on the veth
interface only: nothing is routed anywhere else), its own ``/etc/hosts`` (``ip netns exec``
bind-mounts ``/etc/netns/<ns>/hosts`` over it) and its own hostname (each command runs under
``unshare --uts``, which sets it before the command starts). Needs root and iproute2's ``ip``;
:func:`namespace_problem` says why not where they are missing.

The ``/etc/hosts`` variants are those found on real machines: the host's own name on its address,
on 127.0.1.1 (the Debian/Ubuntu default) or absent; the peer's name always maps to the peer's
address, as DNS or a cluster's hosts file would give it.
"""

from __future__ import annotations

import itertools
import os
import shutil
import signal
import subprocess
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

__all__ = ["HOSTS_VARIANTS", "SimulatedHosts", "namespace_problem"]

#: /etc/hosts variants for a host's own name: on its address, on 127.0.1.1, or absent.
HOSTS_VARIANTS = ("own-address", "loopback-127.0.1.1", "absent")
_IP_TIMEOUT = 10.0  # seconds per ``ip`` call; they finish in milliseconds
_counter = itertools.count()


def namespace_problem() -> str | None:
    """Why namespaces cannot be made here (a sentence), or None when they can."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    for tool in ("ip", "unshare"):
        if shutil.which(tool) is None:
            return f"no {tool} command (iproute2 / util-linux)"
    name = f"gcprobe{os.getpid()}x{next(_counter)}"
    made = subprocess.run(["ip", "netns", "add", name], capture_output=True, text=True,
                          timeout=_IP_TIMEOUT)
    if made.returncode != 0:
        return f"ip netns add failed: {made.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", name], capture_output=True, timeout=_IP_TIMEOUT)
    return None


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True,
                   timeout=_IP_TIMEOUT)


@dataclass
class SimulatedHosts:
    """Two namespaces ``namespaces[i]`` with hostname ``names[i]`` and address ``addresses[i]``.

    Build with :meth:`create`; always :meth:`destroy` (it kills what still runs inside, bounded
    in time, and never raises).
    """

    names: tuple[str, str]
    namespaces: tuple[str, str]
    addresses: tuple[str, str]
    interfaces: tuple[str, str]
    variant: str
    workdir: Path

    @classmethod
    def create(cls, variant: str, workdir: Path, subnet: int = 231) -> SimulatedHosts:
        """Make both namespaces, the veth pair between them and the /etc/hosts files.

        Raises:
            ValueError: an unknown ``variant``.
            subprocess.CalledProcessError: an ``ip`` command failed (after cleaning up).
        """
        if variant not in HOSTS_VARIANTS:
            raise ValueError(f"variant must be one of {HOSTS_VARIANTS}, got {variant!r}")
        tag = f"{os.getpid() % 100000}x{next(_counter)}"  # unique per run and per fixture
        hosts = cls(
            names=("gchosta", "gchostb"),
            namespaces=(f"gcA{tag}", f"gcB{tag}"),
            addresses=(f"10.{subnet}.7.1", f"10.{subnet}.7.2"),
            interfaces=(f"gva{tag}", f"gvb{tag}"),  # within IFNAMSIZ (15 characters)
            variant=variant,
            workdir=workdir,
        )
        try:
            hosts._build()
        except BaseException:
            hosts.destroy()
            raise
        return hosts

    def _build(self) -> None:
        for ns in self.namespaces:
            _ip("netns", "add", ns)
        _ip("link", "add", self.interfaces[0], "type", "veth", "peer", "name", self.interfaces[1])
        for i, ns in enumerate(self.namespaces):
            _ip("link", "set", self.interfaces[i], "netns", ns)
            _ip("-n", ns, "addr", "add", f"{self.addresses[i]}/24", "dev", self.interfaces[i])
            _ip("-n", ns, "link", "set", self.interfaces[i], "up")
            _ip("-n", ns, "link", "set", "lo", "up")
            etc = Path("/etc/netns") / ns
            etc.mkdir(parents=True, exist_ok=True)
            (etc / "hosts").write_text(self.hosts_file(i))
        self._write_wrapper()

    def hosts_file(self, i: int) -> str:
        """The /etc/hosts of host ``i`` in this variant."""
        lines = ["127.0.0.1 localhost"]
        if self.variant == "own-address":
            lines.append(f"{self.addresses[i]} {self.names[i]}")
        elif self.variant == "loopback-127.0.1.1":
            lines.append(f"127.0.1.1 {self.names[i]}")
        other = 1 - i
        lines.append(f"{self.addresses[other]} {self.names[other]}")
        return "\n".join(lines) + "\n"

    @property
    def wrapper(self) -> Path:
        """A stand-in for ssh: ``wrapper [ssh options] HOST COMMAND...`` runs COMMAND on HOST."""
        return self.workdir / "netns-ssh"

    def _write_wrapper(self) -> None:
        cases = "\n".join(
            f"    {name}) ns={ns} ;;" for name, ns in zip(self.names, self.namespaces, strict=True)
        )
        self.wrapper.write_text(
            "#!/bin/sh\n"
            "# Like ssh [-x] HOST COMMAND: runs COMMAND (one shell string, as ssh passes it)\n"
            "# inside HOST's network namespace, under HOST's hostname.\n"
            'while [ "${1#-}" != "$1" ]; do shift; done\n'
            'host=$1; shift\n'
            'case "$host" in\n'
            f"{cases}\n"
            '    *) echo "netns-ssh: unknown host $host" >&2; exit 255 ;;\n'
            "esac\n"
            'exec ip netns exec "$ns" unshare --uts sh -c '
            '\'hostname "$0" && exec sh -c "$*"\' "$host" "$@"\n'
        )
        self.wrapper.chmod(0o755)

    def command(self, i: int, cmd: Sequence[str]) -> list[str]:
        """``cmd`` as run on host ``i``: in its namespace, under its hostname."""
        return ["ip", "netns", "exec", self.namespaces[i], "unshare", "--uts", "sh", "-c",
                'hostname "$0" && exec "$@"', self.names[i], *cmd]

    def kill_all(self) -> None:
        """SIGKILL every process inside either namespace (launchers start some ranks in
        sessions of their own, out of reach of a process-group kill)."""
        for ns in self.namespaces:
            for _ in range(3):
                pids = self._pids(ns)
                if not pids:
                    break
                for pid in pids:
                    try:
                        os.kill(pid, signal.SIGKILL)
                    except ProcessLookupError:
                        pass
                time.sleep(0.2)

    def destroy(self) -> None:
        """Kill what still runs in the namespaces, then delete them and their /etc files."""
        self.kill_all()
        for ns in self.namespaces:
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=_IP_TIMEOUT)
            shutil.rmtree(Path("/etc/netns") / ns, ignore_errors=True)

    @staticmethod
    def _pids(ns: str) -> list[int]:
        try:
            out = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True,
                                 timeout=_IP_TIMEOUT).stdout
        except (OSError, subprocess.TimeoutExpired):
            return []
        return [int(p) for p in out.split() if p.isdigit()]

"""The coordinator of a fault-tolerant job: torch's ``TCPStore``, served by a process that is not a
worker, so that it outlives any of them.

Start it once per job (or share it between jobs, each with its own ``job_id``)::

    python -m gradcomm.elastic --port 29400          # prints its address

and give each worker its address (``GRADCOMM_COORDINATOR=host:29400`` or
``ElasticGroup(..., coordinator="host:29400")``). It holds only small keys: each generation's
members, the heartbeats, the votes of the final agreement, and the process groups' rendezvous
(:mod:`gradcomm.elastic._membership` says which). It keeps no training state: models and
optimizer states travel between workers over the job's own communicators.

If the coordinator dies, the workers can neither agree on a new membership nor admit new
workers: each raises :class:`~gradcomm.elastic.ElasticError` at its next step (the monitor
thread notices within a heartbeat). The job ends; restart it, and the coordinator, from a
checkpoint. Run it where a worker's failure does not take it down (its own process, supervised).
"""

from __future__ import annotations

import datetime

import torch.distributed as dist

__all__ = ["COORDINATOR_ENV", "connect", "parse_address", "serve"]

#: The variable workers read the coordinator's ``host:port`` from.
COORDINATOR_ENV = "GRADCOMM_COORDINATOR"


def parse_address(address: str) -> tuple[str, int]:
    """``"host:port"`` (IPv6 in brackets: ``"[::1]:29400"``) as ``(host, port)``.

    Raises:
        TypeError: ``address`` is not a str.
        ValueError: no port, or a port that is not an int in 1..65535.
    """
    if not isinstance(address, str):
        raise TypeError(f"coordinator address must be a 'host:port' str, got "
                        f"{type(address).__name__}")
    host, sep, port = address.strip().rpartition(":")
    host = host.strip("[]")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"coordinator address must be 'host:port' with a port in 1..65535, "
                         f"got {address!r}")
    return host, int(port)


def connect(address: str, timeout: float) -> dist.TCPStore:
    """A client of the coordinator at ``address`` (``"host:port"``).

    Args:
        address: where :func:`serve` listens.
        timeout: seconds to wait for the connection, and for each store operation.

    Raises:
        ValueError: a malformed address.
        RuntimeError: no coordinator answered within ``timeout`` (the message names it).
    """
    host, port = parse_address(address)
    try:
        return dist.TCPStore(host, port, is_master=False, wait_for_workers=False,
                             timeout=datetime.timedelta(seconds=timeout))
    except (RuntimeError, dist.DistError) as exc:
        raise RuntimeError(f"no elastic coordinator answered at {address} within {timeout:g} s "
                           f"(start one: python -m gradcomm.elastic): {exc}") from exc


def serve(host: str = "0.0.0.0", port: int = 0) -> dist.TCPStore:
    """Serve a coordinator from this process (the store lives as long as the returned object).

    Args:
        host: address to listen on (``0.0.0.0``: every interface).
        port: TCP port; 0 lets the system choose (read it back from ``.port``).

    Raises:
        RuntimeError: the port cannot be bound.
    """
    return dist.TCPStore(host, port, is_master=True, wait_for_workers=False,
                         timeout=datetime.timedelta(seconds=60))

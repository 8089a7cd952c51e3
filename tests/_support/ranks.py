"""One harness for every transport: run a case function on each rank and get every rank's result.

A case is a module-level function ``case(comm, *args) -> result`` of a test module or helper: it
receives the rank's :class:`~gradcomm.comm.Communicator` and returns something picklable (tensors
included). :class:`RankRunner` runs it on ``world_size`` ranks of one backend:

* ``threads``: in-process ranks (``ThreadGroup``), for fast logic tests;
* ``gloo``: spawned processes set up like torchrun (``dist_utils.run_processes``);
* ``mpi``: a job under real ``mpiexec`` (``mpi_scripts/on_ranks.py`` imports the case by name).

The ``comm_runner`` fixture (conftest.py) is parametrised over :data:`BACKENDS`, whose ``gloo`` and
``mpi`` entries carry the ``slow`` and ``multiprocess``/``mpi`` markers; a test that needs fewer
backends parametrises ``comm_runner`` indirectly with some of them.
"""

from __future__ import annotations

import io
import pickle
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

import gradcomm
from gradcomm.comm.backends.threads import ThreadGroup

from tests._support.dist_utils import MPI_SCRIPTS, run_mpi, run_processes

THREADS = pytest.param("threads", id="threads")
GLOO = pytest.param("gloo", marks=[pytest.mark.slow, pytest.mark.multiprocess], id="gloo")
MPI = pytest.param("mpi", marks=[pytest.mark.slow, pytest.mark.mpi], id="mpi")
#: Every backend a case runs on, with the markers its launches need.
BACKENDS = [THREADS, GLOO, MPI]

_MPI_SCRIPT = MPI_SCRIPTS / "on_ranks.py"


def to_bytes(value: Any) -> bytes:
    """``torch.save`` bytes of ``value``: tensors put on a multiprocessing queue would share
    memory with the exiting child."""
    buf = io.BytesIO()
    torch.save(value, buf)
    return buf.getvalue()


def from_bytes(raw: bytes) -> Any:
    """The value :func:`to_bytes` saved."""
    return torch.load(io.BytesIO(raw), weights_only=False)


def _gloo_rank(
    rank: int, world_size: int, case: Callable[..., Any], args: tuple[Any, ...], comm_timeout: float
) -> bytes:
    torch.set_num_threads(1)  # every rank shares the machine's cores
    with gradcomm.init("gloo", timeout=comm_timeout) as comm:
        return to_bytes(case(comm, *args))


class RankRunner:
    """Runs case functions on the ranks of one backend (``"threads"``, ``"gloo"`` or ``"mpi"``).

    Args:
        backend: the transport.
        workdir: a directory for the MPI job's input and per-rank result files.
    """

    def __init__(self, backend: str, workdir: Path) -> None:
        if backend not in ("threads", "gloo", "mpi"):
            raise ValueError(f"unknown backend {backend!r}")
        self.backend = backend
        self.workdir = workdir
        #: collectives each rank issued in the last threads run (``ThreadGroup.calls``).
        self.calls: list[int] = []
        self._runs = 0

    def __call__(
        self,
        case: Callable[..., Any],
        world_size: int,
        *args: Any,
        timeout: float = 120.0,
        comm_timeout: float = 60.0,
    ) -> list[Any]:
        """``case(comm, *args)`` on each of ``world_size`` ranks; the results in rank order.

        ``timeout`` (seconds) bounds the whole run: the ranks are killed and the test fails after
        it. ``comm_timeout`` is the communicator's collective timeout. A rank that raises fails
        the test with its traceback (threads: RuntimeError chaining the rank's error).
        """
        if self.backend == "threads":
            group = ThreadGroup(world_size, timeout=comm_timeout)
            out = group.run(lambda comm: case(comm, *args))
            self.calls = list(group.calls)
            return out
        if self.backend == "gloo":
            raw = run_processes(_gloo_rank, world_size, case, args, comm_timeout, timeout=timeout)
            return [from_bytes(b) for b in raw]
        self._runs += 1
        job = self.workdir / f"mpi-case-{self._runs}"
        job.mkdir(parents=True)
        (job / "case.pkl").write_bytes(pickle.dumps((case, args, comm_timeout)))
        run_mpi(_MPI_SCRIPT, world_size, [str(job)], timeout=timeout)
        return [from_bytes((job / f"rank{r}.pt").read_bytes()) for r in range(world_size)]

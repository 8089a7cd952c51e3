"""The module tier: one launch runs whole modules of rank-agnostic tests, as mpi4py runs its
suite under one ``mpiexec -n N``.

A *suite module* (``tests/<part>/suite_<topic>.py``) holds test functions ``test_<what>(comm)``
that pass on every rank of any run they are given: rank 0 may play a part the others do not, but
the test holds at every world size (guard what needs two ranks with ``comm.world_size > 1``). Each
rank runs every test of the run, in definition order, on one communicator (the run's), so a test:

* leaves ``comm`` usable and in step: every rank issues the same collectives on it; a test that
  closes or breaks a communicator, or one that needs a different timeout, makes its own
  (``comm.split(0)``, or ``gradcomm.init`` where the launcher allows);
* restores what it changes in the process (environment variables, module attributes);
* asserts on every rank; a test whose verdict needs every rank's values gathers them itself
  (``comm.all_gather_object``).

:func:`parametrize` runs a test once per value (test id ``test_x[<value id>]``); :func:`only`
restricts a test to some runs (no item elsewhere).

A pytest module runs suite modules with a :class:`Suite` (the modules and the runs: backend and
world size) and one parametrised test; each (run, test) pair is one pytest item::

    SUITE = rank_suite.Suite([suite_collectives], rank_suite.runs("gloo-2", "mpi-3"))

    @pytest.mark.timeout(SUITE.item_timeout)
    @pytest.mark.parametrize(("run", "test_id"), SUITE.params())
    def test_rank_suite(run, test_id, tmp_path_factory):
        SUITE.check(run, test_id, tmp_path_factory)

The first item of a run launches it -- ``threads`` ranks and a one-rank ``gloo`` communicator in
this process, spawned ``gloo`` ranks (:func:`~tests._support.dist_utils.run_processes`), one
``mpiexec -n N`` job -- and keeps the outcomes for the run's other items. Every rank appends each
test's outcome (``ok``, or the traceback) to a file of its own as it goes. A rank whose test fails
stops there and ends its process (the launch ends, and the outcomes written so far stay): as in
mpi4py's suite, one failure ends the run, and the tests after it report that they did not run.
"""

from __future__ import annotations

import importlib
import json
import os
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

import gradcomm
from gradcomm.comm.backends.threads import ThreadGroup

from tests._support import ranks


@dataclass(frozen=True)
class Run:
    """One launch: ``world_size`` ranks of ``backend`` (``threads``, ``gloo`` or ``mpi``)."""

    backend: str
    world_size: int

    @property
    def id(self) -> str:
        return f"{self.backend}-{self.world_size}"

    @property
    def marks(self) -> list[pytest.MarkDecorator]:
        """The markers of the items of this run: ``slow`` and the launch kind, where it starts
        processes (threads ranks and one gloo rank run in this process)."""
        if self.backend == "mpi":
            return [pytest.mark.slow, pytest.mark.mpi]
        if self.backend == "gloo" and self.world_size > 1:
            return [pytest.mark.slow, pytest.mark.multiprocess]
        return []


def runs(*ids: str) -> list[Run]:
    """Runs from ids such as ``"mpi-3"``."""
    out = []
    for run_id in ids:
        backend, _, size = run_id.partition("-")
        if backend not in ("threads", "gloo", "mpi") or not size.isdigit() or int(size) < 1:
            raise ValueError(f"a run is <threads|gloo|mpi>-<world size>, got {run_id!r}")
        out.append(Run(backend, int(size)))
    return out


# ----------------------------------------------------------------------------- suite modules
def parametrize(argname: str, values: Sequence[Any],
                ids: Sequence[str] | None = None) -> Callable[[Any], Any]:
    """Run the decorated suite test once per value, as ``test(comm, <argname>=value)``; its test
    ids read ``test_x[<id>]`` (``ids``, else ``str(value)``)."""
    names = [str(v) for v in values] if ids is None else list(ids)
    if len(names) != len(values) or len(set(names)) != len(names):
        raise ValueError(f"parametrize({argname!r}): one distinct id per value, got {names}")

    def mark(test: Any) -> Any:
        test.suite_params = (argname, list(values), names)
        return test

    return mark


def only(applies: Callable[[Run], bool]) -> Callable[[Any], Any]:
    """Give the decorated suite test items only on the runs for which ``applies(run)`` is true
    (say why in a comment)."""

    def mark(test: Any) -> Any:
        test.suite_only = applies
        return test

    return mark


def _tests_of(module: ModuleType) -> dict[str, tuple[Callable[..., Any], dict[str, Any]]]:
    """The module's tests by test id (``<topic>.test_x[...]``), in definition order: each
    function and the keyword arguments of that id."""
    topic = module.__name__.rpartition(".")[2].removeprefix("suite_")
    tests: dict[str, tuple[Callable[..., Any], dict[str, Any]]] = {}
    for name, fn in vars(module).items():
        if not (name.startswith("test_") and callable(fn)
                and getattr(fn, "__module__", None) == module.__name__):
            continue
        params = getattr(fn, "suite_params", None)
        if params is None:
            tests[f"{topic}.{name}"] = (fn, {})
            continue
        argname, values, names = params
        for value, value_id in zip(values, names, strict=True):
            tests[f"{topic}.{name}[{value_id}]"] = (fn, {argname: value})
    return tests


# ----------------------------------------------------------------------------- on every rank
def run_tests_on_rank(comm: gradcomm.Communicator, modules: list[str], test_ids: list[str],
                      out_dir: str, end_process_on_failure: bool) -> int:
    """Run ``test_ids`` of the suite ``modules`` in order on this rank; append each outcome to
    ``out_dir/rank<r>.jsonl``. At the first failing test, stop; with
    ``end_process_on_failure``, end this process at once (exit status 1), which ends the launch.
    Returns the number of tests run."""
    tests: dict[str, tuple[Callable[..., Any], dict[str, Any]]] = {}
    for name in modules:
        tests.update(_tests_of(importlib.import_module(name)))
    with open(Path(out_dir) / f"rank{comm.rank}.jsonl", "a") as log:

        def record(**fields: Any) -> None:
            log.write(json.dumps(fields) + "\n")
            log.flush()

        for test_id in test_ids:
            fn, kwargs = tests[test_id]
            record(test=test_id, start=True)
            start = time.monotonic()
            try:
                fn(comm, **kwargs)
            except Exception:  # noqa: BLE001 - the outcome of the test, reported to the parent
                record(test=test_id, failed=traceback.format_exc())
                if end_process_on_failure:
                    os._exit(1)  # no MPI_Finalize or process-group teardown waiting for peers
                return test_ids.index(test_id) + 1
            record(test=test_id, ok=round(time.monotonic() - start, 3))
    return len(test_ids)


# ----------------------------------------------------------------------------- in pytest
@dataclass
class Outcomes:
    """What every rank of one run recorded, and how the launch ended."""

    run: Run
    test_ids: list[str]
    #: per rank: test id -> ("ok", seconds) | ("failed", traceback) | ("started", None)
    ranks: list[dict[str, tuple[str, Any]]]
    launch_error: str | None

    @classmethod
    def read(cls, run: Run, test_ids: list[str], out_dir: Path,
             launch_error: str | None) -> Outcomes:
        per_rank: list[dict[str, tuple[str, Any]]] = []
        for rank in range(run.world_size):
            seen: dict[str, tuple[str, Any]] = {}
            path = out_dir / f"rank{rank}.jsonl"
            lines = path.read_text().splitlines() if path.exists() else []
            for line in lines:
                rec = json.loads(line)
                if "ok" in rec:
                    seen[rec["test"]] = ("ok", rec["ok"])
                elif "failed" in rec:
                    seen[rec["test"]] = ("failed", rec["failed"])
                else:
                    seen[rec["test"]] = ("started", None)
            per_rank.append(seen)
        return cls(run, test_ids, per_rank, launch_error)

    def _first_failure(self) -> str | None:
        for test_id in self.test_ids:
            failed = [r for r, seen in enumerate(self.ranks)
                      if seen.get(test_id, ("", None))[0] == "failed"]
            if failed:
                return f"{test_id} failed on rank(s) {failed}"
        return None

    def check(self, test_id: str) -> None:
        """Pass when every rank ran ``test_id`` without error; else fail the pytest item with
        every rank's outcome (or why the test did not run)."""
        states = [seen.get(test_id, ("not run", None)) for seen in self.ranks]
        if all(state == "ok" for state, _ in states):
            return
        where = f"{self.run.id} ({self.run.world_size} ranks)"
        if any(state == "failed" for state, _ in states):
            parts = [f"{test_id} failed on {where}:"]
            shown = {"ok": "ok\n", "started": "started it; no outcome (the run ended first)\n",
                     "not run": "did not start it\n"}
            for rank, (state, value) in enumerate(states):
                parts.append(f"--- rank {rank}: {value if state == 'failed' else shown[state]}")
            pytest.fail("\n".join(parts), pytrace=False)
        running = [r for r, (state, _) in enumerate(states) if state == "started"]
        if running:
            why = (f"the run ended while it was running on rank(s) {running} (and not on "
                   f"{[r for r in range(self.run.world_size) if r not in running]})")
        else:
            why = f"the run stopped before it: {self._first_failure() or 'no test failed'}"
        tail = f"\nthe launch: {self.launch_error}" if self.launch_error else ""
        pytest.fail(f"{test_id} did not run on every rank of {where}: {why}{tail}",
                    pytrace=False)


class Suite:
    """Suite modules and the runs that run them: one launch per run, each running every test of
    the modules that applies to it (:func:`only`).

    Args:
        modules: the suite modules (their tests run in this order).
        runs: the launches; each gives every applicable test one pytest item.
        timeout: seconds a launch may take before its ranks are killed.
        comm_timeout: the collective timeout of the run's communicator; a rank waiting for a peer
            whose test failed gives up after it.
    """

    def __init__(self, modules: Sequence[ModuleType], runs: Sequence[Run], *,
                 timeout: float = 240.0, comm_timeout: float = 30.0) -> None:
        self.modules = list(modules)
        self.runs = list(runs)
        self.timeout = timeout
        self.comm_timeout = comm_timeout
        #: an item's timeout: the launch its run's first item starts, with a margin
        self.item_timeout = timeout + 60.0
        self._outcomes: dict[Run, Outcomes] = {}

    def test_ids(self, run: Run) -> list[str]:
        """The ids of the tests that ``run`` runs, in order."""
        ids = []
        for module in self.modules:
            for test_id, (fn, _) in _tests_of(module).items():
                applies = getattr(fn, "suite_only", None)
                if applies is None or applies(run):
                    ids.append(test_id)
        return ids

    def params(self) -> list[Any]:
        """``(run, test_id)`` parameter sets, grouped by run, with the run's markers; ids read
        ``mpi-3-collectives.test_reduce_scatter``."""
        return [pytest.param(run, test_id, marks=run.marks, id=f"{run.id}-{test_id}")
                for run in self.runs for test_id in self.test_ids(run)]

    def check(self, run: Run, test_id: str, tmp_path_factory: pytest.TempPathFactory) -> None:
        """Launch ``run`` if no item of it has, then check ``test_id``'s outcome."""
        if run not in self._outcomes:
            self._outcomes[run] = self._launch(run, tmp_path_factory.mktemp(f"suite-{run.id}"))
        self._outcomes[run].check(test_id)

    def _launch(self, run: Run, out_dir: Path) -> Outcomes:
        test_ids = self.test_ids(run)
        modules = [m.__name__ for m in self.modules]
        args = (modules, test_ids, str(out_dir))
        launch_error = None
        if run.backend == "threads":
            group = ThreadGroup(run.world_size, timeout=self.comm_timeout)
            group.run(lambda comm: run_tests_on_rank(comm, *args, False))
        elif run.backend == "gloo" and run.world_size == 1:
            with gradcomm.init("gloo", rank=0, world_size=1, env={},
                               timeout=self.comm_timeout) as comm:
                run_tests_on_rank(comm, *args, False)
        else:
            runner = ranks.RankRunner(run.backend, out_dir)
            try:
                runner(run_tests_on_rank, run.world_size, *args, True, timeout=self.timeout,
                       comm_timeout=self.comm_timeout)
            except pytest.fail.Exception as exc:  # a rank ended the launch, or it timed out
                launch_error = str(exc)
        return Outcomes.read(run, test_ids, out_dir, launch_error)


__all__ = ["Run", "runs", "parametrize", "only", "run_tests_on_rank", "Outcomes", "Suite"]

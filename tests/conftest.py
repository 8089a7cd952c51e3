"""Checks every test's markers against what it launched, and the ``comm_runner`` fixture.

``tests`` is a package: pytest puts the repository root on ``sys.path``, so the harness imports as
``tests._support...`` here and in spawned ranks (which inherit ``sys.path``); every other process
the harness starts gets the root on PYTHONPATH from ``dist_utils.child_env``.
"""

from collections.abc import Generator
from pathlib import Path

import pytest

from tests._support import dist_utils, ranks
from tests._support.dist_utils import missing_markers


def _check_markers(item: pytest.Item, since: int) -> None:
    """Fail ``item`` if what it launched since ``dist_utils.launches[since]`` lacks a marker, so
    ``-m "not slow"``, ``-m "not mpi"`` and ``-m "not multiprocess"`` deselect every test that
    starts processes."""
    marked = [m.name for m in item.iter_markers()]
    missing = missing_markers(dist_utils.launches[since:], marked)
    if missing:
        pytest.fail(
            f"{item.nodeid} starts processes but lacks the marker(s) "
            + ", ".join(f"@pytest.mark.{k}" for k in missing),
            pytrace=False,
        )


@pytest.hookimpl(wrapper=True)
def pytest_runtest_setup(item: pytest.Item) -> Generator[None, None, None]:
    since = len(dist_utils.launches)  # module fixtures run here, for the first test using them
    result = yield
    _check_markers(item, since)
    return result


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item) -> Generator[None, None, None]:
    since = len(dist_utils.launches)
    result = yield
    _check_markers(item, since)
    return result


@pytest.fixture(params=ranks.BACKENDS)
def comm_runner(request: pytest.FixtureRequest, tmp_path: Path) -> ranks.RankRunner:
    """Runs a case function on the ranks of each backend in turn (threads, gloo, mpi); see
    :mod:`ranks`. Parametrise it indirectly to use fewer backends."""
    return ranks.RankRunner(request.param, tmp_path)

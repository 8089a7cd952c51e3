"""Run torch's own distributed test suite against the "gradcomm" backend, and count the outcomes.

    python tests/torch_backend/run_torch_suite.py                 # DistributedTest, 2 ranks, gloo
    python tests/torch_backend/run_torch_suite.py -k send_recv,all_gather   # a subset

Runs ``torch.testing._internal.distributed.distributed_test``'s ``DistributedTest._DistTestBase``
from the installed torch the way torch's ``test/distributed/test_distributed_spawn.py`` does
(``BACKEND=gradcomm``, each test in ``--world-size`` spawned processes, ``init_method`` a
file://), with "gradcomm" declared a plugin backend that supports DDP and sub-groups
(``DistTestCases.backend_feature``). The transport is ``GRADCOMM_BACKEND`` (default gloo): under a
file:// store the mpi transport needs ``mpiexec -n 1`` per rank, so it is not run here.

Prints one line per test (``PASS``/``FAIL``/``ERROR``/``SKIP`` and the reason), then the counts
and the skips grouped by reason; exits 0 (the counts are the result). Not part of pytest's suite:
the whole of it takes about 30 minutes on two idle cores and hours on busy ones (each of its 285
tests starts its own ranks, skipped ones included).
"""

from __future__ import annotations

import argparse
import collections
import os
import sys
import tempfile
import time
import unittest

os.environ.setdefault("BACKEND", "gradcomm")
os.environ.setdefault("GRADCOMM_BACKEND", "gloo")
os.environ.setdefault("WORLD_SIZE", "2")
os.environ.setdefault("TEMP_DIR", tempfile.mkdtemp(prefix="gradcomm-torch-suite-"))

from torch.testing._internal.common_distributed import DistTestCases

import gradcomm  # noqa: F401 - registers "gradcomm" (also in the spawned ranks)

for feature in ("plugin", "ddp", "subgroup"):
    DistTestCases.backend_feature[feature].add("gradcomm")

from torch.testing._internal.distributed.distributed_test import (  # noqa: E402 - after the features
    DistributedTest,
    TestDistBackend,
)


class TestDistBackendWithSpawn(TestDistBackend, DistributedTest._DistTestBase):  # type: ignore[misc,name-defined]
    """As torch's test_distributed_spawn.py: each test runs in spawned ranks."""

    def setUp(self) -> None:
        super().setUp()
        self._spawn_processes()


class _Counting(unittest.TextTestResult):
    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self.passed: list[str] = []

    def addSuccess(self, test: unittest.TestCase) -> None:
        super().addSuccess(test)
        self.passed.append(test.id())


def _reason(text: str) -> str:
    return text.strip().splitlines()[0][:120] if text.strip() else "(no reason)"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-k", default="", help="run only tests whose name contains this (or "
                        "one of several, comma-separated)")
    args = parser.parse_args()
    loader = unittest.TestLoader()
    suite = unittest.TestSuite(
        t for t in loader.loadTestsFromTestCase(TestDistBackendWithSpawn)
        if any(k in t.id() for k in args.k.split(",")))
    start = time.monotonic()
    result = unittest.TextTestRunner(resultclass=_Counting, verbosity=2, stream=sys.stdout,
                                     buffer=False).run(suite)
    assert isinstance(result, _Counting)
    print(f"\ntransport {os.environ['GRADCOMM_BACKEND']}, {os.environ['WORLD_SIZE']} ranks, "
          f"{time.monotonic() - start:.0f} s")
    print(f"passed {len(result.passed)}, failed {len(result.failures)}, errors "
          f"{len(result.errors)}, skipped {len(result.skipped)}")
    for kind, items in (("FAILED", result.failures), ("ERROR", result.errors)):
        for test, trace in items:
            last = [line for line in trace.strip().splitlines() if line.strip()][-1]
            print(f"{kind} {test.id().split('.')[-1]}: {last[:160]}")
    groups = collections.Counter(_reason(why) for _, why in result.skipped)
    print("skips by reason:")
    for why, count in groups.most_common():
        print(f"  {count:4d}  {why}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

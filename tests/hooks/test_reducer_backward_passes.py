"""Issue 5, items 3 and 4 over real gloo processes: ``no_sync()`` accumulation, several backward
passes per step (``retain_graph``, two losses), activation checkpointing (reentrant and not), and a
backward that raised on one rank only, after some of its buckets were sent.

One spawned 2-rank run executes every case (``mpi_scripts/failure_common.py``); each test compares
the reduced gradients with one process's gradients on the global batch, and checks that all ranks
hold bit-identical gradients.
"""

from __future__ import annotations

import sys

from dist_utils import TESTS_DIR

sys.path.insert(0, str(TESTS_DIR / "mpi_scripts"))
import failure_common as fc

CASES = ["no_sync", "several_backwards", "checkpointing", "raised_on_one_rank"]
WORLD = 2

results, test_gloo = fc.make_gloo_tests(CASES, WORLD)

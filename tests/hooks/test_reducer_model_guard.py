"""Issue 5, items 1 and 5 over real gloo processes: the model differs across ranks, tied weights,
and parameters, buffers or submodules replaced after wrapping.

One spawned 2-rank run executes every case (``mpi_scripts/failure_common.py``); each test checks
one case's values or exact errors against single-process references.
"""

from __future__ import annotations

import sys

from dist_utils import TESTS_DIR

sys.path.insert(0, str(TESTS_DIR / "mpi_scripts"))
import failure_common as fc

CASES = ["fingerprint", "tied", "replaced"]
WORLD = 2

results, test_gloo = fc.make_gloo_tests(CASES, WORLD)

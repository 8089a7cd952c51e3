"""Run under ``mpiexec -n N``: the step-check and join cases of ``step_join_common.py`` on MPI.

Usage: ``python step_join_values.py CASE [CASE ...]``: ``failure_values.py``'s runner (one
``RESULT case=<name> world=<n> ok`` or ``... problems=<list>`` line per case) with these cases
registered.
"""

from __future__ import annotations

import step_join_common  # noqa: F401 - registers its cases with failure_common
from failure_values import main

if __name__ == "__main__":
    main()

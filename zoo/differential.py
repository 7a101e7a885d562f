"""The oracle helpers of ``tests/test_differential.py``, imported from there: one comparison for the suite and the zoo.

``tests/`` is not a package; pytest imports its modules as top-level ones, so the zoo does the same.
"""

from __future__ import annotations

import sys
from pathlib import Path

_TESTS = str(Path(__file__).resolve().parent.parent / "tests")
if _TESTS not in sys.path:
    sys.path.insert(0, _TESTS)

from test_differential import (  # noqa: E402
    BUILD_SEED,
    FILE_SEED,
    compare_models,
    compare_outputs,
    flat_outputs,
    forward,
    perturb,
    read,
    reference_load,
    seeded,
    tie_groups,
    trained_state,
    write,
)

__all__ = ["BUILD_SEED", "FILE_SEED", "compare_models", "compare_outputs", "flat_outputs", "forward", "perturb", "read",
           "reference_load", "seeded", "tie_groups", "trained_state", "write"]

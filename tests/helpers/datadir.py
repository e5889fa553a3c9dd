"""Where the tests' real datasets live: $COPES_DATA_DIR, else `shared/data` beside the repository (the
repository's parent's `shared/data`), else the small slices shipped in `tests/fixtures/data` (the same files, first
rows only: tests/fixtures/data/README.md), so a clone of the repository alone passes, offline. Import-time users
read `DATA_DIR`, `FULL_DATA` and `needs_full_data`; conftest.py points COPES_DATA_DIR (the copes-run processes,
`get_task`'s default) at the same folder."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from helpers.paths import FIXTURES, REPO

DATA_SLICES = FIXTURES / "data"
SHARED_DATA_DIR = REPO.parent / "shared" / "data"  # where a checkout beside the project's shared/ finds the full sets
# COPES_TEST_DATA=slices reads the slices even where the full sets are (.ci/run's lane that proves a bare clone passes).
_FULL_SETS = [] if os.environ.get("COPES_TEST_DATA") == "slices" else [
    Path(p) for p in (os.environ.get("COPES_DATA_DIR"), SHARED_DATA_DIR) if p]
FULL_DATA_DIR = next((p for p in _FULL_SETS if (p / "math").is_dir()), None)
DATA_DIR = FULL_DATA_DIR or DATA_SLICES
FULL_DATA = FULL_DATA_DIR is not None


def missing_reason(relative: str = "") -> str:
    return (f"needs the full data set, not the slices in {DATA_SLICES} (set COPES_DATA_DIR to the folder of "
            f"shared/data){': ' + relative if relative else ''}")


# For a test that needs whole data sets (their row counts, a thousand problems): it skips on the slices.
needs_full_data = pytest.mark.skipif(not FULL_DATA, reason=missing_reason())

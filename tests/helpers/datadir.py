"""Where the tests' real datasets live: $COPES_DATA_DIR, else `shared/data` beside the repository (the
repository's parent's `shared/data`). Import-time users (skip marks, module constants) read `DATA_DIR` and
`needs_data`; a test takes conftest.py's `data_dir` fixture, which skips with the missing folder as the reason."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from helpers.paths import REPO

DATA_DIR = Path(os.environ.get("COPES_DATA_DIR") or REPO.parent / "shared" / "data")


def missing_reason(relative: str = "") -> str:
    return f"test data {DATA_DIR / relative} not found (set COPES_DATA_DIR to the folder of shared/data)"


# For a test that reads DATA_DIR: it skips, naming the folder, where there is none.
needs_data = pytest.mark.skipif(not DATA_DIR.is_dir(), reason=missing_reason())

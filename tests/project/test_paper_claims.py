"""bench/paper_claims.py end to end at its smallest configuration: real runs of the trainer on the embedded model
(K = 1 and K = 4 at equal evaluations, two seeds), each cell saved as it ends, the page written with the binding
names, and a rerun that resumes from the saved cells instead of training again."""

from __future__ import annotations

import subprocess
import sys

import pytest

from helpers.paths import REPO


def _run(tmp_path, *extra: str) -> subprocess.CompletedProcess:
    command = [sys.executable, str(REPO / "bench" / "paper_claims.py"), "--quick", "--seeds", "2", "--configs",
               "K = 1", "K = 4", "--budgets", "equal evaluations", "--results", str(tmp_path / "cells"),
               "--page", str(tmp_path / "page.md"), *extra]
    return subprocess.run(command, cwd=REPO / "bench", capture_output=True, text=True, timeout=1200,
                          env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin", "HOME": str(tmp_path)})


@pytest.mark.slow
@pytest.mark.integration
def test_the_smallest_table_runs_end_to_end_and_resumes(tmp_path):
    first = _run(tmp_path)
    assert first.returncode == 0, first.stderr[-2000:]
    cells = sorted((tmp_path / "cells" / "equal_evaluations").glob("*.json"))
    assert [cell.name for cell in cells] == ["K___1__seed0.json", "K___1__seed1.json", "K___4__seed0.json",
                                             "K___4__seed1.json"]
    page = (tmp_path / "page.md").read_text()
    assert "| K = 1 | 2 |" in page and "| K = 4 | 2 |" in page and "±" in page and "32K" in page
    assert "CoPES beats ES (K = 4 − K = 1)" in page and "GRPO at 131072 tokens" in page
    stamps = [cell.stat().st_mtime_ns for cell in cells]
    again = _run(tmp_path)  # every cell is saved: nothing trains again
    assert again.returncode == 0, again.stderr[-2000:]
    assert [cell.stat().st_mtime_ns for cell in cells] == stamps
    assert (tmp_path / "page.md").read_text() == page

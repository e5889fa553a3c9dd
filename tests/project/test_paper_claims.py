"""bench/paper_claims.py end to end at its smallest configuration: real runs of the trainer on the embedded models
(K = 1 and K = 4 at equal evaluations, two seeds, on the tiny model's arithmetic and the small model's Countdown),
each cell saved as it ends, the page written with the binding names, a rerun that resumes from the saved cells
instead of training again, and two workers' cells equal to one process's."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from helpers.paths import REPO


def _run(tmp_path, *extra: str, tables: tuple[str, ...] = ("tiny-arithmetic", "small-countdown"),
         cells: str = "cells") -> subprocess.CompletedProcess:
    command = [sys.executable, str(REPO / "bench" / "paper_claims.py"), "--quick", "--seeds", "2", "--tables",
               *tables, "--configs", "K = 1", "K = 4", "--budgets", "equal evaluations",
               "--results", str(tmp_path / cells), "--page", str(tmp_path / "page.md"), *extra]
    return subprocess.run(command, cwd=REPO / "bench", capture_output=True, text=True, timeout=1200,
                          env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin", "HOME": str(tmp_path)})


@pytest.mark.slow
@pytest.mark.integration
def test_the_smallest_table_runs_end_to_end_and_resumes(tmp_path):
    first = _run(tmp_path, "--workers", "2")
    assert first.returncode == 0, first.stderr[-2000:]
    cells = sorted((tmp_path / "cells").glob("*/equal_evaluations/*.json"))
    assert [str(cell.relative_to(tmp_path / "cells")) for cell in cells] == [
        f"{table}/equal_evaluations/K___{k}__seed{seed}.json"
        for table in ("small-countdown", "tiny-arithmetic") for k in (1, 4) for seed in (0, 1)]
    page = (tmp_path / "page.md").read_text()
    assert "| K = 1 | 2 |" in page and "| K = 4 | 2 |" in page and "±" in page and "32K" in page
    assert "### The embedded small model" in page and "on Countdown" in page and "on arithmetic" in page
    assert "CoPES beats ES (K = 4 − K = 1)" in page and "GRPO at 131072 tokens" in page
    assert "![each configuration's gain, table by table](page.png)" in page
    assert (tmp_path / "page.png").read_bytes().startswith(b"\x89PNG")
    stamps = [cell.stat().st_mtime_ns for cell in cells]
    again = _run(tmp_path)  # every cell is saved: nothing trains again
    assert again.returncode == 0, again.stderr[-2000:]
    assert [cell.stat().st_mtime_ns for cell in cells] == stamps
    assert (tmp_path / "page.md").read_text() == page

    # The two workers' cells are the cells one process runs in turn (equal evaluations: no clock in them).
    alone = _run(tmp_path, "--workers", "1", tables=("tiny-arithmetic",), cells="alone")
    assert alone.returncode == 0, alone.stderr[-2000:]
    for seed in (0, 1):
        for k in (1, 4):
            name = f"tiny-arithmetic/equal_evaluations/K___{k}__seed{seed}.json"
            together, by_itself = (json.loads((tmp_path / folder / name).read_text()) for folder in ("cells", "alone"))
            assert {key: together[key] for key in ("before", "after", "steps")} == {
                key: by_itself[key] for key in ("before", "after", "steps")}

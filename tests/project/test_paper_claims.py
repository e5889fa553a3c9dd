"""bench/paper_claims.py end to end at its smallest configuration: real runs of the trainer on the embedded models
(K = 1 and K = 4 at equal evaluations, two seeds, on the tiny model's arithmetic and the small model's Countdown),
each cell saved as it ends, the page written with the binding names, a rerun that resumes from the saved cells
instead of training again, and two workers' cells equal to one process's."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import asdict

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


# ---- the statistics every result page shares (bench/common/stats.py) and where a run writes its page ----------------
sys.path.insert(0, str(REPO / "bench"))
import paper_claims  # noqa: E402

from common import harness  # noqa: E402
from common.stats import holm, sign_flip_floor, sign_flip_p  # noqa: E402


def test_holm_adjusts_step_down_and_keeps_untestable_comparisons_out_of_the_family():
    assert holm([0.01, 0.04, 0.03]) == pytest.approx([0.03, 0.06, 0.06])
    adjusted = holm([0.01, float("nan"), 0.5])
    assert adjusted[0] == pytest.approx(0.02) and adjusted[2] == pytest.approx(0.5) and adjusted[1] != adjusted[1]


def test_the_exact_sign_flip_test_and_its_floor_at_five_seeds():
    assert sign_flip_p([1.0, 2.0, 3.0, 4.0, 5.0]) == pytest.approx(2 / 32) == sign_flip_floor(5)
    assert sign_flip_p([1.0, -1.0, 2.0, -2.0]) == 1.0
    assert sign_flip_p([3.0, 1.0, -0.5]) == pytest.approx(4 / 8)  # |mean| >= 7/6 for +++, ++-, and their mirrors


def test_a_run_with_fewer_seeds_writes_beside_the_page_and_a_full_run_replaces_it(tmp_path):
    settings = paper_claims.Settings(**{**paper_claims.FULL, "seeds": 1}, results=tmp_path)
    beside = paper_claims.page_to_write(None, settings, quick=False)
    assert beside == paper_claims.PAGE.with_name("paper-claims.1-seeds.md")
    full = paper_claims.Settings(**paper_claims.FULL, results=tmp_path)
    assert paper_claims.page_to_write(None, full, quick=False) == paper_claims.PAGE
    assert paper_claims.page_to_write(None, settings, quick=True) == tmp_path / "paper-claims.md"


def test_a_cell_records_its_command_commit_versions_machine_and_seed():
    provenance = harness.run_provenance(3)
    assert provenance["seed"] == 3 and len(provenance["commit"]) == 40
    assert {"torch", "transformers", "trl", "gguf"} <= provenance["versions"].keys()
    assert provenance["command"] and "CPUs" in provenance["machine"]


def _real_model_cell(method: str, budget: str, seed: int, gain: float, **settings: object) -> dict[str, object]:
    """A saved cell of bench/real_model.py as run_cell writes it (the numbers made up: only the page is tested)."""
    return {"method": method, "budget": budget, "seed": seed, "before": 0.2, "after": 0.2 + gain / 100,
            "gain_points": gain, "steps": 4, "cpu_seconds": 40.0, "peak_rss_gib": 1.5,
            "curve": {"seconds": [0.0, 40.0], "accuracy": [0.2, 0.2 + gain / 100]},
            "settings": {"steps": 4, "budget_s": 240.0, "seeds": 3, **settings}}


def test_the_real_model_page_rows_shares_and_corrected_comparisons():
    """bench/real_model.py's results section from saved cells: every method's row (GRPO's too), intervals as ±, the
    share of GRPO's gain beside the paper's, and the comparisons with CoPES Holm-corrected."""
    import real_model

    saved = [_real_model_cell(method, "equal wall clock", seed, gain + seed)
             for method, gain in (("CoPES (K=4)", 4.0), ("ES (K=1)", 2.0), ("EGGROLL", 1.0), (paper_claims.GRPO, 8.0))
             for seed in range(3)]
    page = "\n".join(real_model.results_section(saved))
    assert "| GRPO (TRL) | 3 | 20.0 | 29.0 | +9.0 ± " in page and "| CoPES (K=4) | 0 | not run |" in page
    assert 'Settings: no cell yet.' in page and 'Settings: {"budget_s": 240.0}.' in page  # what a cell depends on
    assert "CoPES (K=4): 56% (paper: 92%)" in page and "ES (K=1): 33% (paper: 67%)" in page
    assert "| CoPES (K=4) − ES (K=1), equal wall clock | 3 | +2.0 ± 0.0 |" in page and "Holm" in page


def test_the_real_model_page_takes_the_cells_of_its_settings_and_never_shrinks(tmp_path):
    """Cells saved under other settings stay off the table; a section with fewer cells than the page holds (a run
    with fewer seeds, another results folder) is written beside the page, which stays as it was."""
    import real_model

    settings = real_model.Settings(steps=4, budget_s=240.0, seeds=2)
    for seed, steps in ((0, 4), (1, 4), (2, 8)):  # seed 2's cell ran 8 steps: another table's
        path = real_model.cell_path(tmp_path / "cells", "equal rollouts", "EGGROLL", seed)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(_real_model_cell("EGGROLL", "equal rollouts", seed, 1.0, **{
            **asdict(settings), "steps": steps, "budget_s": 1800.0, "seeds": 1})))  # budget_s, seeds: not measured
    page = tmp_path / "real-model.md"
    page.write_text(f"# The page\n\n{real_model.RESULTS_MARK}\nold\n{real_model.END_MARK}\nafter\n")
    assert real_model.write_page(tmp_path / "cells", settings, page) == page
    written = page.read_text()
    assert "| EGGROLL | 2 |" in written and written.startswith("# The page") and written.endswith("after\n")
    assert "](real-model.png)" in written and (tmp_path / "real-model.png").read_bytes()[:4] == b"\x89PNG"
    real_model.cell_path(tmp_path / "cells", "equal rollouts", "EGGROLL", 1).unlink()
    beside = real_model.write_page(tmp_path / "cells", settings, page)
    assert beside == tmp_path / "real-model.1-cells.md" and "| EGGROLL | 1 |" in beside.read_text()
    assert "](real-model.1-cells.png)" in beside.read_text() and beside.with_suffix(".png").is_file()
    assert page.read_text() == written


def test_a_real_model_curve_is_plotted_against_steps_or_training_seconds():
    import real_model

    per_step = {**_real_model_cell("CoPES (K=4)", "equal rollouts", 0, 2.0),
                "curve": {"seconds": [0.0, 10.0, 20.0, 30.0, 40.0], "accuracy": [0.2, 0.21, 0.2, 0.22, 0.22]}}
    assert real_model.curve_points(per_step) == ([0, 1, 2, 3, 4], [20.0, 21.0, 20.0, 22.0, 22.0])
    ends_only = _real_model_cell("CoPES (K=4)", "equal rollouts", 0, 2.0)  # saved before a point per step
    assert real_model.curve_points(ends_only)[0] == [0, 4]
    assert real_model.curve_points(_real_model_cell("EGGROLL", "equal wall clock", 0, 2.0))[0] == [0.0, 40.0]


def test_the_chat_sums_files_are_fixed_disjoint_and_cover_every_pair(tmp_path):
    import real_model

    train, held_out = real_model.chat_sum_files(tmp_path / "a")
    rows = [json.loads(line) for path in (train, held_out) for line in path.read_text().splitlines()]
    assert len(rows) == 31 * 31 and len(held_out.read_text().splitlines()) == 200
    assert len({row["prompt"] for row in rows}) == len(rows)
    first_held_out = rows[-200]
    assert first_held_out == {"prompt": "What is 21 + 28? Put the final answer in \\boxed{}.", "answer": "49"}
    assert real_model.chat_sum_files(tmp_path / "b")[1].read_bytes() == held_out.read_bytes()

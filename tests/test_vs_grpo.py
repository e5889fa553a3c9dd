"""Smoke test of bench/vs_grpo.py at a tiny size: a real TRL GRPO run and a real CoPES run on the embedded model
under the same training clock, the table and plot they make, and both memory measurements. No speed or accuracy
is asserted: the invariants are (an evaluation before and one at the end of every run, the clock stopped at the
budget, a real GRPO step, a measured backward costing more than a no-grad member)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

pytest.importorskip("trl", reason="TRL is the GRPO baseline: pip install -e '.[bench]'")
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

import vs_grpo  # noqa: E402

BUDGET_S, EVAL_SIZE = 3.0, 8


@pytest.fixture(scope="module")
def curves() -> list[vs_grpo.Curve]:
    jobs = [(vs_grpo.GRPO, 0, lr, BUDGET_S, 2, EVAL_SIZE) for lr in (1e-3, 3e-4)] + [("CoPES K=4", 0, None, BUDGET_S, 2, EVAL_SIZE)]
    return vs_grpo.run_jobs(jobs, workers=1)


def test_every_run_is_evaluated_before_and_at_the_end_of_the_same_budget(curves):
    for curve in curves:
        assert curve.seconds[0] == 0.0 and curve.steps >= 1
        assert curve.seconds[-1] >= BUDGET_S and curve.seconds == sorted(curve.seconds)
        assert len(curve.accuracies) == len(curve.seconds) >= 2
        assert all(0.0 <= accuracy <= 1.0 for accuracy in curve.accuracies)
        assert curve.accuracies[0] == curves[0].accuracies[0]  # one starting model, one held-out set


def test_table_and_plot(curves, tmp_path):
    rows = vs_grpo.race_rows(curves)
    best = vs_grpo.best_grpo_lr(curves)
    assert [row["method"] for row in rows] == ["GRPO (TRL) lr=0.001", "GRPO (TRL) lr=0.0003", "CoPES K=4"]
    grpo_row = next(row for row in rows if row["method"] == f"GRPO (TRL) lr={best:g}")
    assert grpo_row["share_of_grpo_pct"] == pytest.approx(100.0) or grpo_row["gain_pts"] == 0
    vs_grpo.plot_race(curves, tmp_path / "race.png", "smoke")
    assert (tmp_path / "race.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_training_clock_passes_every_mark_a_long_step_crosses():
    clock = vs_grpo.TrainingClock(budget_s=10.0, evaluations=5)
    clock.elapsed = 6.5
    assert clock.due() and clock.marks == [8.0, 10.0] and not clock.due() and not clock.over
    clock.elapsed = 10.0
    assert clock.due() and clock.over and clock.marks == []


def test_memory_of_one_grpo_update_exceeds_one_es_member():
    grpo = vs_grpo.measure_memory(("GRPO update", 128, 2, 4))
    member = vs_grpo.measure_memory(("ES member", 128, 2, 4))
    assert grpo["parameters"] == member["parameters"] > 4_000_000
    assert grpo["peak_mib"] > member["peak_mib"] > 0

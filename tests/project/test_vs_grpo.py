"""Smoke test of bench/vs_grpo.py at a tiny size: a real TRL GRPO run and a real CoPES run on the embedded model
under the same training clock, the table and plot they make, and both memory measurements. No speed or accuracy
is asserted: the invariants are (an evaluation before and one at the end of every run, the clock stopped at the
budget, a real GRPO step, a measured backward costing more than a no-grad member)."""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import replace

import pytest
import torch

from helpers.paths import REPO

pytest.importorskip("trl", reason="TRL is the GRPO baseline: pip install -e '.[bench]'")
sys.path.insert(0, str(REPO / "bench"))

import vs_grpo  # noqa: E402

BUDGET_S, EVAL_SIZE = 3.0, 8


@pytest.fixture(scope="module")
def curves() -> list[vs_grpo.Curve]:
    jobs = [vs_grpo.Job(vs_grpo.GRPO, 0, lr, BUDGET_S, 2, EVAL_SIZE) for lr in (1e-3, 3e-4)]
    return vs_grpo.run_jobs(jobs + [vs_grpo.Job("CoPES", 0, None, BUDGET_S, 2, EVAL_SIZE)], workers=1)


@pytest.mark.slow
def test_every_run_is_evaluated_before_and_at_the_end_of_the_same_budget(curves):
    for curve in curves:
        assert curve.seconds[0] == 0.0 and curve.steps >= 1
        assert curve.seconds[-1] >= BUDGET_S and curve.seconds == sorted(curve.seconds)
        assert len(curve.accuracies) == len(curve.seconds) == len(curve.wall_seconds) >= 2
        assert curve.wall_seconds == sorted(curve.wall_seconds) and curve.wall_seconds[-1] > 0
        assert all(0.0 <= accuracy <= 1.0 for accuracy in curve.accuracies)
        assert curve.accuracies[0] == curves[0].accuracies[0]  # one starting model, one held-out set


@pytest.mark.slow
def test_table_and_plot(curves, tmp_path):
    rows = vs_grpo.race_rows(curves)
    best = vs_grpo.best_grpo_lr(curves)
    assert [row["method"] for row in rows] == ["GRPO (TRL) lr=0.001", "GRPO (TRL) lr=0.0003", "CoPES"]
    grpo_row = next(row for row in rows if row["method"] == f"GRPO (TRL) lr={best:g}")
    assert grpo_row["share_of_grpo_pct"] == pytest.approx(100.0) or grpo_row["gain_pts"] == 0
    vs_grpo.plot_race(curves, tmp_path / "race.png", "smoke")
    assert (tmp_path / "race.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.slow
def test_grpo_really_trains_the_frozen_model_es_loads(tmp_path):
    from copes.run.trainer import Trainer

    trainer = Trainer(vs_grpo.job_config(vs_grpo.Job(vs_grpo.GRPO, 0, 1e-3, 1.0, 1, EVAL_SIZE), str(tmp_path)),
                      progress=False)
    before = {name: p.detach().clone() for name, p in trainer.model.named_parameters()}
    curve = vs_grpo.grpo_curve(trainer, vs_grpo.Curve(vs_grpo.GRPO, 0, 1e-3), vs_grpo.TrainingClock(1.0, 1),
                               str(tmp_path))
    assert curve.steps >= 1
    assert any(not torch.equal(before[name], p) for name, p in trainer.model.named_parameters())


@pytest.mark.slow
def test_a_run_handed_its_before_accuracy_starts_there_and_ends_where_a_run_measuring_it_ends():
    """bench/real_model.py measures the untrained model once (a 0-step run) and hands the value to every cell."""
    fresh = vs_grpo.Job("CoPES", 0, None, float("inf"), 1, EVAL_SIZE, max_steps=1)
    before = vs_grpo.run_job(replace(fresh, max_steps=0))
    assert before.steps == 0 and before.seconds == [0.0] and len(before.accuracies) == 1
    measured = vs_grpo.run_job(fresh)
    assert vs_grpo.run_job(replace(fresh, before=before.accuracies[0])).accuracies == measured.accuracies
    marked = vs_grpo.run_job(replace(fresh, before=0.123))  # a value no evaluation gives: proof it was not redone
    assert marked.accuracies == [0.123, measured.accuracies[-1]] and marked.seconds[0] == 0.0


@pytest.mark.slow
def test_a_run_of_max_steps_spaces_its_evaluations_by_steps():
    """bench/real_model.py's equal-rollouts cells: a held-out point after every step (its clock has no budget to
    space them over). (One evaluation, the last step's only: the test above.)"""
    every_step = vs_grpo.run_job(vs_grpo.Job("CoPES", 0, None, float("inf"), 2, EVAL_SIZE, max_steps=2))
    assert every_step.steps == 2 and len(every_step.accuracies) == len(every_step.seconds) == 3
    assert every_step.seconds == sorted(every_step.seconds) and every_step.seconds[1] > 0


def test_training_clock_passes_every_mark_a_long_step_crosses():
    clock = vs_grpo.TrainingClock(budget_s=10.0, evaluations=5)
    clock.elapsed = 6.5
    assert clock.due() and clock.marks == [8.0, 10.0] and not clock.due() and not clock.over
    clock.elapsed = 10.0
    assert clock.due() and clock.over and clock.marks == []


def test_training_clock_counts_this_processs_cpu_seconds_and_keeps_wall_seconds_beside_them():
    clock = vs_grpo.TrainingClock(budget_s=1.0, evaluations=1)
    clock.start()
    time.sleep(0.3)  # waiting for a core (here: sleeping) costs a run no budget
    clock.stop()
    assert clock.wall_elapsed >= 0.3 > 0.1 > clock.elapsed
    clock.start()
    busy_until = time.process_time() + 0.2
    while time.process_time() < busy_until:
        pass
    clock.stop()
    assert clock.elapsed >= 0.2 and clock.wall_elapsed >= 0.5


def test_each_method_runs_its_own_preset_under_the_screening_overrides(tmp_path):
    from copes.config.options import read_yaml
    from copes.modeling import EMBEDDED_MODEL_DIR

    eggroll_preset = read_yaml(EMBEDDED_MODEL_DIR / "copes.eggroll.yaml")
    eggroll = vs_grpo.job_config(vs_grpo.Job("EGGROLL", 2, None, 1.0, 1, 8), str(tmp_path))
    assert eggroll.algorithm == "eggroll" and (eggroll.population, eggroll.seed, eggroll.eval_size) == (
        eggroll_preset["population"], 2, 8)
    screened = vs_grpo.job_config(vs_grpo.Job("EGGROLL", 0, None, 1.0, 1, 8, (("population", 8),)), str(tmp_path))
    assert screened.population == 8 and screened.sigma == eggroll_preset["sigma"]
    copes = vs_grpo.job_config(vs_grpo.Job("CoPES", 0, None, 1.0, 1, 8), str(tmp_path))
    assert copes.sigma == read_yaml(EMBEDDED_MODEL_DIR / "copes.yaml")["sigma"]
    assert vs_grpo._override("fitness=joint") == ("fitness", "joint")
    with pytest.raises(argparse.ArgumentTypeError, match="copes-run option"):
        vs_grpo._override("populaton=8")


def test_memory_of_one_grpo_update_exceeds_one_es_member():
    grpo = vs_grpo.measure_memory(("GRPO update", 128, 2, 4))
    member = vs_grpo.measure_memory(("ES member", 128, 2, 4))
    assert grpo["parameters"] == member["parameters"] > 4_000_000
    assert grpo["peak_mib"] > member["peak_mib"] > 0


@pytest.mark.slow
def test_the_default_run_writes_the_race_and_the_memory_measured_beside_it(tmp_path, monkeypatch, capsys):
    from common import harness

    for module in (harness, vs_grpo):
        monkeypatch.setattr(module, "RESULTS_DIR", tmp_path)
    vs_grpo.main(["--methods", "CoPES", "--seeds", "1", "--budget-s", "1", "--evaluations", "1", "--eval-size", "8",
                  "--workers", "1", "--lengths", "32", "--new-tokens", "2", "--name", "smoke"])
    written = {path.name for path in tmp_path.iterdir()}
    assert {"smoke.png", vs_grpo.MEMORY_PLOT_NAME} <= written
    assert any(name.startswith("smoke_curves") for name in written)
    assert any(name.startswith("vs_grpo_memory") for name in written)
    assert "bench/vs_grpo.py --part both took" in capsys.readouterr().out

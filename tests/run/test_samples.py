"""Rollout samples: samples.jsonl holds the best and worst member's transcripts on fixed questions every
--sample-every steps, changes nothing about the run, works for the batched population, drops what lies past a
resume point; --wandb logs metrics and the samples table offline."""

from __future__ import annotations

import json
import signal
from pathlib import Path

import pytest

from copes.run.samples import SAMPLES_FILE, RolloutSamples
from copes.tasks import get_task

from helpers.cli_runs import assert_same_weights, copes_run, final_weights, metrics_without_time

SAMPLE_PROMPTS = 3
pytestmark = pytest.mark.integration  # every test here starts copes-run


def _records(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / SAMPLES_FILE).read_text().splitlines()]


@pytest.mark.parametrize("algorithm", ["copes", "eggroll"])
def test_samples_are_the_best_and_worst_members_and_change_nothing(tmp_path, algorithm):
    sampled, plain = tmp_path / "sampled", tmp_path / "plain"
    common = ("--algorithm", algorithm, "--steps", "4", "--sample-prompts", str(SAMPLE_PROMPTS))
    result = copes_run(*common, "--sample-every", "2", "--output-dir", str(sampled))
    assert result.returncode == 0, result.stderr
    result = copes_run(*common, "--sample-every", "0", "--output-dir", str(plain))
    assert result.returncode == 0, result.stderr
    assert_same_weights(final_weights(sampled), final_weights(plain))
    assert metrics_without_time(sampled) == metrics_without_time(plain)
    assert (plain / SAMPLES_FILE).read_text() == ""

    metrics = {record["step"]: record for record in metrics_without_time(sampled)}
    records = _records(sampled)
    assert sorted({r["step"] for r in records}) == [2, 4]
    questions = [e.question for e in get_task("arithmetic").examples("validation", limit=SAMPLE_PROMPTS)]
    for step in (2, 4):
        for role, expected in (("best", metrics[step]["max_reward"]), ("worst", metrics[step]["min_reward"])):
            rows = [r for r in records if r["step"] == step and r["role"] == role]
            if not rows:  # every member scored alike: the best is also the worst, written once
                assert role == "worst" and metrics[step]["max_reward"] == metrics[step]["min_reward"]
                continue
            assert [r["question"] for r in rows] == questions  # the same fixed questions every time
            assert len({r["member"] for r in rows}) == 1 and 0 <= rows[0]["member"] < 4
            assert rows[0]["member_reward"] == pytest.approx(expected)
            for row in rows:
                assert row["prompt"] == row["question"] and row["completion"].startswith(row["model_text"])
                assert row["reward"] == (1.0 if row["correct"] else 0.0) and row["finished_by"] in ("eos", "length")


def test_a_resumed_run_keeps_the_samples_before_its_resume_point(tmp_path):
    path = tmp_path / SAMPLES_FILE
    lines = [json.dumps({"step": step, "role": "best"}) for step in (2, 4, 6)]
    path.write_text("\n".join(lines) + '\n{"step": 8, "ro')  # a torn last line from a crash
    examples = get_task("arithmetic").examples("validation", limit=2)
    samples = RolloutSamples(path, examples, every=2, keep_through_step=4)
    assert [r["step"] for r in samples.records] == [2, 4]
    assert [json.loads(line)["step"] for line in path.read_text().splitlines()] == [2, 4]
    assert samples.due(6) and not samples.due(5)
    assert RolloutSamples(None, examples, every=2).due(6)  # every rank rolls its members' samples out
    assert not RolloutSamples(path, examples, every=0).due(6)


def test_wandb_offline_logs_the_samples_table(tmp_path):
    pytest.importorskip("wandb", reason="W&B logging is the optional extra: pip install -e '.[wandb]'")
    out = tmp_path / "run"
    result = copes_run("--steps", "2", "--sample-every", "1", "--sample-prompts", "2", "--wandb",
                       "--output-dir", str(out),
                       env={"WANDB_MODE": "offline", "WANDB_SILENT": "true", "WANDB_DIR": str(out)})
    assert result.returncode == 0, result.stderr
    run_dirs = list((out / "wandb").glob("offline-run-*"))
    assert len(run_dirs) == 1 and list(run_dirs[0].glob("run-*.wandb"))
    tables = sorted((run_dirs[0] / "files" / "media" / "table").glob("samples_*.table.json"))
    assert len(tables) == 2
    table = json.loads(tables[0].read_text())
    assert {"step", "role", "member", "completion", "reward"} <= set(table["columns"])
    assert 1 <= len(table["data"]) <= 4  # best and worst x 2 questions (once when every member tied)


def test_wandb_without_the_package_is_one_line(tmp_path):
    blocker = tmp_path / "block"
    blocker.mkdir()
    (blocker / "wandb.py").write_text("raise ImportError('blocked for this test')\n")
    result = copes_run("--steps", "1", "--wandb", "--output-dir", str(tmp_path / "run"),
                       env={"PYTHONPATH": str(blocker)})
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        "error: W&B logging needs the wandb package: pip install 'copes[wandb]'"]


def test_a_step_resumed_midway_samples_its_best_and_worst_among_all_members(tmp_path):
    """Killed while step 2's last member is perturbed, the resumed run rolls the sample questions out for the best
    and worst members whose rewards came from the journal, and writes the samples the uninterrupted run wrote (it
    chose among the re-run members only)."""
    whole, parts = tmp_path / "whole", tmp_path / "parts"
    common = ("--steps", "2", "--sample-every", "1", "--sample-prompts", str(SAMPLE_PROMPTS))
    assert (result := copes_run(*common, "--output-dir", str(whole))).returncode == 0, result.stderr
    killed = copes_run(*common, "--output-dir", str(parts), env={"COPES_FAILPOINT": "member@8"})
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-2000:]
    resumed = copes_run(*common, "--output-dir", str(parts), "--resume", str(parts))
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert len({r["member"] for r in _records(whole) if r["step"] == 2}) == 2  # a best and a worst to find
    assert _records(parts) == _records(whole)
    assert_same_weights(final_weights(parts), final_weights(whole))

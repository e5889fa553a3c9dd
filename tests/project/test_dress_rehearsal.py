"""The dress rehearsal's smallest phase (bench/dress_rehearsal.py, docs/dress-rehearsal.md) end to end at reduced
width: the wrapper-layout Qwen3.5 is built from the 4B config fixture with the text model shrunk, `copes-run`
runs CoPES on the HF engine with the Python tool for two turns, and the phase records a measured peak RSS beside
the plan's peak for the same flags. The full rehearsal (4B, ~40 min) is not part of CI."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from helpers.paths import REPO


@pytest.mark.slow
@pytest.mark.integration
def test_the_rehearsals_copes_phase_runs_and_is_measured_against_the_plan(tmp_path):
    work = tmp_path / "work"
    done = subprocess.run(
        [sys.executable, str(REPO / "bench" / "dress_rehearsal.py"), "--reduced", "--model-dir",
         str(tmp_path / "model"), "--work", str(work), "--phases", "copes-hf", "replay"],
        capture_output=True, text=True, timeout=1200, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]
    report = json.loads((work / "rehearsal.json").read_text())
    phase = report["copes-hf"]
    assert phase["status"] == 0, (work / "copes-hf.log").read_text()[-3000:]
    assert phase["planned_gib"] > 0 and phase["peak_rss_gib"] > 0 and phase["wall_s"] > 0
    assert "score" in phase["phase_seconds"] and phase["overlap_saved_s"] >= 0  # what --overlap-scoring saved
    step = json.loads((work / "copes-hf" / "metrics.jsonl").read_text().splitlines()[0])
    assert "rewards/bench.common.rehearsal_reward:distinct_characters/mean" in step  # the instrument ran
    replay = report["replay"]
    assert replay["status"] == 0 and replay["bitwise"] is True and replay["planned_gib"] > 0
    assert [run["phases"] for run in report["runs"]] == [["copes-hf", "replay"]] and report["runs"][0]["wall_s"] > 0
    assert (tmp_path / "model" / "config.json").is_file()
    config = json.loads((tmp_path / "model" / "config.json").read_text())
    assert config["architectures"] == ["Qwen3_5ForConditionalGeneration"] and config["tie_word_embeddings"]


def test_the_rehearsal_reward_tells_completions_apart():
    """The instrument that makes the random 4B model's step apply an update (members whose tokens differ)."""
    sys.path.insert(0, str(REPO))
    from bench.common.rehearsal_reward import distinct_characters

    conversation = [{"role": "assistant", "content": "xyx"}, {"role": "tool", "content": None}]
    assert distinct_characters(["aab", conversation, ""]) == [2 / 3, 3 / 4, 0.0]  # "xyx " and ""

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

pytestmark = [pytest.mark.slow, pytest.mark.integration]


def test_the_rehearsals_copes_phase_runs_and_is_measured_against_the_plan(tmp_path):
    work = tmp_path / "work"
    done = subprocess.run(
        [sys.executable, str(REPO / "bench" / "dress_rehearsal.py"), "--reduced", "--model-dir",
         str(tmp_path / "model"), "--work", str(work), "--phases", "copes-hf"],
        capture_output=True, text=True, timeout=1200, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]
    phase = json.loads((work / "rehearsal.json").read_text())["copes-hf"]
    assert phase["status"] == 0, (work / "copes-hf.log").read_text()[-3000:]
    assert phase["planned_gib"] > 0 and phase["peak_rss_gib"] > 0 and phase["wall_s"] > 0
    assert (tmp_path / "model" / "config.json").is_file()
    config = json.loads((tmp_path / "model" / "config.json").read_text())
    assert config["architectures"] == ["Qwen3_5ForConditionalGeneration"] and config["tie_word_embeddings"]

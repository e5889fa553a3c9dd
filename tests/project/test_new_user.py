"""What a new user hits first, each answered: a hub id that is not cached while offline fails at once in one line,
a cached one loads without network, the banner names the method that runs, an eval size larger than the split is
said, and the summary reports training's own memory growth beside the process peak."""

from __future__ import annotations

import json
import shutil
import time

import pytest

from helpers.cli_runs import copes_run
from helpers.paths import REPO
from helpers.timing import seconds
from helpers.tiny_models import build_tiny_checkpoint

OFFLINE = {"HF_HUB_OFFLINE": "1"}


@pytest.mark.integration
def test_an_uncached_hub_model_offline_is_one_line_at_once(tmp_path):
    refused_at_once = seconds(lambda: copes_run("--sigma", "0", "--output-dir", str(tmp_path / "refused")))
    start = time.perf_counter()
    result = copes_run("--model", "Qwen/Qwen3.5-4B", "--steps", "1", "--output-dir", str(tmp_path / "run"),
                       env={**OFFLINE, "HF_HOME": str(tmp_path / "hf")})
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "not in the Hugging Face cache" in lines[0] and "hf download Qwen/Qwen3.5-4B" in lines[0]
    # Both pay the imports; the hub's retries (~40 s when they happened) would make this one several times slower.
    assert time.perf_counter() - start < 3 * refused_at_once


@pytest.mark.integration
def test_a_cached_hub_model_loads_offline(tmp_path):
    """The Hugging Face cache layout (models--org--name/refs/main -> snapshots/<commit>/) holding a local model."""
    commit = "0123456789abcdef0123456789abcdef01234567"
    repo = tmp_path / "hf" / "hub" / "models--someone--tiny-chat"
    shutil.copytree(build_tiny_checkpoint(tmp_path / "model"), repo / "snapshots" / commit)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    out = tmp_path / "run"
    result = copes_run("--model", "someone/tiny-chat", "--task", "countdown", "--no-tools", "--steps", "1",
                       "--output-dir", str(out), env={**OFFLINE, "HF_HOME": str(tmp_path / "hf")})
    assert result.returncode == 0, result.stderr
    assert json.loads((out / "summary.json").read_text())["steps"] == 1


@pytest.mark.integration
def test_banner_names_standard_es_for_one_subspace_and_eval_size_beyond_the_split_is_said(tmp_path):
    result = copes_run("--algorithm", "copes", "--subspaces", "1", "--population", "2", "--steps", "1",
                       "--eval-size", "2100", "--output-dir", str(tmp_path))
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("es on arithmetic: N=2 K=1 "), result.stdout
    assert "eval_size=2100 but the validation split of arithmetic has 2000 questions" in result.stderr
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert 0 <= summary["training_peak_memory_growth_bytes"] < summary["peak_memory_bytes"]


def test_the_embedded_models_preset_asks_for_no_more_questions_than_the_split_has():
    import yaml

    from copes.modeling import EMBEDDED_MODEL_DIR
    from copes.tasks import get_task

    preset = yaml.safe_load((EMBEDDED_MODEL_DIR / "copes.yaml").read_text())
    repo_config = yaml.safe_load((REPO / "configs" / "tiny-arithmetic-copes.yaml").read_text())
    validation = get_task(preset["task"]).examples("validation")
    assert preset["eval_size"] == repo_config["eval_size"] <= len(validation)

"""The embedded small model (copes/assets/small) and the script that trains it: the committed model answers both of
its tasks through copes' own evaluation, its tokenizer keeps a Countdown prompt short, and the script's smallest run
writes a loadable model."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from transformers import AutoTokenizer

from copes.modeling import EMBEDDED_MODELS, load_model, resolve_model_path
from copes.rollout import AgentConfig
from copes.rollout.templates import render_prompt_in_format
from copes.run.evaluation import evaluate
from copes.tasks.countdown import CountdownTask
from copes.tasks.synthetic import ArithmeticTask

from helpers.paths import REPO

SMALL = EMBEDDED_MODELS["small"]


def test_small_is_an_embedded_model_with_a_countdown_preset() -> None:
    assert resolve_model_path("small") == str(SMALL)
    assert "task: countdown" in (SMALL / "copes.yaml").read_text()
    assert (SMALL / "model.safetensors").stat().st_size <= 20 * 2**20  # the bound for an embedded model


def test_a_countdown_prompt_is_short_and_decodes_back_exactly() -> None:
    tokenizer = AutoTokenizer.from_pretrained(SMALL)
    task = CountdownTask(seed=0)
    example = task.examples("validation", 1)[0]
    prompt = render_prompt_in_format(tokenizer, [{"role": "user", "content": task.prompt(example)}], (), None)
    ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
    assert prompt.startswith("User: Using the numbers ") and prompt.endswith("Assistant:")
    assert len(ids) < 40  # the fixed text is three tokens, not ~80 characters' worth
    assert tokenizer.decode(ids) == prompt


@pytest.mark.parametrize(("task", "low", "high"),
                         [(ArithmeticTask(seed=0), 0.2, 0.5), (CountdownTask(seed=0), 0.15, 0.45)])
def test_the_committed_model_is_half_trained_on_both_tasks(task, low, high) -> None:
    """Held-out accuracy on 100 validation problems, as a copes-run evaluates: room for ES on both tasks (the
    README's 500-problem figures are 34.8% and 28.6%)."""
    model, tokenizer, _ = load_model("small", device="cpu")
    agent = AgentConfig.for_task(task, max_new_tokens=32, max_turns=1)
    result = evaluate(model, tokenizer, task, task.examples("validation", 100), agent_config=agent, batch_size=100,
                      progress=False)
    assert low <= result.accuracy <= high


@pytest.mark.slow
def test_the_training_scripts_smallest_run_writes_a_loadable_model(tmp_path) -> None:
    out = tmp_path / "small"
    command = [sys.executable, str(REPO / "examples" / "train_small_model.py"), "--out", str(out), "--threads", "1",
               "--num-layers", "1", "--hidden-size", "32", "--intermediate-size", "64", "--num-heads", "1",
               "--max-steps", "4", "--eval-every", "2", "--eval-size", "4", "--final-eval-size", "4"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=600, cwd=REPO)
    assert done.returncode == 0, done.stderr[-2000:]
    summary = json.loads((out / "training_summary.json").read_text())
    assert summary["steps_taken"] == 4 and [check["step"] for check in summary["checks"]] == [2, 4]
    assert set(summary["held_out"]) == {"arithmetic", "countdown"}
    model, tokenizer, _ = load_model(str(out), device="cpu")
    assert model.config.num_hidden_layers == 1 and tokenizer.convert_tokens_to_ids("<answer>") != tokenizer.unk_token_id

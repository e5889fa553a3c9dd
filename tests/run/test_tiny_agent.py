"""End to end on the embedded tool-using model (copes/assets/tiny-agent): `copes-run` with the tiny-agent configs,
where a model that really calls tools (not a scripted policy) drives the agent loop, the real sandbox runs its
programs during training, the real BM25 search answers its queries, budgets refuse the calls over them, every
observation is stored readable in samples.jsonl, and a run killed mid-turn (a tool call in flight) resumes to
the bitwise weights and metrics of the uninterrupted run."""

from __future__ import annotations

import json
import re
import signal
from pathlib import Path

import pytest

from copes.tools.agent_tools import NO_RESULTS

from helpers.cli_runs import assert_same_weights, copes_run, final_weights, metrics_without_time
from helpers.paths import REPO

pytestmark = [pytest.mark.integration, pytest.mark.slow]

SMALL = ["--model", "tiny-agent", "--steps", "2", "--population", "2", "--subspaces", "1", "--prompt-batch", "4",
         "--eval-size", "4", "--max-new-tokens", "32", "--sample-every", "1", "--sample-prompts", "4",
         "--checkpoint-every", "1"]
ARITHMETIC = ["--config", str(REPO / "configs" / "tiny-agent-arithmetic-copes.yaml"), *SMALL]
PROGRAM = re.compile(r"print\(([0-9+\-*]+)\)")


def _samples(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "samples.jsonl").read_text().splitlines()]


def _tool_calls(run_dir: Path) -> list[dict]:
    return [call for transcript in _samples(run_dir) for call in transcript["tool_calls"]]


@pytest.fixture(scope="module")
def arithmetic_run(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("tiny-agent-arithmetic")
    result = copes_run(*ARITHMETIC, "--output-dir", str(out), timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    return out


def test_the_sandbox_runs_the_models_programs_during_training(arithmetic_run: Path) -> None:
    calls = [call for call in _tool_calls(arithmetic_run) if call["name"] == "python" and call["valid"]]
    assert calls, "the model made no valid python call in the samples"
    for call in calls:
        program = PROGRAM.fullmatch(call["arguments"]["code"].strip())
        if program:  # the observation is what the sandbox printed: the expression's value
            assert call["observation"] == str(eval(program[1]))  # noqa: S307 - digits and + - * only
        assert call["observation"].strip()
    steps = [json.loads(line) for line in (arithmetic_run / "metrics.jsonl").read_text().splitlines()]
    assert all(step["time"]["tools"] > 0 for step in steps if "time" in step), "the sandbox did not run in a step"
    # The rows' calls run in parallel: the tools phase is their wall time, so generate (around it, minus it) stays >= 0.
    assert all(step["time"]["generate"] >= 0 for step in steps if "time" in step)


def test_a_run_killed_mid_turn_resumes_to_the_uninterrupted_result(arithmetic_run: Path, tmp_path: Path) -> None:
    """Killed on the model's 3rd tool call (step 1, inside a turn), the resumed run redoes that member's rollout
    and ends bitwise where the uninterrupted run ended."""
    killed = copes_run(*ARITHMETIC, "--output-dir", str(tmp_path), env={"COPES_FAILPOINT": "tool@3"}, timeout=600)
    assert killed.returncode == -signal.SIGKILL, (killed.returncode, killed.stderr[-2000:])
    resumed = copes_run(*ARITHMETIC, "--output-dir", str(tmp_path), "--resume", str(tmp_path), timeout=600)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert_same_weights(final_weights(tmp_path), final_weights(arithmetic_run))
    assert metrics_without_time(tmp_path) == metrics_without_time(arithmetic_run)


def test_two_hop_lookup_searches_and_the_budget_refuses_the_second_search(tmp_path: Path) -> None:
    """With one search allowed, two-hop questions get a real BM25 result for the first search and the budget's
    refusal for the second, both stored as the model was shown them."""
    result = copes_run("--config", str(REPO / "configs" / "tiny-agent-lookup-copes.yaml"), *SMALL,
                       "--task-options", "hops=2", "--tool-budgets", "search=1", "--tool-budgets", "python=1",
                       "--output-dir", str(tmp_path), timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    calls = [call for call in _tool_calls(tmp_path) if call["name"] == "search"]
    found = [call for call in calls if call["valid"]]
    refused = [call for call in calls if not call["valid"]]
    # A search the budget allows shows the real BM25 output: passages, or the tool's own line when none matched.
    assert any(call["observation"].startswith("Doc 1 (Title: ") for call in found)
    assert all(call["observation"].startswith("Doc 1 (Title: ") or call["observation"] == NO_RESULTS
               for call in found)
    # Invalid calls are the budget's refusals and the parser's errors for malformed calls, each shown as a line.
    assert all(call["observation"].startswith("Error: ") for call in refused)
    assert any(call["observation"] == "Error: the search budget of 1 calls is used up; continue without it."
               for call in refused)

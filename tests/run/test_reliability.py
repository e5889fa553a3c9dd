"""Crash safety: `kill -9` mid-member, mid-update and mid-checkpoint-write, then `--resume`, must end with weights
and metrics bitwise identical to an uninterrupted run; plus faults inside a real rollout (hostile tool calls)."""

from __future__ import annotations

import signal
from pathlib import Path

import pytest
from transformers import AutoModelForCausalLM

from copes.modeling import resolve_model_path

from helpers.cli_runs import MODEL, assert_same_weights, copes_run, final_weights, finished_run, metrics_without_time

STEPS = ["--steps", "3", "--checkpoint-every", "1"]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> Path:
    return finished_run(tmp_path_factory, *STEPS)


def _parameters_per_update() -> int:
    """The update passes the 'update' failpoint once per trainable tensor (tied weights count once)."""
    model = AutoModelForCausalLM.from_pretrained(resolve_model_path(MODEL))
    return len(list(model.parameters()))


@pytest.mark.integration
@pytest.mark.parametrize(
    "failpoint",
    [
        "member@6",  # step 2, member 2: its perturbation is in the weights (4 members a step)
        "update@+3",  # step 2's update, with 3 parameters already updated
        "checkpoint@2",  # the step-2 checkpoint half written
        "checkpoint@3",  # the last checkpoint half written, after every step ran
    ],
)
def test_kill_9_then_resume_matches_the_uninterrupted_run(failpoint, uninterrupted, tmp_path):
    if "@+" in failpoint:  # counted from the start of step 2's update
        name, extra = failpoint.split("@+")
        failpoint = f"{name}@{_parameters_per_update() + int(extra)}"
    killed = copes_run(*STEPS, "--output-dir", str(tmp_path), env={"COPES_FAILPOINT": failpoint})
    assert killed.returncode == -signal.SIGKILL, (killed.returncode, killed.stderr[-2000:])
    resumed = copes_run(*STEPS, "--output-dir", str(tmp_path), "--resume", str(tmp_path))
    assert resumed.returncode == 0, resumed.stderr
    assert_same_weights(final_weights(tmp_path), final_weights(uninterrupted))
    assert metrics_without_time(tmp_path) == metrics_without_time(uninterrupted)
    assert not list((tmp_path / "checkpoints").glob(".*.partial")), "a staging folder survived the retry"


HOSTILE_CODE = {
    "fork bomb": "import os\nwhile True:\n    os.fork()",
    "infinite loop": "while True:\n    pass",
    "escape": "open('/tmp/copes_escape_probe', 'w').write('x')",
    "flood": "print('x' * 100_000_000)",
}


def test_hostile_tool_calls_in_a_real_rollout_become_observations(tmp_path, data_dir):
    """A policy that attacks the sandbox in its first turn still gets observations, then answers and is scored."""
    import json

    from copes.rollout import AgentConfig, run_agent
    from copes.tasks import get_task
    from copes.tools import PythonSandbox, PythonTool

    from helpers.tiny_models import ScriptedPolicy, build_tiny_tokenizer

    tokenizer = build_tiny_tokenizer(tmp_path)
    task = get_task("gsm8k", data_dir=data_dir)
    example = task.examples("test", limit=1)[0]
    answer = f"<answer>\\boxed{{{example.golds[0]}}}</answer>"

    def script(prompt: str) -> str:
        if "<tool_response>" in prompt:
            return answer
        attack = next(name for name in HOSTILE_CODE if f"[{name}]" in prompt)
        return ("<tool_call>\n" + json.dumps({"name": "python", "arguments": {"code": HOSTILE_CODE[attack]}})
                + "\n</tool_call>")

    prompts = [f"[{name}] {task.prompt(example)}" for name in HOSTILE_CODE]
    tool = PythonTool(PythonSandbox(timeout_s=2.0, cpu_seconds=2, max_processes=16))
    trajectories = run_agent(ScriptedPolicy(tokenizer, script), tokenizer, prompts, tools=[tool],
                             config=AgentConfig.for_kind("math", max_turns=3, max_new_tokens=400))
    observations = {name: t.tool_calls[0].observation for name, t in zip(HOSTILE_CODE, trajectories)}
    assert "timed out" in observations["infinite loop"]
    assert "Read-only file system" in observations["escape"] or "Permission denied" in observations["escape"]
    assert len(observations["flood"]) < 10_000
    assert not Path("/tmp/copes_escape_probe").exists()
    for trajectory in trajectories:
        assert trajectory.finished_by == "eos" and task.score(trajectory.final_text, example).correct

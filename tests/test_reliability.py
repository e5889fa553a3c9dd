"""Crash safety: `kill -9` mid-member, mid-update and mid-checkpoint-write, then `--resume`, must end with weights
and metrics bitwise identical to an uninterrupted run; plus faults inside a real rollout (hostile tool calls)."""

from __future__ import annotations

import signal
from pathlib import Path

import pytest

from transformers import AutoModelForCausalLM

from cli_runs import MODEL, assert_same_weights, copes_run, final_weights, metrics_without_time
from copes.modeling import resolve_model_path

STEPS = ["--steps", "3", "--checkpoint-every", "1"]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("uninterrupted")
    result = copes_run(*STEPS, "--output-dir", str(out))
    assert result.returncode == 0, result.stderr
    return out


def _parameters_per_update() -> int:
    """The update passes the 'update' failpoint once per trainable tensor (tied weights count once)."""
    model = AutoModelForCausalLM.from_pretrained(resolve_model_path(MODEL))
    return len(list(model.parameters()))


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

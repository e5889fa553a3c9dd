"""--budget-hours holds within one member's time: the deadline is checked before each member of a step and before
each held-out batch, and a stop between members resumes bit-exactly, rolling out only the members not journaled.
Time is a counter the test advances by one second per member rollout, so the test is exact and fast."""

from __future__ import annotations

import types

import pytest

import copes.run.budget
import copes.run.evaluation
from copes.config.options import build_config
from copes.run.trainer import Trainer

from helpers.cli_runs import assert_same_weights, final_weights

# Scoring in line (overlap_scoring is on by default since #35): the fake clock advances inside `rewards_for`, which
# then runs between one member's budget check and the next; overlapped, it runs on a thread beside the next member.
SETTINGS = {"steps": 2, "population": 8, "subspaces": 2, "prompt_batch": 4, "eval_size": 0, "max_new_tokens": 8,
            "sample_every": 0, "device": "cpu", "seed": 3, "overlap_scoring": False}


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def perf_counter(self) -> float:
        return self.now


@pytest.fixture
def clock(monkeypatch):
    fake = Clock()
    for module in (copes.run.budget, copes.run.evaluation):
        monkeypatch.setattr(module, "time", types.SimpleNamespace(perf_counter=fake.perf_counter))
    return fake


def _trainer(out, clock: Clock, **settings) -> tuple[Trainer, list[int]]:
    trainer = Trainer(build_config({**SETTINGS, "output_dir": str(out), **settings}), progress=False)
    rollouts = []
    score = trainer.rewards_for

    def one_second_per_member(*args, **kwargs):
        rollouts.append(1)
        clock.now += 1.0
        return score(*args, **kwargs)

    trainer.rewards_for = one_second_per_member
    return trainer, rollouts


def test_the_budget_stops_between_members_and_the_step_resumes_bit_exactly(clock, tmp_path):
    reference, _ = _trainer(tmp_path / "reference", clock)
    reference.train()

    clock.now = 0.0
    stopped, rollouts = _trainer(tmp_path / "stopped", clock, budget_hours=2.5 / 3600)
    summary = stopped.train()
    # Members start at t = 0, 1, 2; the one due at t = 3 is past the 2.5 s budget and never starts.
    assert summary["stopped_by"] == "budget" and summary["steps"] == 0 and len(rollouts) == 3
    assert sorted(stopped.record.journal.recorded(1)) == [0, 1, 2]

    resumed, rollouts = _trainer(tmp_path / "stopped", clock)
    resumed.resume(str(tmp_path / "stopped"))
    assert resumed.train()["steps"] == 2
    assert len(rollouts) == 2 * 8 - 3  # only the members the journal lacked
    assert_same_weights(final_weights(tmp_path / "stopped"), final_weights(tmp_path / "reference"))


def test_the_steps_leave_the_final_evaluation_the_time_the_first_one_took(clock, tmp_path, monkeypatch):
    """A held-out evaluation takes 2 s here: with a 5.5 s budget the steps stop at 3.5 s (members start at 2 and
    3), and the final evaluation still runs over every question (without the reservation the members would run
    on to 6 s and the run would end with no accuracy after training)."""
    import copes.run.trainer

    evaluate = copes.run.trainer.evaluate

    def two_seconds(*args, **kwargs):
        clock.now += 2.0
        return evaluate(*args, **kwargs)

    monkeypatch.setattr(copes.run.trainer, "evaluate", two_seconds)
    trainer, rollouts = _trainer(tmp_path / "run", clock, budget_hours=5.5 / 3600, eval_size=4)
    summary = trainer.train()
    assert summary["stopped_by"] == "budget" and len(rollouts) == 2
    assert summary["eval_after"]["questions"] == 4 and summary["eval_after"]["accuracy"] is not None


def test_a_held_out_evaluation_past_the_deadline_starts_no_further_batch(clock):
    from copes.modeling import load_model
    from copes.rollout import AgentConfig
    from copes.tasks import get_task

    model, tokenizer, _ = load_model("tiny", device="cpu")
    task = get_task("arithmetic")
    examples = task.examples("test", limit=6)
    agent = AgentConfig.for_task(task, max_new_tokens=4)
    clock.now = 10.0
    result = copes.run.evaluation.evaluate(model, tokenizer, task, examples, agent_config=agent, batch_size=2,
                                           progress=False, deadline=5.0)
    assert result.n_examples == 2  # the first batch only
    assert copes.run.evaluation.evaluate(model, tokenizer, task, examples, agent_config=agent, batch_size=2,
                                         progress=False).n_examples == 6

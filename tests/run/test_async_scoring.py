"""Rewards off the critical path (`--overlap-scoring`, copes.run.scoring.MemberScoring): members scored on a
background thread while the next one generates give the same journal (member records in member order, the same
values) and bitwise the same weights as scoring in line, and a kill mid-step still resumes bitwise."""

from __future__ import annotations

import json
import signal
import threading
import time
from pathlib import Path

import pytest

from copes.config.options import build_config
from copes.rollout import Trajectory
from copes.run.journal import journal_path
from copes.run.scoring import MemberScoring, score_rollouts
from copes.tasks import get_task
from copes.timing import PhaseTimer

from helpers.cli_runs import assert_same_weights, copes_run, final_weights, metrics_without_time

STEPS = ["--steps", "2"]


def _journal_members(run_dir: Path) -> list[tuple[int, int, list[float]]]:
    """The member records in file order (each line is a CRC, a space, the JSON record)."""
    records = [json.loads(line.split(" ", 1)[1]) for line in journal_path(run_dir).read_text().splitlines()]
    return [(r["step"], r["member"], r["rewards"]) for r in records if r.get("kind") == "member"]


def test_background_scoring_records_every_member_in_order_with_the_in_line_rewards():
    task = get_task("gsm8k")
    examples = task.examples("test", limit=6)
    answers = [f"The answer is \\boxed{{{example.meta['answer'].split('####')[-1].strip()}}}" for example in examples]
    per_member = {member: [Trajectory("", final_text=text if (i + member) % 2 else "no idea")
                           for i, text in enumerate(answers)] for member in range(4)}
    recorded, threads = [], set()

    def record(member, rewards):
        recorded.append((member, rewards.tolist()))
        threads.add(threading.current_thread().name)

    with MemberScoring(task, examples, record) as scoring:
        for member, trajectories in per_member.items():
            scoring.submit(member, trajectories)
    assert [member for member, _ in recorded] == [0, 1, 2, 3]
    for member, rewards in recorded:
        assert rewards == [score.reward for score in score_rollouts(task, examples, per_member[member])]
    assert recorded[0][1] != recorded[1][1]  # the rewards tell members apart
    assert all(name.startswith("copes-scoring") for name in threads)


def test_the_timer_shows_what_overlapping_saved(monkeypatch):
    """#35's measurement: the scoring's seconds go to "score" and only the wait at the block's end to "score_wait",
    so a run's summary says what --overlap-scoring took off the critical path (score - score_wait)."""
    task = get_task("gsm8k")
    examples = task.examples("test", limit=2)
    score_batch = task.score_batch

    def slow_score_batch(*args, **kwargs):
        time.sleep(0.3)
        return score_batch(*args, **kwargs)

    monkeypatch.setattr(task, "score_batch", slow_score_batch)
    timer = PhaseTimer()
    with MemberScoring(task, examples, lambda member, rewards: None, timer) as scoring:
        for member in range(3):
            scoring.submit(member, [Trajectory("", final_text="no idea")] * len(examples))
            time.sleep(0.5)  # the next member's generation, during which the previous one is scored
    assert timer.seconds["score"] >= 0.9  # three members' scoring, each at least 0.3 s
    assert timer.seconds["score_wait"] < 0.2  # the last member was scored while "generating" too


@pytest.mark.integration
def test_overlapped_scoring_gives_the_in_line_journal_and_weights_bitwise(tmp_path):
    in_line, overlapped = tmp_path / "in_line", tmp_path / "overlapped"
    for run_dir, flags in ((in_line, ["--no-overlap-scoring"]), (overlapped, [])):
        result = copes_run(*STEPS, *flags, "--output-dir", str(run_dir))
        assert result.returncode == 0, result.stderr[-2000:]
    assert _journal_members(overlapped) == _journal_members(in_line)
    assert metrics_without_time(overlapped) == metrics_without_time(in_line)
    assert_same_weights(final_weights(overlapped), final_weights(in_line))
    # Killed with step 2's second member in the weights (its predecessor possibly still scoring), then resumed.
    killed = tmp_path / "killed"
    first = copes_run(*STEPS, "--output-dir", str(killed), env={"COPES_FAILPOINT": "member@6"})
    assert first.returncode == -signal.SIGKILL, first.stderr[-2000:]
    resumed = copes_run("--resume", str(killed))
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert _journal_members(killed) == _journal_members(in_line)
    assert_same_weights(final_weights(killed), final_weights(in_line))


def test_overlapped_scoring_is_the_default():
    """Guards #35: scoring in line kept reward scoring (~30% of a step in a published ES fork) on the critical
    path by default; the overlapped path is bitwise the same (the test above), so it is on unless turned off."""
    assert build_config({}).overlap_scoring is True
    assert build_config({"overlap_scoring": False}).overlap_scoring is False

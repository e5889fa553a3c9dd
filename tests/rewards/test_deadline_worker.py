"""The one deadline-worker (copes.rewards.deadline) behind user rewards and the math verifier, and the one
validation of reward outputs (issue #37)."""

from __future__ import annotations

import math
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from copes.rewards.deadline import DeadlineWorker, WorkerRaised, WorkerTimeout
from copes.rewards.functions import RewardCallFailed, RewardSet, validated

# A user's plain script, saved without `if __name__ == "__main__":`, with one reward in a module beside it and one
# defined in the script itself.
SCRIPT = '''
from copes.rewards.functions import RewardSet, WorkerReward
from helper_rewards import length

print("the script's top level ran", flush=True)


def shout(completions, **columns):
    return [float(c.isupper()) for c in completions]


rewards = RewardSet([("length", WorkerReward(length)), ("shout", WorkerReward(shout))])
print("rewards", rewards.score(["AB", "c"], ["", ""], [{}, {}])[0], flush=True)
'''


def test_reward_workers_never_re_run_the_callers_script(tmp_path: Path) -> None:
    """Guards: workers were spawned by multiprocessing, which re-imports a plain script's top level in each of them
    (the README's "From Python" example re-ran training inside every reward worker)."""
    (tmp_path / "helper_rewards.py").write_text("def length(completions, **columns):\n"
                                                "    return [float(len(c)) for c in completions]\n")
    (tmp_path / "train_script.py").write_text(SCRIPT)
    result = subprocess.run([sys.executable, "train_script.py"], cwd=tmp_path, capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.count("the script's top level ran") == 1, result.stdout + result.stderr[-2000:]
    assert "rewards [3.0, 1.0]" in result.stdout


def _sleepy(seconds: float) -> float:
    time.sleep(seconds)
    return seconds


def test_a_timeout_kills_the_worker_and_abandons_it_until_resumed() -> None:
    worker = DeadlineWorker(_sleepy, abandon_after_timeout=True)
    try:
        assert worker.call(0.0, timeout_s=60) == 0.0
        with pytest.raises(WorkerTimeout):
            worker.call(30.0, timeout_s=0.5)
        assert worker.process is None
        started = time.monotonic()
        with pytest.raises(WorkerTimeout, match="abandoned"):
            worker.call(0.0, timeout_s=60)
        assert time.monotonic() - started < 0.1
        worker.resume()
        assert worker.call(0.0, timeout_s=60) == 0.0
        with pytest.raises(WorkerRaised, match="TypeError"):
            worker.call("not seconds", timeout_s=60)
        assert worker.call(0.0, timeout_s=60) == 0.0  # a raising call leaves the worker serving
    finally:
        worker.close()


@pytest.mark.parametrize(("values", "message"), [
    (["1.0", 0.5], "returned str '1.0' among its rewards"),
    ([1.0, 2.0, 3.0], "returned 3 rewards for 2 completions"),
    ("1.0", "returned str '1.0', not a list of 2 rewards"),
])
def test_reward_outputs_are_numbers_one_per_completion(values: object, message: str) -> None:
    """Guards: strings like "1.0" passed as numbers; the wrong-length message was cut before the counts."""
    with pytest.raises(RewardCallFailed, match=message):
        validated(values, 2)


def test_nan_and_inf_are_invalid_with_one_warning_and_per_reward_statistics(capsys: pytest.CaptureFixture) -> None:
    """Guards: NaN was invalid without a warning; there was no per-reward breakdown."""
    assert validated([None, np.float32(0.5), True, 2], 4)[1:] == [0.5, 1.0, 2.0]
    rewards = RewardSet([("good", lambda completions, **kw: [1.0, 0.0]),
                         ("nan", lambda completions, **kw: [math.nan, math.inf])])
    rewards.score(["a", "b"], ["", ""], [{}, {}])
    rewards.score(["a", "b"], ["", ""], [{}, {}])
    warnings = [line for line in capsys.readouterr().err.splitlines() if line.startswith("warning: reward nan")]
    assert warnings == ["warning: reward nan returned NaN or inf for 2 of 2 completions; those rewards count as "
                        "invalid (return None to mark one on purpose)"]
    assert rewards.step_stats["good"].mean == 0.5 and rewards.step_stats["good"].rows == 4
    assert rewards.step_stats["nan"].mean is None and rewards.step_stats["nan"].last_error is not None
    rewards.new_step()
    assert rewards.step_stats["good"].rows == 0


def _loud(completions, **columns):
    print("x" * (1 << 20))  # a MiB a call, as a reward left printing its debugging would
    return [1.0 for _ in completions]


def test_a_reward_that_prints_a_mib_a_call_shows_only_the_cap_said_once(capfd: pytest.CaptureFixture) -> None:
    """Issue #54: a loud reward flooded the terminal (16 MiB in 3 small steps): each call's output is capped."""
    from copes.rewards.functions import WorkerReward
    from copes.user_code import OUTPUT_CAP_BYTES

    reward = WorkerReward(_loud)
    try:
        for _ in range(3):
            assert reward(["a", "b"]) == [1.0, 1.0]
    finally:
        reward.stop()
    err = capfd.readouterr().err
    assert len(err) < 3 * OUTPUT_CAP_BYTES + 500, len(err)
    assert err.count("only the first") == 1 and err.count("x" * OUTPUT_CAP_BYTES) == 3

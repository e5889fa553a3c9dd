"""One vLLM engine per rank: `copes-run --rollout-engine vllm` as 2 gloo ranks (torchrun's, or those `--workers 2`
starts) gives each rank its own in-process engine (vLLM's external-launcher mode), splits the members, gathers the
rewards and applies the same update everywhere: fp32, greedy, plain weights, the pair ends bitwise where one
process ends, and a pair killed mid-step resumes to the same weights.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed (pip install -e '.[vllm]'; see the README)")

from copes.run.journal import journal_path  # noqa: E402

from helpers.cli_runs import (  # noqa: E402
    FAST_FLAGS,
    MODEL,
    TORCHRUN_PAIR,
    assert_same_weights,
    copes_run,
    final_weights,
    metrics_without_time,
)

pytestmark = pytest.mark.vllm

VLLM_FLAGS = ["--rollout-engine", "vllm", "--vllm-cpu-weights", "plain", "--vllm-kv-cache-gib", "0.0625"]
STEPS = ["--steps", "3"]
POPULATION = 4  # FAST_FLAGS' --population
TIMEOUT_S = 900


def pair_command(launch: str, *args: str) -> list[str]:
    launcher, workers = (TORCHRUN_PAIR, []) if launch == "torchrun" else ([], ["--workers", "2"])
    return [*launcher, shutil.which("copes-run"), *args, *workers]


def pair_env() -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": "1"}


@pytest.fixture(scope="module")
def single(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("single")
    result = copes_run(*VLLM_FLAGS, *STEPS, "--output-dir", str(out), timeout=TIMEOUT_S)
    assert result.returncode == 0, result.stderr
    assert any(record.get("update_norm", 0) > 0 for record in metrics_without_time(out))
    return out


@pytest.mark.parametrize("launch", ["torchrun", "workers"])
def test_two_vllm_ranks_match_one_process_bitwise(launch: str, single: Path, tmp_path: Path) -> None:
    out = tmp_path / "pair"
    command = pair_command(launch, "--model", MODEL, *FAST_FLAGS, *VLLM_FLAGS, *STEPS, "--device", "cpu",
                           "--output-dir", str(out))
    pair = subprocess.run(command, capture_output=True, text=True, timeout=TIMEOUT_S, env=pair_env())
    assert pair.returncode == 0, pair.stderr[-3000:]
    assert pair.stderr.count("vLLM engine: max_model_len") == 2  # one engine per rank
    assert_same_weights(final_weights(out), final_weights(single))
    assert metrics_without_time(out) == metrics_without_time(single)


def _member_records(run_dir: Path) -> int:
    path = journal_path(run_dir)
    return path.read_bytes().count(b'"kind":"member"') if path.exists() else 0


def test_two_vllm_ranks_killed_mid_step_resume_bitwise(single: Path, tmp_path: Path) -> None:
    """Killed once step 1 is journaled and a member of step 2 is scored; `--resume` alone (its --workers 2 from
    the run's settings) ends with the single process's weights."""
    out = tmp_path / "pair"
    start = pair_command("workers", "--model", MODEL, *FAST_FLAGS, *VLLM_FLAGS, *STEPS, "--device", "cpu",
                         "--output-dir", str(out))
    group = subprocess.Popen(start, env=pair_env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                             start_new_session=True)
    deadline = time.monotonic() + TIMEOUT_S
    while _member_records(out) < POPULATION + 1 and group.poll() is None and time.monotonic() < deadline:
        time.sleep(0.01)
    assert group.poll() is None, "the pair finished before it could be killed"
    os.killpg(group.pid, signal.SIGKILL)
    group.wait()
    resumed = subprocess.run([shutil.which("copes-run"), "--resume", str(out)], capture_output=True, text=True,
                             timeout=TIMEOUT_S, env=pair_env())
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert_same_weights(final_weights(out), final_weights(single))
    assert metrics_without_time(out) == metrics_without_time(single)

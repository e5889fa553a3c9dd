"""The run journal: SIGKILL at many points (failpoints, several in a row, random wall-clock times) then
`copes-run --resume DIR` alone ends bitwise equal to an uninterrupted run with at most one member recomputed per
kill; `copes-replay` rebuilds any step bit for bit for every algorithm, restore mode and update precision; a torn
tail is dropped cleanly, while a flipped byte, a gap, another config or a changed base model is one sentence."""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from copes.config.options import ConfigError, build_config
from copes.es.strategies import CoPES
from copes.modeling import resolve_model_path
from copes.run.journal import (
    JournalContents,
    JournalWriter,
    check_same_run,
    encode,
    journal_path,
    read_journal,
    resume_config,
)
from copes.run.replay import replay_run, replay_steps
from copes.user_code import sha256_of

from helpers.cli_runs import (
    FAST_FLAGS,
    MODEL,
    TORCHRUN_PAIR,
    assert_same_weights,
    copes_run,
    final_weights,
    metrics_without_time,
)
from helpers.paths import FIXTURES, REPO

pytestmark = pytest.mark.integration  # nearly every test here reads a copes-run process's journal
# In-line scoring: the ledger's "at most the member in flight recomputed" is exact only then (overlapped scoring,
# the default, may lose the member being scored too; tests/run/test_async_scoring.py covers it).
STEPS = ["--steps", "3", "--no-overlap-scoring"]
POPULATION = 4  # FAST_FLAGS' --population


def _start(args: list[str], env: dict[str, str], stderr: Path) -> subprocess.Popen:
    """copes-run in the background, stderr to a file (a pipe nobody drains could block it)."""
    with stderr.open("w") as handle:
        return subprocess.Popen([shutil.which("copes-run"), *args], env={**os.environ, **env},
                                stdout=subprocess.DEVNULL, stderr=handle)


def _run_alone(run_dir: Path, env: dict[str, str]) -> tuple[int, str]:
    """`copes-run --resume DIR` with no other flag, to the end: the run continues with its own settings."""
    stderr = run_dir.parent / "resume.stderr"
    return _start(["--resume", str(run_dir)], env, stderr).wait(timeout=300), stderr.read_text()


def _rollouts(log: Path) -> int:
    return log.read_text().split().count("rollout") if log.exists() else 0


def _member_records(run_dir: Path) -> int:
    path = journal_path(run_dir)
    return path.read_bytes().count(b'"kind":"member"') if path.exists() else 0


class KillLedger:
    """Counts, per killed process, the rollouts it started that never reached the journal: the members a resume
    must recompute."""

    def __init__(self, run_dir: Path, logs: Path) -> None:
        self.run_dir, self.logs, self.lost = run_dir, logs, []
        logs.mkdir()

    def env(self) -> dict[str, str]:
        self._journaled = _member_records(self.run_dir)
        self._log = self.logs / f"{len(self.lost)}.log"
        return {"COPES_FAILPOINT_LOG": str(self._log)}

    def killed(self) -> None:
        self.lost.append(_rollouts(self._log) - (_member_records(self.run_dir) - self._journaled))


def _parameters_per_update() -> int:
    """The update passes the 'update' failpoint once per trainable tensor (tied weights count once)."""
    return len(list(AutoModelForCausalLM.from_pretrained(resolve_model_path(MODEL)).parameters()))


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> Path:
    """Three uninterrupted CoPES steps with the default checkpointing: one export, at the end."""
    out = tmp_path_factory.mktemp("reference")
    result = copes_run(*STEPS, "--output-dir", str(out))
    assert result.returncode == 0, result.stderr
    assert [p.name for p in (out / "checkpoints").glob("step-*")] == ["step-000003"]
    return out


def _assert_same_run(run_dir: Path, reference: Path) -> None:
    assert_same_weights(final_weights(run_dir), final_weights(reference))
    assert metrics_without_time(run_dir) == metrics_without_time(reference)


# ---------------------------------------------------------------- kills


def test_several_kills_in_a_row_then_resume_alone_is_bitwise_the_uninterrupted_run(reference, tmp_path):
    run_dir = tmp_path / "run"
    ledger = KillLedger(run_dir, tmp_path / "logs")
    kills = [
        "rollout@1",  # before the first step completes: the first member's rollout just started
        "journal@3",  # right after a member's record, before the next member (step 1)
        "member@2",  # step 2's first member, its perturbation in the weights
        f"update@{_parameters_per_update() + 3}",  # step 1 replayed, then step 2's update with 3 tensors written
        "checkpoint@1",  # the only checkpoint, at the end, half written: resume replays from the base model
    ]
    first = copes_run(*STEPS, "--output-dir", str(run_dir), env={**ledger.env(), "COPES_FAILPOINT": kills[0]})
    assert first.returncode == -signal.SIGKILL, first.stderr[-2000:]
    ledger.killed()
    for point in kills[1:]:
        status, stderr = _run_alone(run_dir, {**ledger.env(), "COPES_FAILPOINT": point})
        assert status == -signal.SIGKILL, (point, stderr[-2000:])
        ledger.killed()
    status, stderr = _run_alone(run_dir, ledger.env())
    assert status == 0, stderr[-2000:]
    assert ledger.lost == [1, 0, 1, 0, 0]
    assert sum(_rollouts(log) for log in ledger.logs.iterdir()) == 3 * POPULATION + sum(ledger.lost)
    _assert_same_run(run_dir, reference)
    assert not list((run_dir / "checkpoints").glob(".*.partial"))


@pytest.mark.slow
def test_random_wall_clock_kills_lose_at_most_the_member_in_flight(reference, tmp_path):
    run_dir, rng = tmp_path / "run", random.Random(14)
    ledger = KillLedger(run_dir, tmp_path / "logs")
    stderr = tmp_path / "stderr"
    process = _start(["--model", MODEL, *FAST_FLAGS, *STEPS, "--output-dir", str(run_dir)], ledger.env(), stderr)
    for _ in range(8):
        size_at_start = journal_path(run_dir).stat().st_size if journal_path(run_dir).exists() else -1
        # Once the journal grows the process is training; kill it a random moment later.
        while process.poll() is None and (not journal_path(run_dir).exists()
                                          or journal_path(run_dir).stat().st_size == size_at_start):
            time.sleep(0.01)
        time.sleep(rng.uniform(0.0, 0.6))
        if process.poll() is not None:
            break
        process.kill()
        process.wait()
        ledger.killed()
        process = _start(["--resume", str(run_dir)], ledger.env(), stderr)
    assert process.wait(timeout=300) == 0, stderr.read_text()[-2000:]
    assert ledger.lost and all(lost <= 1 for lost in ledger.lost), ledger.lost
    _assert_same_run(run_dir, reference)


@pytest.mark.slow
def test_subtract_restore_resumes_mid_step_bitwise(tmp_path):
    """Subtract restore leaves each member's rounding in the weights: skipped members are perturbed and
    restored again (without a rollout), so the resumed run is still the uninterrupted one."""
    flags = [*STEPS, "--restore", "subtract"]
    straight = copes_run(*flags, "--output-dir", str(tmp_path / "straight"))
    assert straight.returncode == 0, straight.stderr
    killed = copes_run(*flags, "--output-dir", str(tmp_path / "run"), env={"COPES_FAILPOINT": "journal@8"})
    assert killed.returncode == -signal.SIGKILL
    status, stderr = _run_alone(tmp_path / "run", {})
    assert status == 0, stderr[-2000:]
    _assert_same_run(tmp_path / "run", tmp_path / "straight")


@pytest.mark.slow
@pytest.mark.parametrize("launch", ["torchrun", "workers"])
def test_two_ranks_killed_mid_step_resume_bitwise(launch, reference, tmp_path):
    """Rank 0 journals its own members as they are scored and the other rank's after the gather; killing the
    whole process group mid-step and resuming with 2 ranks (torchrun's, or those `--workers 2` starts, which the
    resume takes from the run's own settings) ends with the single-process weights."""
    run_dir = tmp_path / "pair"
    launcher, workers = (TORCHRUN_PAIR, []) if launch == "torchrun" else ([], ["--workers", "2"])
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    start = [*launcher, shutil.which("copes-run"), "--model", MODEL, *FAST_FLAGS, *STEPS, "--device", "cpu",
             "--output-dir", str(run_dir), *workers]
    group = subprocess.Popen(start, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                             start_new_session=True)
    deadline = time.monotonic() + 300
    # Step 1 is complete and rank 0 has scored a member of step 2: the other rank's members are in flight.
    while _member_records(run_dir) < POPULATION + 1 and group.poll() is None and time.monotonic() < deadline:
        time.sleep(0.01)
    assert group.poll() is None, "the pair finished before it could be killed"
    os.killpg(group.pid, signal.SIGKILL)
    group.wait()
    resume = [*launcher, shutil.which("copes-run"), "--resume", str(run_dir)]
    resumed = subprocess.run(resume, capture_output=True, text=True, timeout=300, env=env)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    _assert_same_run(run_dir, reference)


# ---------------------------------------------------------------- replay


def _replayed(run_dir: Path, output: Path, step: int | None = None) -> dict[str, torch.Tensor]:
    replay_run(run_dir, output, step=step, progress=False)
    return load_file(str(output / "model.safetensors"))


def test_copes_replay_console_script_equals_the_final_checkpoint(reference, tmp_path):
    result = subprocess.run([shutil.which("copes-replay"), str(reference), "--output", str(tmp_path / "out")],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert "replayed 3 steps in" in result.stdout
    assert_same_weights(load_file(str(tmp_path / "out" / "model.safetensors")), final_weights(reference))
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "out")
    AutoTokenizer.from_pretrained(tmp_path / "out")
    assert all(torch.equal(t, final_weights(reference)[n])
               for n, t in model.state_dict().items() if n in final_weights(reference))


def test_replay_of_step_s_equals_a_run_stopped_at_s(reference, tmp_path):
    stopped = copes_run("--steps", "2", "--output-dir", str(tmp_path / "stopped"))
    assert stopped.returncode == 0, stopped.stderr
    assert_same_weights(_replayed(reference, tmp_path / "at-2", step=2), final_weights(tmp_path / "stopped"))
    with pytest.raises(ConfigError, match=r"--step 4 is outside the journal of .* which holds steps 0..3"):
        replay_run(reference, tmp_path / "past", step=4, progress=False)


RUN_VARIANTS = {
    "es": ["--algorithm", "es"],
    "eggroll": ["--algorithm", "eggroll"],
    "copes-lowrank": ["--algorithm", "copes-lowrank"],
    "host restore": ["--restore", "host"],
    "subtract restore": ["--restore", "subtract"],
    "bf16, stochastic rounding": ["--dtype", "bfloat16"],
    "antithetic pairs, adam": ["--antithetic", "--optimizer", "adam"],
}


@pytest.mark.parametrize("variant", [
    *(pytest.param(v) for v in ("es", "eggroll", "copes-lowrank", "antithetic pairs, adam")),
    *(pytest.param(v, marks=[pytest.mark.slow, pytest.mark.filterwarnings("ignore:restore='subtract'")])
      for v in ("host restore", "subtract restore", "bf16, stochastic rounding")),
])
def test_replay_equals_the_final_checkpoint(variant, tmp_path):
    run = copes_run("--steps", "2", *RUN_VARIANTS[variant], "--output-dir", str(tmp_path / "run"))
    assert run.returncode == 0, run.stderr
    assert_same_weights(_replayed(tmp_path / "run", tmp_path / "replayed"), final_weights(tmp_path / "run"))


@pytest.mark.parametrize("settings", [
    dict(optimizer="adam"),  # Adam's moments are rebuilt by the replayed updates (fp32 masters under Adam)
    dict(optimizer="adam", update_precision="master_host", dtype=torch.bfloat16),
    dict(update_precision="stochastic", dtype=torch.bfloat16),
    pytest.param(dict(update_precision="master_device", dtype=torch.bfloat16, restore="subtract"),
                 marks=pytest.mark.filterwarnings("ignore:restore='subtract'")),
])
def test_library_replay_rebuilds_weights_and_strategy_state(settings, tmp_path):
    """The tiny model scored on a real arithmetic text: the journal of 3 steps replayed onto the base model (and
    from a step-1 state) gives the same weights, fp32 masters and Adam moments bit for bit."""
    settings = dict(settings)
    dtype, restore = settings.pop("dtype", torch.float32), settings.pop("restore", "device")
    path = resolve_model_path(MODEL)
    tokenizer = AutoTokenizer.from_pretrained(path)
    tokens = tokenizer("12+7=19 40-3=37 6*8=48", return_tensors="pt").input_ids

    def fresh() -> tuple[torch.nn.Module, CoPES]:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()
        return model, CoPES(model, population=4, num_subspaces=2, sigma=0.03, lr=0.01, chunk_size=4096,
                            restore=restore, **settings)

    def log_likelihood(model: torch.nn.Module) -> float:
        return -float(model(tokens, labels=tokens).loss)

    model, strategy = fresh()
    contents = JournalContents(path=tmp_path / "journal", header={"config": {"population": 4}})
    states = []
    for step in range(1, 4):
        contents.members[step] = {m: strategy.evaluate_member(m, log_likelihood) for m in range(4)}
        contents.updates.append({"update_norm": strategy.apply_update(contents.rewards_of(step)).update_norm})
        states.append((strategy.state_dict(), {n: t.clone() for n, t in model.state_dict().items()}))
    for start in (0, 1):
        replayed_model, replayed = fresh()
        if start:
            replayed_model.load_state_dict(states[0][1])
            replayed.load_state_dict(states[0][0])
        replay_steps(replayed, contents, start + 1, 3, with_members=restore == "subtract", progress=False)
        assert_same_weights(replayed_model.state_dict(), states[-1][1])
        final_state, replayed_state = states[-1][0], replayed.state_dict()
        for key in ("master_weights", "adam"):
            assert (key in final_state) == (key in replayed_state)
        for name, tensor in final_state["master_weights"].items():
            assert torch.equal(tensor, replayed_state["master_weights"][name])
        if "adam" in final_state:
            assert replayed_state["adam"]["steps"] == final_state["adam"]["steps"] == 3
            for moment in ("exp_avg", "exp_avg_sq"):
                assert_same_weights(replayed_state["adam"][moment], final_state["adam"][moment])


# ---------------------------------------------------------------- a damaged or foreign journal


def _copy_run(reference: Path, tmp_path: Path) -> Path:
    copy = tmp_path / "copy"
    shutil.copytree(reference, copy)
    return copy


def test_a_torn_tail_is_dropped_at_every_cut_and_cut_off_before_the_next_append(reference, tmp_path):
    run_dir = _copy_run(reference, tmp_path)
    path = journal_path(run_dir)
    whole = path.read_bytes()
    last_start = whole.rstrip(b"\n").rfind(b"\n") + 1
    intact = read_journal(reference)
    without_last = whole[:last_start]
    for cut in range(last_start + 1, len(whole)):  # every prefix of the last record, newline excluded
        path.write_bytes(whole[:cut])
        contents = read_journal(run_dir)
        assert contents.torn and contents.valid_bytes == last_start
        assert contents.steps_done == intact.steps_done - 1 and contents.updates == intact.updates[:-1]
    writer = JournalWriter(path, keep_bytes=contents.valid_bytes)
    writer.append({"kind": "update", "step": 3, "record": intact.updates[-1]})
    writer.close()
    assert path.read_bytes() == without_last + encode({"kind": "update", "step": 3, "record": intact.updates[-1]})
    assert read_journal(run_dir).updates == intact.updates


def test_a_flipped_byte_in_a_middle_record_is_one_sentence(reference, tmp_path):
    run_dir = _copy_run(reference, tmp_path)
    path = journal_path(run_dir)
    lines = path.read_bytes().split(b"\n")
    lines[4] = lines[4].replace(b'"member":2', b'"member":3')  # still valid JSON: only the checksum can tell
    path.write_bytes(b"\n".join(lines))
    with pytest.raises(ConfigError, match=r"journal:5: record is corrupt \(checksum mismatch\)"):
        read_journal(run_dir)
    result = subprocess.run([shutil.which("copes-run"), "--resume", str(run_dir)], capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert result.stderr.strip().splitlines() == [f"error: {path}:5: record is corrupt (checksum mismatch)"]


def test_a_journal_with_a_gap_is_refused(reference, tmp_path):
    run_dir = _copy_run(reference, tmp_path)
    path = journal_path(run_dir)
    lines = path.read_bytes().split(b"\n")
    path.write_bytes(b"\n".join(lines[:4] + lines[5:]))  # step 1's member 2 is gone
    with pytest.raises(ConfigError, match=r"the journal has a gap: step 1 was updated without members \[2\]"):
        read_journal(run_dir)
    path.write_bytes(b"\n".join(lines[:6] + lines[7:]))  # step 1's update is gone
    with pytest.raises(ConfigError, match=r"a member record of step 2 where step 1 was expected"):
        read_journal(run_dir)


def test_a_replay_that_drifts_from_the_journal_is_refused(reference, tmp_path):
    """A correctly checksummed journal whose update norm the replay does not reproduce (another backend, another
    version) stops the replay at that step instead of writing other weights."""
    run_dir = _copy_run(reference, tmp_path)
    path = journal_path(run_dir)
    lines = path.read_bytes().split(b"\n")
    contents = read_journal(run_dir)
    record = {**contents.updates[0], "update_norm": contents.updates[0]["update_norm"] * 2}
    lines[6] = encode({"kind": "update", "step": 1, "record": record}).rstrip(b"\n")
    path.write_bytes(b"\n".join(lines))
    with pytest.raises(ConfigError, match=r"replaying step 1 gave update norm .* the run recorded"):
        replay_run(run_dir, tmp_path / "out", progress=False)


def test_resume_takes_the_runs_own_settings_and_lets_other_options_change(reference, tmp_path):
    cfg = resume_config(reference, {}, {"steps": 5, "population": None})
    assert (cfg.population, cfg.subspaces, cfg.sigma, cfg.steps, cfg.output_dir) == (4, 2, 0.03, 5, str(reference))
    with pytest.raises(ConfigError, match=r"continues that run in its own directory; --output-dir .* names another"):
        resume_config(reference, {}, {"output_dir": str(tmp_path)})
    with pytest.raises(ConfigError, match=r"belongs to a different run: chunk_size=4096 there, 512 here"):
        resume_config(reference, {"chunk_size": 512}, {})


def test_a_journal_from_before_an_option_existed_resumes_with_its_default(reference):
    header = read_journal(reference).header
    older = {**header, "config": {k: v for k, v in header["config"].items() if k not in ("antithetic", "optimizer")}}
    cfg = resume_config(reference, {}, {})
    check_same_run(reference, older, cfg)  # absent keys are the defaults the run had
    with pytest.raises(ConfigError, match=r"belongs to a different run: antithetic=False there, True here"):
        check_same_run(reference, older, build_config({**header["config"], "antithetic": True}))


def test_a_header_from_another_config_is_refused_in_one_line(reference):
    result = copes_run("--population", "8", "--resume", str(reference))
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert result.stderr.strip() == (f"error: --resume {reference} belongs to a different run: "
                                     "population=4 there, 8 here")


def test_a_base_model_that_changed_is_refused(tmp_path):
    model_dir = tmp_path / "model"
    shutil.copytree(resolve_model_path(MODEL), model_dir)
    killed = subprocess.run([shutil.which("copes-run"), "--model", str(model_dir), *FAST_FLAGS, "--steps", "2",
                             "--output-dir", str(tmp_path / "run")], capture_output=True, text=True, timeout=300,
                            env={**os.environ, "COPES_FAILPOINT": "journal@3"})
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-2000:]
    weights = load_file(str(model_dir / "model.safetensors"))
    name = next(iter(weights))
    weights[name] = weights[name].clone()
    weights[name].view(-1)[0] += 1
    save_file(weights, str(model_dir / "model.safetensors"), metadata={"format": "pt"})
    result = subprocess.run([shutil.which("copes-run"), "--resume", str(tmp_path / "run")], capture_output=True,
                            text=True, timeout=300)
    assert result.returncode == 2 and "Traceback" not in result.stderr
    message = result.stderr.strip().splitlines()
    assert len(message) == 1 and f"the base model {model_dir} changed since the run started" in message[0], message


# ---------------------------------------------------------------- the benchmark still runs


def test_journal_bench_measures_a_real_run_and_a_bitwise_replay(monkeypatch):
    """bench/journal_cost.py at a tiny size: the trainer's run, both resumes, copes-replay, and a 4-layer
    Qwen3.5-architecture model journaled and replayed (the script asserts the replay is bitwise the run)."""
    monkeypatch.syspath_prepend(str(REPO / "bench"))
    import journal_cost

    from common import models

    tiny, = journal_cost.measure_tiny(MODEL, steps=2, population=4, subspaces=2, prompt_batch=4)
    assert 0 < tiny["journal_B_per_step"] < tiny["checkpoint_B"]
    assert tiny["resume_journal_only_s"] > 0 and tiny["resume_from_checkpoint_s"] > 0
    shape = models.LargeModelShape(vocab_size=256, hidden_size=64, intermediate_size=128, num_layers=4)
    large, = journal_cost.measure_large(shape, steps=1, population=4, subspaces=2, prompt_batch=2, prompt_tokens=4,
                                        new_tokens=2)
    assert large["journal_B_per_step"] > 0 and large["replay_s_per_step"] > 0


def test_the_header_version_is_the_installed_distributions() -> None:
    """journal.py reads the version from package metadata (it may not import the package face, which sits above the
    durable run): the metadata and `copes.__version__` must agree, or the header would record a stale one."""
    import importlib.metadata

    import copes
    from copes.run.journal import copes_version

    assert copes_version() == importlib.metadata.version("copes") == copes.__version__


@pytest.mark.integration
def test_a_run_on_relative_data_files_resumes_from_any_directory(tmp_path: Path) -> None:
    """Data named relative to the working directory is journaled absolute, so `--resume` from another directory
    finds it (it said the data file "cannot be found any more" while printing its unchanged path)."""
    project, elsewhere = tmp_path / "project", tmp_path / "elsewhere"
    (project / "data").mkdir(parents=True)
    elsewhere.mkdir()
    rows = [json.dumps({"prompt": f"{a}+{b}=", "answer": str(a + b)}) + "\n" for a in range(10) for b in range(10)]
    (project / "data" / "sums.jsonl").write_text("".join(rows[:80]))
    (project / "data" / "held_out.jsonl").write_text("".join(rows[80:]))
    run = tmp_path / "run"
    first = copes_run("--task", "data/sums.jsonl", "--task-options", "chat=false",
                      "--task-options", "eval_file=data/held_out.jsonl", "--steps", "1", "--output-dir", str(run),
                      cwd=project)
    assert first.returncode == 0, first.stderr[-2000:]
    resumed = copes_run("--resume", str(run), "--steps", "2", cwd=elsewhere)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    config = read_journal(run).header["config"]
    assert config["task"] == str(project / "data" / "sums.jsonl")
    assert config["task_options"]["eval_file"] == str(project / "data" / "held_out.jsonl")
    assert len((run / "metrics.jsonl").read_text().splitlines()) == 2


def test_the_model_fingerprint_reads_each_tensor_in_place() -> None:
    """Hashing the base weights copies none of them: a copy of each tensor's bytes was a 1.2 GiB transient for
    Qwen3.5-4B's embedding, the 4B dress rehearsal's peak over its memory plan (docs/dress-rehearsal.md)."""
    import tracemalloc

    from copes.run.journal import model_fingerprint

    model = torch.nn.Embedding(8192, 2048, dtype=torch.bfloat16)  # 32 MiB
    tracemalloc.start()
    try:
        fingerprint = model_fingerprint(model)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 4 << 20, f"{peak / 2**20:.1f} MiB allocated while hashing a 32 MiB tensor"
    assert fingerprint == model_fingerprint(model)


@pytest.mark.integration
def test_a_changed_data_file_of_a_builtin_task_refuses_the_resume(tmp_path: Path) -> None:
    """copes' own tasks' local data files are hashed in the journal as a user's data file is: a resume after the
    GSM8K train file changed is refused in one line naming it (it resumed on other data without a word)."""
    data = tmp_path / "data"
    shutil.copytree(FIXTURES / "data", data)
    run, env = tmp_path / "run", {"COPES_DATA_DIR": str(data)}
    gsm8k = ["--task", "gsm8k", "--no-tools", "--eval-size", "0", "--output-dir", str(run)]
    first = copes_run(*gsm8k, "--steps", "1", env=env)
    assert first.returncode == 0, first.stderr[-2000:]
    train_file = data / "math" / "gsm8k_train.jsonl"
    assert read_journal(run).header["data_files"] == {str(train_file): sha256_of(train_file)}
    with train_file.open("a") as handle:
        handle.write(json.dumps({"question": "What is 1+1?", "answer": "#### 2"}) + "\n")
    resumed = copes_run("--resume", str(run), "--steps", "2", env=env)
    assert resumed.returncode == 2, resumed.stderr[-2000:]
    assert f"refused: the data file {train_file} changed since the run started" in resumed.stderr

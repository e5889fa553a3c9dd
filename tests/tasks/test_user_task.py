"""Your own task and reward: a JSONL file with its own field names and a user reward module (TRL's signature,
extra columns included) train through copes-run on the embedded model, alone and under --workers 2 (bitwise the
same weights), resume bitwise after SIGKILL, and refuse a resume once the reward module changed; a reward that
raises or hangs is invalid rewards and one warning; a hub-style dataset loads from a local `datasets` folder;
plugins (`--task MODULE:FACTORY`) and the Python API take user objects; and the rough edges a new user met
(resume of an --eval-size 0 run, a silent zero update, unreadable or too long prompts, carriage returns in logs,
a bare KeyError for an unknown config key) each have a test."""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import time
from pathlib import Path

import pytest

from copes.errors import ConfigError
from copes.rewards.functions import RewardSet, WorkerReward, resolve_reward
from copes.run.journal import read_journal

from helpers.cli_runs import FAST_FLAGS, MODEL, assert_same_weights, final_weights, metrics_without_time
from helpers.paths import REPO

EXAMPLE = REPO / "examples" / "my_task"
STEPS = ["--steps", "2"]

# The user's reward module: TRL's signature, reading its own columns (`result`, `level`) and `prompts`. Rewards
# are 100 * level + exact match, so the journal shows which function scored; a prompt that is not the row's own
# text makes it raise (that would be invalid rewards, which the test rules out).
REWARDS = '''
def level_and_exact(completions, prompts, question_text, result, level, **kwargs):
    if list(prompts) != list(question_text):
        raise ValueError("prompts are not the rows' own text")
    return [100.0 * lv + (c.strip() == r) for c, r, lv in zip(completions, result, level)]


def broken(completions, **kwargs):
    raise ValueError("no reward today")


def hangs(completions, **kwargs):
    import time
    time.sleep(600)


def constant(completions, **kwargs):
    return [0.5] * len(completions)
'''
PLUGIN = '''
from copes.tasks.file_task import FileTask


def make_task(**options):
    return FileTask("train.jsonl", prompt_field="question_text", answer_field="result", eval_file="eval.jsonl",
                    chat=False, **options)
'''
FILE_TASK = ["--task", "train.jsonl", "--task-options", "prompt_field=question_text", "--task-options",
             "answer_field=result", "--task-options", "eval_file=eval.jsonl", "--task-options", "chat=false"]
USER_REWARD = ["--reward", "user_rewards:level_and_exact"]


def _rows(count: int, offset: int) -> list[dict]:
    rows = []
    for index in range(offset, offset + count):
        left, right = (index * 37) % 90 + 10, (index * 53) % 90 + 5
        rows.append({"question_text": f"{left}+{right}=", "result": str(left + right), "level": len(str(left + right))})
    return rows


def _write_project(folder: Path) -> Path:
    """A user's folder: train/eval JSONL with their own field names, a reward module and a task plugin."""
    folder.mkdir(parents=True, exist_ok=True)
    for name, rows in (("train.jsonl", _rows(48, 0)), ("eval.jsonl", _rows(16, 100))):
        (folder / name).write_text("".join(json.dumps(row) + "\n" for row in rows))
    (folder / "user_rewards.py").write_text(REWARDS)
    (folder / "user_plugin.py").write_text(PLUGIN)
    return folder


def _run(cwd: Path, *args: str, env: dict[str, str] | None = None, timeout: float = 300) -> subprocess.CompletedProcess:
    """copes-run from the user's folder (their modules import from the working directory)."""
    return subprocess.run([shutil.which("copes-run"), "--model", MODEL, *FAST_FLAGS, *args], cwd=cwd,
                          capture_output=True, text=True, timeout=timeout, env={**os.environ, **(env or {})})


def _ok(result: subprocess.CompletedProcess) -> subprocess.CompletedProcess:
    assert result.returncode == 0, result.stderr[-3000:]
    return result


@pytest.fixture(scope="module")
def project(tmp_path_factory) -> Path:
    return _write_project(tmp_path_factory.mktemp("user"))


@pytest.fixture(scope="module")
def reference(project) -> Path:
    """Two steps on the JSONL file, scored by the user's TRL-signature reward."""
    _ok(_run(project, *STEPS, *FILE_TASK, *USER_REWARD, "--output-dir", "reference"))
    return project / "reference"


@pytest.mark.integration
def test_a_jsonl_file_with_its_own_fields_trains_with_a_user_reward(reference):
    records = metrics_without_time(reference)
    assert [r["step"] for r in records] == [1, 2]
    assert all(r["num_invalid_rewards"] == 0 for r in records)
    # TRL's per-reward breakdown, from the trainer's metrics (issue #37): the mean over the step's every row
    assert all(r["rewards/user_rewards:level_and_exact/mean"] >= 100 for r in records)
    contents = read_journal(reference)
    rewards = [value for step in contents.members.values() for member in step.values() for value in member.tolist()]
    assert len(rewards) == 2 * 4 * 8  # steps x population x questions
    assert all(value - 100 * round(value // 100) in (0.0, 1.0) and value >= 100 for value in rewards)  # 100*level+exact
    sources = contents.header["user_sources"]
    project = reference.parent  # the data files are journaled by absolute path (a resume may start anywhere)
    assert set(sources) == {f"data file {project / 'train.jsonl'}", f"data file {project / 'eval.jsonl'}",
                            "reward module user_rewards"}
    assert all(len(source["sha256"]) == 64 for source in sources.values())


@pytest.mark.integration
def test_two_workers_import_the_user_modules_and_end_bitwise_the_same(project, reference):
    """Every rank builds the task from a plugin factory and the reward from the module: the weights are bitwise
    those of the one-process run of the same rows and reward."""
    result = _ok(_run(project, *STEPS, "--task", "user_plugin:make_task", *USER_REWARD, "--workers", "2",
                      "--output-dir", "workers"))
    assert "unknown task" not in result.stderr
    assert_same_weights(final_weights(project / "workers"), final_weights(reference))
    assert metrics_without_time(project / "workers") == metrics_without_time(reference)


@pytest.mark.integration
def test_resume_after_a_kill_continues_bitwise(project, reference):
    killed = _run(project, *STEPS, *FILE_TASK, *USER_REWARD, "--output-dir", "killed",
                  env={"COPES_FAILPOINT": "journal@7"})
    assert killed.returncode == -9
    resumed = subprocess.run([shutil.which("copes-run"), "--resume", "killed"], cwd=project, capture_output=True,
                             text=True, timeout=300)
    _ok(resumed)
    assert_same_weights(final_weights(project / "killed"), final_weights(reference))


@pytest.mark.integration
def test_a_resume_after_editing_the_reward_module_is_refused_in_one_line(project, reference, tmp_path):
    copy = _write_project(tmp_path / "copy")
    shutil.copytree(reference, copy / "reference")
    with (copy / "user_rewards.py").open("a") as module:
        module.write("\n# tuned the reward\n")
    result = subprocess.run([shutil.which("copes-run"), "--resume", "reference"], cwd=copy, capture_output=True,
                            text=True, timeout=300)
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "reward module user_rewards" in lines[0] and "changed" in lines[0], result.stderr


@pytest.mark.integration
def test_a_reward_that_raises_is_invalid_rewards_one_warning_and_then_stops_the_run(project):
    """Guards (issue #37): a reward that failed on every call never stopped the run (exit 0, 0% -> 0%). It now
    stops after --invalid-reward-steps steps, non-zero, naming the reward as the user gave it and its last error."""
    result = _run(project, "--steps", "4", *FILE_TASK, "--reward", "user_rewards:broken", "--invalid-reward-steps",
                  "2", "--eval-size", "0", "--output-dir", "broken")
    assert result.returncode == 2, result.stderr[-3000:]
    warnings = [line for line in result.stderr.splitlines() if line.startswith("warning: reward user_rewards:broken")]
    assert len(warnings) == 1 and "ValueError: no reward today" in warnings[0]
    assert result.stderr.strip().splitlines()[-1] == (
        "error: reward user_rewards:broken was invalid for every row in 2 consecutive steps (last: raised "
        "ValueError: no reward today); stopping (--invalid-reward-steps 0 never stops)")
    records = metrics_without_time(project / "broken")
    assert [r["step"] for r in records] == [1, 2] and all(r["num_invalid_rewards"] == 4 * 8 for r in records)
    assert all(r["rewards/user_rewards:broken/mean"] is None for r in records)


@pytest.mark.integration
def test_a_reward_that_hangs_times_out_into_invalid_rewards(project):
    result = _ok(_run(project, "--steps", "1", "--population", "2", "--subspaces", "1", "--eval-size", "0",
                      *FILE_TASK, "--reward", "user_rewards:hangs", "--reward-timeout-s", "1", "--output-dir", "hangs"))
    warnings = [line for line in result.stderr.splitlines() if "reward user_rewards:hangs" in line]
    assert len(warnings) == 1 and "within 1s" in warnings[0]
    assert metrics_without_time(project / "hangs")[0]["num_invalid_rewards"] == 2 * 8


@pytest.mark.integration
def test_a_hub_style_dataset_loads_from_a_local_datasets_folder(project, tmp_path):
    datasets = pytest.importorskip("datasets")
    folder = tmp_path / "saved"
    datasets.DatasetDict({"train": datasets.Dataset.from_list(_rows(24, 0)),
                          "validation": datasets.Dataset.from_list(_rows(8, 100))}).save_to_disk(str(folder))
    from copes.tasks.plugins import build_task

    options = {"prompt_field": "question_text", "answer_field": "result", "chat": False}
    task = build_task(f"hf:{folder}", options)
    train, held_out = task.examples("train"), task.examples("validation")
    assert [e.question for e in train] == [r["question_text"] for r in _rows(24, 0)]
    assert held_out[0].meta["level"] == _rows(8, 100)[0]["level"]  # every other column travels with the row
    # A folder of data files (what `load_dataset` reads from a local directory or a downloaded hub repo).
    files = tmp_path / "files"
    files.mkdir()
    for split, rows in (("train", _rows(6, 0)), ("test", _rows(4, 100))):
        (files / f"{split}.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    from_files = build_task(f"hf:{files}", {**options, "eval_split": "test"})
    assert [e.golds for e in from_files.examples("test")] == [(r["result"],) for r in _rows(4, 100)]
    result = _ok(_run(project, "--steps", "1", "--eval-size", "8", "--task", f"hf:{folder}", "--task-options",
                      "prompt_field=question_text", "--task-options", "answer_field=result", "--task-options",
                      "chat=false", *USER_REWARD, "--output-dir", "hub"))
    assert "held-out accuracy" in result.stdout
    assert f"dataset folder {folder}" in read_journal(project / "hub").header["user_sources"]


@pytest.mark.integration
def test_an_eval_size_0_run_resumes_and_warns_about_zero_updates_in_plain_lines(project):
    """Every member scores the same (a constant reward): one warning says no update was applied and why; the
    progress goes to the log as plain lines; and the run resumes without a traceback."""
    args = ["--steps", "2", "--eval-size", "0", *FILE_TASK, "--reward", "user_rewards:constant", "--output-dir", "flat"]
    flags = [flag for flag in FAST_FLAGS if flag != "--quiet"]
    first = subprocess.run([shutil.which("copes-run"), "--model", MODEL, *flags, *args], cwd=project,
                           capture_output=True, text=True, timeout=300)
    _ok(first)
    zero = [line for line in first.stderr.splitlines() if "applied no update" in line]
    assert len(zero) == 1 and "every member scored the same" in zero[0]
    assert "\r" not in first.stderr
    assert "copes on train.jsonl: 2/2" in first.stderr  # the plain progress line of the last step
    again = subprocess.run([shutil.which("copes-run"), "--resume", "flat", "--steps", "3", "--quiet"], cwd=project,
                           capture_output=True, text=True, timeout=300)
    _ok(again)
    assert "Traceback" not in again.stderr and "no held-out evaluation" in again.stdout
    assert [r["step"] for r in metrics_without_time(project / "flat")] == [1, 2, 3]


@pytest.mark.integration
def test_the_example_runs_on_the_embedded_model(tmp_path):
    result = subprocess.run([shutil.which("copes-run"), "--config", "my_task.yaml", "--steps", "2", "--eval-size", "16",
                             "--output-dir", str(tmp_path / "run"), "--quiet"], cwd=EXAMPLE, capture_output=True,
                            text=True, timeout=300)
    _ok(result)
    records = metrics_without_time(tmp_path / "run")
    assert len(records) == 2 and all(r["num_invalid_rewards"] == 0 and not r["zero_update"] for r in records)
    assert "held-out accuracy" in result.stdout


# ---------------------------------------------------------------------------------------------------------
# In process: the reward machinery, the Python API, the start-up warnings.


def _raises_on_marker(completions, **kwargs):
    if "boom" in completions:
        raise RuntimeError("boom")
    if "hang" in completions:
        time.sleep(600)
    return [float(len(c)) for c in completions]


def test_worker_rewards_survive_exceptions_and_hangs_with_one_warning(capsys):
    """A hung reward is abandoned for the rest of the step after its first timeout (issue #37: it cost the full
    timeout on every call, about 20 minutes per step at the defaults), and serves again from the next step."""
    rewards = RewardSet([("marker", WorkerReward(_raises_on_marker, timeout_s=1.0))])
    assert rewards.score(["ab", "c"], ["", ""], [{}, {}])[0] == [2.0, 1.0]
    assert all(math.isnan(v) for v in rewards.score(["boom"], [""], [{}])[0])
    assert all(math.isnan(v) for v in rewards.score(["hang"], [""], [{}])[0])
    started = time.monotonic()
    assert all(math.isnan(v) for v in rewards.score(["abc"], [""], [{}])[0])  # abandoned: no second timeout
    assert time.monotonic() - started < 0.5
    rewards.new_step()
    assert rewards.score(["abc"], [""], [{}])[0] == [3.0]  # a fresh worker after the hung one was killed
    warnings = [line for line in capsys.readouterr().err.splitlines() if line.startswith("warning: reward marker")]
    assert len(warnings) == 1 and "RuntimeError: boom" in warnings[0]


def test_a_lambda_reward_runs_in_a_forked_worker_and_none_is_invalid():
    rewards = RewardSet([("lambda", WorkerReward(lambda completions, **kw: [None if c == "x" else 1.0
                                                                            for c in completions]))])
    totals, _ = rewards.score(["x", "y"], ["", ""], [{}, {}])
    assert math.isnan(totals[0]) and totals[1] == 1.0


def test_builtin_rewards_by_name_and_weights():
    rows = [{"answer": "7"}, {"answer": "8"}]
    weighted = RewardSet([resolve_reward("exact", answer_field="answer"),
                          resolve_reward("format", answer_field="answer")], [2.0, 1.0])
    totals, first = weighted.score(["<answer>\\boxed{7}</answer>", "9"], ["", ""], rows)
    assert first == [1.0, 0.0] and totals == [2.0, -1.0]
    with pytest.raises(ConfigError, match="unknown reward 'nope'"):
        resolve_reward("nope", answer_field="answer")
    with pytest.raises(ConfigError, match="cannot import no_such_module"):
        resolve_reward("no_such_module:f", answer_field="answer")


def test_the_python_api_takes_a_task_object_and_reward_callables(project, tmp_path, monkeypatch):
    import copes
    from copes.tasks.file_task import FileTask

    monkeypatch.chdir(project)
    task = FileTask("train.jsonl", prompt_field="question_text", answer_field="result", chat=False)
    summary = copes.train({"model": MODEL, "steps": 1, "population": 2, "subspaces": 1, "prompt_batch": 4,
                           "max_new_tokens": 4, "eval_size": 0, "output_dir": str(tmp_path / "api")},
                          task=task, reward=[lambda completions, result, **kw: [float(c.strip() == r)
                                                                               for c, r in zip(completions, result)]])
    assert summary["steps"] == 1
    assert summary["config"]["task"] == "train" and summary["config"]["reward"][0].endswith("<lambda>")


def test_an_unknown_config_key_is_one_line_naming_the_valid_keys():
    import copes

    with pytest.raises(ConfigError) as error:
        copes.train({"tsak": "gsm8k"})
    message = str(error.value)
    assert "'tsak'" in message and "valid keys:" in message and "task_options" in message and "\n" not in message


def test_startup_warnings_name_unreadable_and_too_long_prompts(tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from copes.config.components import startup_warnings
    from copes.modeling import resolve_model_path
    from copes.tasks.file_task import FileTask

    path = resolve_model_path("tiny")
    tokenizer, model = AutoTokenizer.from_pretrained(path), AutoModelForCausalLM.from_pretrained(path)
    prompts = {"letters": "Natalia sold clips to 48 of her friends in April.", "long": "+".join(["12"] * 40) + "=",
               "fine": "12+34="}
    for name, prompt in prompts.items():
        (tmp_path / f"{name}.jsonl").write_text(json.dumps({"prompt": prompt, "answer": "0"}) + "\n")

    def warnings_for(name: str) -> list[str]:
        task = FileTask(str(tmp_path / f"{name}.jsonl"), chat=False)
        return startup_warnings(task, task.examples("train"), tokenizer, model)

    assert [line for line in warnings_for("letters") if "UNK/EOS" in line]
    assert [line for line in warnings_for("long") if "longer than the model's 64 positions" in line]
    assert warnings_for("fine") == []


def test_rewards_replace_a_registered_tasks_scoring_and_read_gsm8k_golds():
    from copes.tasks.plugins import build_task

    task = build_task("arithmetic", {"train_size": 4, "validation_size": 0, "test_size": 0}, rewards=["exact"],
                      reward_weights=[3.0])
    example = task.examples("train")[0]
    right, wrong = task.score_batch([example.golds[0], "x"], [example, example])
    assert (right.reward, right.correct, wrong.reward, wrong.correct) == (3.0, True, 0.0, False)
    assert task.chat is False and task.name == "arithmetic"  # the rest is the task's own
    exact = RewardSet([resolve_reward("exact", answer_field="answer")])
    assert exact.score(["<answer>72</answer>"], [""],
                       [{"answer": "Natalia sold 48+24 = 72 clips.\n#### 72"}])[0] == [1.0]


def test_reward_settings_are_checked_in_one_line():
    from copes.config.options import build_config

    with pytest.raises(ConfigError, match="gives 2 weights for 1"):
        build_config({"reward": ["exact"], "reward_weights": "1,0.5"})
    assert build_config({"reward": ["exact", "format"], "reward_weights": "1,0.5"}).reward_weights == [1.0, 0.5]
    with pytest.raises(ConfigError, match="unknown task 'nosuch'"):
        from copes.config.components import task_from_config

        task_from_config(build_config({"task": "nosuch"}))


def test_a_reward_module_that_fails_to_import_is_one_line(tmp_path, monkeypatch):
    (tmp_path / "typo_rewards.py").write_text("def score(completions, **kwargs)\n    return []\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ConfigError, match=r"importing typo_rewards failed \(SyntaxError"):
        resolve_reward("typo_rewards:score", answer_field="answer")
    with pytest.raises(ConfigError, match="has no 'nothing'"):
        resolve_reward("json:nothing", answer_field="answer")


def test_copes_eval_takes_the_same_task_and_reward_specs(project, monkeypatch):
    from click.testing import CliRunner

    from copes.cli import eval_command

    monkeypatch.chdir(project)
    result = CliRunner().invoke(eval_command, ["--model", MODEL, *FILE_TASK, *USER_REWARD, "--split", "validation",
                                               "--limit", "4", "--max-new-tokens", "4", "--cpu-threads", "1"])
    assert result.exit_code == 0, result.output
    row = next(line for line in result.output.splitlines() if line.startswith("| train.jsonl "))
    assert float(row.split("|")[4]) >= 200  # the mean reward is the user's 100 * level + exact, level >= 2


def test_the_embedded_model_on_gsm8k_is_warned_about_at_start(tmp_path, capsys):
    import copes

    copes.train({"model": MODEL, "task": "gsm8k", "steps": 0, "eval_size": 0, "tools": False, "population": 2,
                 "subspaces": 1, "output_dir": str(tmp_path)})
    warnings = [line for line in capsys.readouterr().err.splitlines() if "UNK/EOS" in line]
    assert len(warnings) == 1 and "of gsm8k's prompt tokens" in warnings[0]


def test_a_file_tasks_mistakes_are_one_line_that_says_the_fix(tmp_path):
    """A task-option typo names the valid options (it leaked `FileTask.__init__() got an unexpected keyword
    argument`); an answer column no row has is refused at start (it ran, every row scoring 0); a task without
    held-out rows says how to give them or to train without (it said only that there were none)."""
    from copes.config.components import eval_examples
    from copes.config.options import build_config
    from copes.tasks.plugins import build_task

    data = tmp_path / "rows.jsonl"
    data.write_text("".join(json.dumps({"question": f"{n}+1=", "result": str(n + 1)}) + "\n" for n in range(5)))
    with pytest.raises(ConfigError, match=r"^unknown task option\(s\) prompt_feild for a data file or hub task; its "
                                          r"options are answer_field, chat, eval_file, eval_split, prompt_field"):
        build_task(str(data), {"prompt_feild": "question"})
    with pytest.raises(ConfigError, match=r"no row has the answer column 'answer' \(task option answer_field=\); "
                                          r"its columns are \['question', 'result'\]"):
        build_task(str(data), {"prompt_field": "question"})
    task = build_task(str(data), {"prompt_field": "question", "answer_field": "result", "chat": False})
    with pytest.raises(ConfigError, match="no held-out split to evaluate on: give held-out rows .*eval_file=FILE.*"
                                          "or --eval-size 0"):
        eval_examples(task, build_config({"task": str(data), "eval_size": 4}), warn=False)


def test_a_file_task_scored_by_a_user_reward_needs_no_answer_column(tmp_path):
    """The default reward reads the gold column, so a file without one is refused; a user reward that does not read
    it replaces the default before the check."""
    from copes.tasks.plugins import build_task

    data = tmp_path / "rows.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"{n}+1="}) + "\n" for n in range(3)))
    with pytest.raises(ConfigError, match="no row has the answer column 'answer'"):
        build_task(str(data), {})
    assert build_task(str(data), {}, rewards=["format"]).rewards.labels == ["format"]

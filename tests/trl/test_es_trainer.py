"""copes.ESTrainer / ESConfig: TRL's GRPOTrainer surface over copes' Trainer (issue 36, docs/from-trl.md)."""

from __future__ import annotations

import importlib
import json
import math

import pytest
import torch
from transformers import AutoModelForCausalLM

from copes import ESConfig, ESTrainer
from copes.errors import ConfigError
from copes.rollout.hf_engine import HFEngine
from copes.run.journal import read_journal
from copes.trl.trainer import REFUSED
from copes.user_code import sha256_of

from helpers.tiny_models import ScriptedPolicy, build_tiny_checkpoint, build_tiny_tokenizer
from helpers.trl_twin import (
    SHARED_KEYS,
    TINY,
    StopAfter,
    answer_column_reward,
    arithmetic_rows,
    contents_tokenizer,
    train_twin,
)

# The ES side of the twin script: a population of 2 on 4 questions, so 2 steps take seconds.
ES_FIELDS = dict(population_size=2, num_subspaces=1, prompt_batch_size=4, sigma=0.01, chunk_size=4096, eval_size=0)


def small_run(output_dir, **fields):
    fields = {**ES_FIELDS, "max_steps": 2, "max_completion_length": 4, **fields}
    args = ESConfig(output_dir=str(output_dir), logging_steps=1, learning_rate=0.0025, seed=0, **fields)
    return dict(model=TINY, reward_funcs=[answer_column_reward], args=args, train_dataset=arithmetic_rows(False))


def weights(trainer):
    return {name: tensor.clone() for name, tensor in trainer.model.state_dict().items()}


def assert_bitwise_equal(first, second):
    assert first.keys() == second.keys()
    for name in first:
        assert torch.equal(first[name], second[name]), name


# ---- the same script through GRPOTrainer and ESTrainer -----------------------------------------------------------
@pytest.mark.slow
@pytest.mark.parametrize("conversational", [True, False], ids=["conversational", "standard"])
def test_one_script_trains_with_grpo_and_with_es(tmp_path, conversational):
    """Only the import line and each config's own fields differ: both train 2 steps on the embedded model with the
    same data (extra columns), rewards (TRL's accuracy_reward, a user function reading a column) and callback, and
    both log GRPO's shared keys, `rewards/<name>/mean` and `/std` for every reward function included."""
    from trl import GRPOConfig, GRPOTrainer

    grpo, grpo_recorder = train_twin(GRPOTrainer, GRPOConfig, conversational=conversational,
                                     output_dir=str(tmp_path / "grpo"), per_device_train_batch_size=4,
                                     num_generations=2, use_cpu=True)
    es, es_recorder = train_twin(ESTrainer, ESConfig, conversational=conversational, output_dir=str(tmp_path / "es"),
                                 **ES_FIELDS)
    names = ["accuracy_reward", "answer_column_reward"] if conversational else ["answer_column_reward"]
    keys = [*SHARED_KEYS, *(f"rewards/{name}/{statistic}" for name in names for statistic in ("mean", "std"))]
    for recorder in (grpo_recorder, es_recorder):
        assert recorder.events == ["train_begin", "step_end 1", "step_end 2", "train_end"]
        step_logs = [logs for logs in recorder.logs if "reward" in logs]
        assert len(step_logs) == 2
        for logs in step_logs:
            assert set(keys) <= set(logs), sorted(set(keys) - set(logs))
    es_steps = [entry for entry in es.state.log_history if "reward" in entry]
    assert [entry["step"] for entry in es_steps] == [1, 2]
    for entry in es_steps:
        assert 0.0 <= entry["reward"] <= 1.0 and entry["completions/mean_length"] > 0
        assert 0.0 <= entry["frac_reward_zero_std"] <= 1.0
    # the per-step reward is the population's mean over the journaled member rewards
    assert math.isclose(es_steps[0]["reward"], read_journal(tmp_path / "es").rewards_of(1).mean().item(), rel_tol=1e-9)
    assert grpo.state.global_step == es.state.global_step == 2


# ---- refused and mistaken arguments: one line each ----------------------------------------------------------------
@pytest.mark.parametrize("argument", sorted(REFUSED))
def test_gradient_only_arguments_are_refused_in_one_line(tmp_path, argument):
    """Each GRPOTrainer argument that only a gradient trainer uses is refused before anything loads, saying why."""
    with pytest.raises(ConfigError) as refused:
        ESTrainer(**small_run(tmp_path), **{argument: object()})
    message = str(refused.value)
    assert "\n" not in message and message.startswith(f"ESTrainer refuses {argument}: ")


@pytest.mark.parametrize("mistake, expected", [
    (dict(reward_funcs=["my-org/reward-model"]), "not reward models"),
    (dict(reward_funcs=[torch.nn.Linear(2, 1)]), "reward model"),
    (dict(environment_factory={"a": object}), "not a dict"),
    (dict(train_dataset=None), "needs a train_dataset"),
    (dict(unknown_argument=1), "unexpected argument 'unknown_argument'"),
])
def test_mistaken_arguments_are_one_line(tmp_path, mistake, expected):
    with pytest.raises(ConfigError) as refused:
        ESTrainer(**{**small_run(tmp_path), **mistake})
    assert expected in str(refused.value) and "\n" not in str(refused.value)


def test_config_fields_errors_and_notices(capsys):
    """ESConfig speaks GRPOConfig's names in its errors; a GRPOConfig field with no ES meaning is one notice; a name
    neither has is one error."""
    with pytest.raises(ConfigError, match="^population_size 5 is not divisible by num_subspaces 2"):
        ESConfig(population_size=5, num_subspaces=2)
    with pytest.raises(ConfigError, match="ESConfig has no field gradient_steps_typo"):
        ESConfig(gradient_steps_typo=3)
    with pytest.raises(ConfigError, match="scale_rewards 'none' has no ES meaning"):
        ESConfig(scale_rewards="none")
    config = ESConfig(beta=0.04, loss_type="grpo", max_steps=3, learning_rate=1e-3, population_size=8,
                      num_subspaces=2, scale_rewards="group", max_tool_calling_iterations=2, bf16=True)
    notice = capsys.readouterr().err.strip().splitlines()
    assert len(notice) == 1 and "beta, loss_type" in notice[0]
    train = config.train_config()
    assert (train.steps, train.lr, train.population, train.subspaces) == (3, 1e-3, 8, 2)
    assert (train.fitness, train.max_turns, train.dtype) == ("per_question", 3, "bfloat16")


def test_esconfig_is_trainconfig_under_grpo_names():
    """Every TrainConfig option an ESConfig user can set is an ESConfig field with the same default and help, so the
    CLI, YAML, copes.train and ESConfig cannot drift."""
    from dataclasses import fields

    from copes.config.options import TrainConfig
    from copes.trl.config import ES_DEFAULTS, GRPO_NAMES, TRAINER_SET

    es_fields = {f.name: f for f in fields(ESConfig)}
    for option in fields(TrainConfig):
        if option.name in TRAINER_SET:
            continue
        mirrored = es_fields[GRPO_NAMES.get(option.name, option.name)]
        assert mirrored.metadata["help"] == option.metadata["help"]
        if option.name not in ES_DEFAULTS:
            assert getattr(ESConfig(), mirrored.name) == getattr(TrainConfig(), option.name)


def test_non_importable_reward_is_explained_at_start(tmp_path, capsys):
    """A lambda cannot be rebuilt in another rank: with workers=2 that is a one-line error before anything loads;
    in one process a one-line notice that its code is not hashed into the journal."""
    run = small_run(tmp_path)
    run["reward_funcs"] = [lambda completions, **kwargs: [0.0] * len(completions)]
    run["args"] = ESConfig(output_dir=str(tmp_path), workers=2, **ES_FIELDS)
    with pytest.raises(ConfigError, match="workers=2 rebuilds every function in each rank by import, and reward "
                                          "<lambda> cannot be imported again"):
        ESTrainer(**run)


# ---- callbacks stop cleanly; resume is bitwise ------------------------------------------------------------------
@pytest.mark.slow
def test_callback_stop_then_resume_equals_uninterrupted_bitwise(tmp_path):
    """control.should_training_stop after step 1 ends the run cleanly (journaled, checkpointed); train(
    resume_from_checkpoint=True) on a fresh ESTrainer continues it, and the weights after step 2 are bitwise those
    of the uninterrupted run, log_history continuing where it stopped."""
    whole = ESTrainer(**small_run(tmp_path / "whole"))
    whole.train()

    stopped = ESTrainer(**small_run(tmp_path / "parts"), callbacks=[StopAfter(1)])
    stopped.train()
    assert stopped.state.global_step == 1 and stopped.summary["stopped_by"] == "callback"
    resumed = ESTrainer(**small_run(tmp_path / "parts"))
    resumed.train(resume_from_checkpoint=True)
    assert resumed.state.global_step == 2
    assert_bitwise_equal(weights(whole), weights(resumed))
    assert [e["step"] for e in resumed.state.log_history if "reward" in e] == [1, 2]
    assert [e["reward"] for e in resumed.state.log_history if "reward" in e] == \
        [e["reward"] for e in whole.state.log_history if "reward" in e]
    resumed.save_model(str(tmp_path / "exported"))  # a Hugging Face checkpoint of the trained weights
    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "exported")
    assert_bitwise_equal({name: t for name, t in weights(resumed).items() if name in exported.state_dict()},
                         exported.state_dict())


@pytest.mark.slow
@pytest.mark.integration
def test_two_workers_equal_one_process_bitwise(tmp_path):
    """workers=2: this process is rank 0 and one more rank trains beside it, rebuilding the trainer by import; each
    scores one of the 2 members, and the weights after 2 steps are bitwise those of one process. The logged
    per-function means and completion length cover both ranks' members, not rank 0's alone."""
    one = ESTrainer(**small_run(tmp_path / "one"))
    one.train()
    two = ESTrainer(**small_run(tmp_path / "two", workers=2, cpu_threads=1, device_memory_gib=4))
    two.train()
    assert two.state.global_step == 2
    assert_bitwise_equal(weights(one), weights(two))
    keys = ("reward", "rewards/answer_column_reward/mean", "completions/mean_length")
    logged = [[{key: e[key] for key in keys} for e in run.state.log_history if "reward" in e] for run in (one, two)]
    assert len(logged[0]) == 2
    for alone, split in zip(*logged):  # the same values summed in another grouping: equal up to rounding
        assert split["reward"] == alone["reward"] and split == pytest.approx(alone, rel=1e-12)


# ---- tools and an environment in the multi-turn agent loop ---------------------------------------------------------
def call(name: str, **arguments) -> str:
    return "<tool_call>\n" + json.dumps({"name": name, "arguments": arguments}) + "\n</tool_call>"


def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: the first integer
        b: the second integer
    """
    return a + b


class Vault:
    """An environment: reset with the row's `secret`; `open_vault` is its tool; get_reward pays for opening it."""

    made: list[Vault] = []

    def __init__(self) -> None:
        self.secret, self.attempts, self.opened = None, [], False
        Vault.made.append(self)

    def reset(self, **row) -> str:
        self.secret = row["secret"]
        return " The vault is locked."

    def open_vault(self, code: str) -> str:
        """Try a code on the vault.

        Args:
            code: the code to try
        """
        self.attempts.append(code)
        self.opened = code == self.secret
        return "opened" if self.opened else "wrong code"

    def get_reward(self) -> float:
        return 1.0 if self.opened else 0.0


def says_done(completions, **kwargs) -> list[float]:
    return [float("done" in completion[0]["content"]) for completion in completions]


def test_tools_and_environment_drive_a_multi_turn_rollout(tmp_path, monkeypatch):
    """A standalone tool and an environment's method are called across turns; every rollout row gets its own
    environment instance, reset with its row (whose returned text reaches the prompt), and get_reward scores it
    beside a reward function (TRL's rule: the environment's reward, named after its class, weight 1)."""
    tokenizer = build_tiny_tokenizer(tmp_path, chat_template="qwen")
    checkpoint = build_tiny_checkpoint(tmp_path, chat_template="qwen")
    replies = {"[a]": [call("add", a=40, b=2), call("open_vault", code="42"), "done"],
               "[b]": [call("open_vault", code="7"), "done"]}

    def script(prompt: str) -> str:
        assert "The vault is locked." in prompt
        key = next(key for key in replies if key in prompt)
        return replies[key][min(prompt.count("<tool_response>"), len(replies[key]) - 1)]

    policy = ScriptedPolicy(tokenizer, script)
    monkeypatch.setattr("copes.rollout.agent.engine_for", lambda model: HFEngine(policy, row_caches=False))
    Vault.made.clear()
    rows = [{"prompt": [{"role": "user", "content": "[a] open it"}], "secret": "42"},
            {"prompt": [{"role": "user", "content": "[b] open it"}], "secret": "42"}]
    args = ESConfig(output_dir=str(tmp_path / "run"), max_steps=1, population_size=2, num_subspaces=1,
                    prompt_batch_size=2, max_completion_length=64, eval_size=0, chunk_size=4096)
    trainer = ESTrainer(model=str(checkpoint), reward_funcs=[says_done], args=args, train_dataset=rows,
                        processing_class=tokenizer, tools=[add], environment_factory=Vault)
    trainer.train()

    used = [vault for vault in Vault.made if vault.secret is not None]
    assert len(used) == 4  # 2 members x 2 questions, one instance per rollout row (the probe is never reset)
    assert sorted(tuple(vault.attempts) for vault in used) == [("42",), ("42",), ("7",), ("7",)]
    assert any("42" in c and "add" in str(c) for c in map(str, policy.calls))  # add's result reached the context
    logged = next(entry for entry in trainer.state.log_history if "reward" in entry)
    assert logged["rewards/Vault/mean"] == 0.5 and logged["rewards/says_done/mean"] == 1.0
    assert logged["reward"] == 1.5  # questions a: 1 + 1, b: 1 + 0, both members alike


TOOLS_MODULE = '''
def shout(text: str) -> str:
    """Say it louder.

    Args:
        text: what to say
    """
    return text.upper()


class Echo:
    def reset(self, **row) -> str:
        return ""

    def echo(self, text: str) -> str:
        """Repeat the text.

        Args:
            text: what to repeat
        """
        return text
'''


def test_tool_and_environment_modules_are_hashed_and_an_edit_refuses_the_resume(tmp_path, monkeypatch):
    """Tools and environment factories from a module are journaled with its sha256, as a reward module is: a
    resume after the module changed is refused in one line naming it (their code shapes every rollout)."""
    module = tmp_path / "house_tools.py"
    module.write_text(TOOLS_MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    house_tools = importlib.import_module("house_tools")

    def run(steps: int) -> dict:
        fields = small_run(tmp_path / "run", max_steps=steps, max_completion_length=2)
        return {**fields, "train_dataset": arithmetic_rows(True), "tools": [house_tools.shout],
                "environment_factory": house_tools.Echo, "processing_class": contents_tokenizer()}

    ESTrainer(**run(1)).train()
    sources = read_journal(tmp_path / "run").header["user_sources"]
    assert sources["tool module house_tools"]["sha256"] == sha256_of(module)
    assert sources["environment module house_tools"]["sha256"] == sha256_of(module)

    module.write_text(TOOLS_MODULE + "# edited\n")
    changed = "refused: the (tool|environment) module house_tools .* changed since the run started"
    with pytest.raises(ConfigError, match=changed):
        ESTrainer(**run(2)).train(resume_from_checkpoint=True)


@pytest.mark.slow
def test_trl_to_es_example_runs_on_the_embedded_model(tmp_path):
    """examples/trl_to_es.py, as a user runs it: trains, evaluates before and after, saves a loadable model (the plan
    budgets a stated 4 GiB: a shared test machine's free memory says nothing about this run)."""
    import os
    import subprocess
    import sys

    from helpers.paths import REPO

    env = {**os.environ, "PYTHONPATH": str(REPO)}
    command = [sys.executable, str(REPO / "examples" / "trl_to_es.py"), "--steps", "1",
               "--output-dir", str(tmp_path / "run"), "--device-memory-gib", "4"]
    done = subprocess.run(command, capture_output=True, text=True, env=env, cwd=tmp_path, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "step 1: reward" in done.stdout and "held-out reward" in done.stdout
    assert (tmp_path / "run" / "model.safetensors").is_file()

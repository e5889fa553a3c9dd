"""A TRL script behaves under copes.ESTrainer as it did under TRL (issue 55): batch and epoch arithmetic, the chat
template error, progress, tool deadlines and schemas, GRPO's metric names, environments owning the data, samples."""

from __future__ import annotations

import collections
import json
import os
import random
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from copes import ESConfig, ESTrainer
from copes.errors import ConfigError
from copes.rollout.hf_engine import HFEngine
from copes.run.journal import read_journal
from copes.user_code import OUTPUT_CAP_BYTES

from helpers.tiny_models import ScriptedPolicy, build_tiny_checkpoint, build_tiny_tokenizer
from helpers.trl_twin import TINY, answer_column_reward, arithmetic_rows, contents_tokenizer

# TRL's batch fields: generation_batch_size = 2 x 2 = 4 completions, // num_generations 2 = 2 prompts a step; six rows
# and max_steps=-1 (TRL's default) with one epoch: 3 steps.
TRL_BATCH = dict(per_device_train_batch_size=2, gradient_accumulation_steps=2, num_generations=2, max_steps=-1,
                 num_train_epochs=1)
STEP_BAR = re.compile(r"(^|[\r\n])\s*\d+%\|")  # transformers' step bar has no label (loading bars have one)
ES_SMALL = dict(population_size=2, num_subspaces=1, sigma=0.01, chunk_size=4096, eval_size=0)


def es_trainer(output_dir, rows=None, rewards=(answer_column_reward,), **fields):
    args = ESConfig(output_dir=str(output_dir), learning_rate=0.0025, seed=0, max_completion_length=4,
                    **{**ES_SMALL, **fields})
    return ESTrainer(model=TINY, reward_funcs=list(rewards), args=args,
                     train_dataset=rows if rows is not None else arithmetic_rows(False, count=6))


@pytest.mark.slow
def test_batch_and_epoch_fields_give_trls_steps_and_prompts(tmp_path, capsys):
    """The same batch and epoch fields give TRL's GRPOTrainer and ESTrainer the same number of steps (TRL's epoch
    arithmetic) and the same prompts a step (generation_batch_size // num_generations); every ES member scores
    every prompt of the step, and one line at start says so with the rollouts a step."""
    from trl import GRPOConfig, GRPOTrainer

    grpo = GRPOTrainer(model=TINY, reward_funcs=[answer_column_reward], train_dataset=arithmetic_rows(False, count=6),
                       args=GRPOConfig(output_dir=str(tmp_path / "grpo"), max_completion_length=4, use_cpu=True,
                                       report_to="none", learning_rate=0.0025, seed=0, logging_steps=1,
                                       **TRL_BATCH))
    grpo.train()
    es = es_trainer(tmp_path / "es", **TRL_BATCH)
    said = [line for line in capsys.readouterr().err.splitlines() if "rollouts" in line]
    assert said == ["notice: each step rolls out 2 prompts (generation_batch_size // num_generations) x 2 members "
                    "(population_size) = 4 rollouts; 3 steps (1 epoch of 6 rows); learning_rate 0.0025 is ES's "
                    "step size alpha (the paper's 5e-4), not a gradient optimizer's"]
    es.train()
    assert es.state.global_step == grpo.state.global_step == 3
    journal = read_journal(tmp_path / "es")
    assert [tuple(journal.rewards_of(step).shape) for step in (1, 2, 3)] == [(2, 2)] * 3  # members x prompts
    assert grpo.args.generation_batch_size // grpo.args.num_generations == es.cfg.prompt_batch == 2


@pytest.mark.parametrize("fields, expected", [
    (dict(max_steps=-1, num_train_epochs=2.5, prompt_batch_size=4), 8),  # ceil(2.5 x 12 // 4)
    (dict(max_steps=-1, num_train_epochs=1, generation_batch_size=64, num_generations=4), 1),  # one step at least
    (dict(max_steps=7, num_train_epochs=9), 7),  # max_steps set: the epochs do not count
])
def test_max_steps_minus_one_counts_epochs(fields, expected):
    assert ESConfig(**fields).train_config(12).steps == expected


@pytest.mark.parametrize("fields, message", [
    (dict(generation_batch_size=6, num_generations=4), r"generation_batch_size \(6\) must be divisible by "
                                                       r"num_generations \(4\)"),
    (dict(per_device_train_batch_size=4, num_generations=2, prompt_batch_size=8), "disagree"),
    (dict(max_steps=-2), "max_steps must be >= 0, or -1"),
    (dict(num_generations=0), "num_generations must be a positive integer"),
])
def test_batch_field_mistakes_are_one_line(fields, message):
    with pytest.raises(ConfigError, match=message):
        ESConfig(**fields)


def test_conversational_data_without_a_chat_template_is_trls_error(tmp_path):
    """TRL refuses conversational prompts when the tokenizer has no chat template; ESTrainer did render them as plain
    text without a word. Both now stop with TRL's words (ESTrainer's in one line)."""
    from trl import GRPOConfig, GRPOTrainer

    grpo = GRPOTrainer(model=TINY, reward_funcs=[answer_column_reward], train_dataset=arithmetic_rows(True, count=4),
                       args=GRPOConfig(output_dir=str(tmp_path / "grpo"), max_steps=1, use_cpu=True, report_to="none",
                                       per_device_train_batch_size=2, num_generations=2, max_completion_length=4))
    with pytest.raises(ValueError, match="tokenizer.chat_template is not set"):
        grpo.train()
    with pytest.raises(ConfigError, match="^Cannot use chat template functions because tokenizer.chat_template is "
                                          "not set") as refused:
        es_trainer(tmp_path / "es", rows=arithmetic_rows(True, count=4), max_steps=1)
    assert "\n" not in str(refused.value)


@pytest.mark.slow
def test_progress_bar_and_a_log_line_every_logging_steps(tmp_path, capsys):
    """As transformers' Trainer shows a run: a step bar (stderr) and each logging_steps' logs as one line (stdout);
    disable_tqdm keeps the lines without the bar."""
    es_trainer(tmp_path / "bar", max_steps=3, logging_steps=2, prompt_batch_size=2).train()
    shown = capsys.readouterr()
    assert STEP_BAR.search(shown.err) and "3/3" in shown.err
    lines = [line for line in shown.out.splitlines() if line.startswith("{'reward': ")]
    assert len(lines) == 2 and "'epoch': " in lines[0]  # steps 2 and 3 (the last step is always logged)
    es_trainer(tmp_path / "plain", max_steps=1, prompt_batch_size=2, disable_tqdm=True).train()
    shown = capsys.readouterr()
    assert not STEP_BAR.search(shown.err) and any(line.startswith("{'reward': ") for line in shown.out.splitlines())


def tool_call(name: str, **arguments) -> str:
    return "<tool_call>\n" + json.dumps({"name": name, "arguments": arguments}) + "\n</tool_call>"


def wait_forever(query: str) -> str:
    """A tool that never answers.

    Args:
        query: anything
    """
    threading.Event().wait()
    return "never"


def test_a_hanging_tool_times_out_and_samples_hold_the_transcript(tmp_path, monkeypatch):
    """A tool call past tool_timeout_s becomes an observation saying it timed out, the rollout goes on to the next
    turn, training ends and leaves no thread to wait for; samples.jsonl (log_completions) holds the rendered prompt,
    the question, the tool call with that observation, the turns, the gold answer beside the extracted one."""
    tokenizer = build_tiny_tokenizer(tmp_path, chat_template="qwen")
    checkpoint = build_tiny_checkpoint(tmp_path, chat_template="qwen")
    policy = ScriptedPolicy(tokenizer, lambda prompt: "42" if "<tool_response>" in prompt
                            else tool_call("wait_forever", query="x"))
    monkeypatch.setattr("copes.rollout.agent.engine_for", lambda model: HFEngine(policy, row_caches=False))
    rows = [{"prompt": [{"role": "user", "content": "What is 6x7?"}], "answer": "42"}]
    args = ESConfig(output_dir=str(tmp_path / "run"), max_steps=1, population_size=2, num_subspaces=1,
                    prompt_batch_size=1, max_completion_length=64, eval_size=0, chunk_size=4096, tool_timeout_s=0.5,
                    log_completions=True, sample_prompts=1)
    threads_before = set(threading.enumerate())  # earlier tests of the session may have left their own
    started = time.perf_counter()
    trainer = ESTrainer(model=str(checkpoint), reward_funcs=[answer_column_reward], args=args,
                        train_dataset=rows,
                        processing_class=tokenizer, tools=[wait_forever])
    trainer.train()
    assert time.perf_counter() - started < 60
    left = [thread.name for thread in set(threading.enumerate()) - threads_before if not thread.daemon]
    assert not left, f"training left threads to wait for: {left}"
    samples = [json.loads(line) for line in (tmp_path / "run" / "samples.jsonl").read_text().splitlines()]
    assert samples
    for sample in samples:
        assert sample["question"] == "What is 6x7?" and "What is 6x7?" in sample["prompt"]
        assert sample["prompt"].startswith("<|im_start|>")  # rendered with the chat template
        assert re.search("timed out|timeout|deadline", sample["tool_calls"][0]["observation"])
        assert sample["num_turns"] == 2 and sample["gold"] == "42" and sample["extracted_answer"] == "42"


def combine(first_number: int, second_number: int) -> int:
    """Combine two numbers.

    Args:
        first_number: the first number
        second_number: the second number
    """
    return first_number * 10 + second_number


def test_a_tool_with_several_arguments_is_offered_and_called_with_all_of_them():
    """A template without tool support offers tools in tags: a tool with several arguments is offered with the JSON
    schema TRL renders for it (transformers' get_json_schema) and called with a JSON object of its arguments; a
    one-argument tool keeps the form the embedded tool-using model was trained on."""
    from transformers.utils import get_json_schema

    from copes.rollout.templates import parse_tool_calls, tag_format_instructions
    from copes.trl.task import FunctionTool

    tools = [FunctionTool(combine), FunctionTool(wait_forever)]
    offered = tag_format_instructions(tools).splitlines()
    schema = json.dumps(get_json_schema(combine)["function"]["parameters"])
    assert offered[1] == ('- <combine>{"first_number": ..., "second_number": ...}</combine>: Combine two numbers. The '
                          f'input is a JSON object; its schema: {schema}')
    assert offered[2] == "- <wait_forever>query</wait_forever>: A tool that never answers."
    calls = parse_tool_calls('<combine>{"first_number": 4, "second_number": 2}</combine> <combine>4</combine> '
                             '<combine>{"first_number": 4}</combine>', "tags", tools)
    assert calls[0].valid and tools[0].call(calls[0].arguments) == "42"
    assert "JSON object of its arguments" in calls[1].error and "second_number" in calls[2].error


def same_for_everyone(completions, **kwargs) -> list[float]:
    return [0.5] * len(completions)


def test_grpo_metrics_of_a_step_and_a_step_without_signal(tmp_path):
    """TRL's per-step keys with their meaning: completion lengths (mean, min, max, the share that used every allowed
    token), tokens seen so far, the learning rate, the step's seconds, each reward's std. A step where every member
    scores the same leaves the weights where they were and counts every prompt in frac_reward_zero_std."""
    trainer = es_trainer(tmp_path / "run", rewards=[answer_column_reward, same_for_everyone], max_steps=2,
                         prompt_batch_size=3, reward_weights=[1.0, 0.0])
    trainer.train()
    first, second = [entry for entry in trainer.state.log_history if "reward" in entry]
    for entry in (first, second):
        assert entry["completions/min_length"] <= entry["completions/mean_length"] <= entry["completions/max_length"]
        assert entry["completions/max_length"] <= 4 and 0.0 <= entry["completions/clipped_ratio"] <= 1.0
        assert entry["learning_rate"] == 0.0025 and entry["step_time"] > 0
        assert entry["rewards/same_for_everyone/std"] == 0.0 and entry["rewards/same_for_everyone/mean"] == 0.5
    # 2 members x 3 prompts a step: each prompt "ab+cd=" is 6 tokens, each completion at most 4
    assert 2 * 3 * 6 < first["num_tokens"] <= 2 * 3 * 10 and second["num_tokens"] > first["num_tokens"]
    assert trainer.state.num_input_tokens_seen == second["num_tokens"]

    flat = es_trainer(tmp_path / "flat", rewards=[same_for_everyone], max_steps=1, prompt_batch_size=3)
    before = {name: tensor.clone() for name, tensor in flat.model.state_dict().items()}
    flat.train()
    logged = next(entry for entry in flat.state.log_history if "reward" in entry)
    assert logged["frac_reward_zero_std"] == 1.0 and logged["update_norm"] == 0.0
    assert all(torch.equal(before[name], tensor) for name, tensor in flat.model.state_dict().items())


class SumDealer:
    """An environment that owns the data: each reset() deals a fresh sum as the prompt."""

    dealt: list[str] = []

    def reset(self, **row) -> str:
        first, second = random.randint(10, 49), random.randint(10, 49)
        self.answer = str(first + second)
        SumDealer.dealt.append(f"{first}+{second}=")
        return SumDealer.dealt[-1]


def dealt_sum_reward(completions, environments, **kwargs) -> list[float]:
    return [float(c[0]["content"].strip() == e.answer) for c, e in zip(completions, environments)]


def test_an_environment_owns_the_data_without_a_train_dataset(tmp_path):
    """environment_factory with train_dataset=None (TRL 1.18): reset() returns each prompt and max_steps sets the
    length; every member is dealt the same question for a row, so members compare on shared questions."""
    SumDealer.dealt.clear()
    args = ESConfig(output_dir=str(tmp_path / "run"), max_steps=2, prompt_batch_size=2, max_completion_length=4,
                    **ES_SMALL)
    trainer = ESTrainer(model=TINY, reward_funcs=[dealt_sum_reward], args=args, train_dataset=None,
                        processing_class=contents_tokenizer(), environment_factory=SumDealer)
    trainer.train()
    assert trainer.state.global_step == 2
    dealt = collections.Counter(SumDealer.dealt)  # 2 steps x 2 questions, each dealt once to each of 2 members
    assert len(dealt) == 4 and set(dealt.values()) == {2}
    assert all(0.0 <= entry["reward"] <= 1.0 for entry in trainer.state.log_history if "reward" in entry)
    with pytest.raises(ConfigError, match="no train_dataset .* set max_steps"):
        ESTrainer(model=TINY, reward_funcs=[dealt_sum_reward], environment_factory=SumDealer,
                  args=ESConfig(output_dir=str(tmp_path / "endless"), **ES_SMALL))


def test_a_run_with_relative_paths_replays_from_another_folder(tmp_path, monkeypatch):
    """A script run with a relative model path and output_dir journals absolute paths: copes-replay rebuilds the
    trained weights from any folder. A model object without processing_class is saved with its own tokenizer (TRL
    loads the model's), so its run can load it back."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from copes.run.replay import replay_run

    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path)
    for part in (AutoModelForCausalLM, AutoTokenizer):
        part.from_pretrained(TINY).save_pretrained("script/model")
    monkeypatch.chdir(tmp_path / "script")
    args = ESConfig(output_dir="run", max_steps=1, prompt_batch_size=2, max_completion_length=4, learning_rate=0.0025,
                    **ES_SMALL)
    trainer = ESTrainer(model="model", reward_funcs=[answer_column_reward], args=args,
                        train_dataset=arithmetic_rows(False, count=4))
    trainer.train()
    monkeypatch.chdir(tmp_path / "elsewhere")
    steps, _ = replay_run(tmp_path / "script" / "run", "replayed", progress=False)
    replayed = AutoModelForCausalLM.from_pretrained("replayed").state_dict()
    assert steps == 1
    assert all(torch.equal(replayed[name], tensor) for name, tensor in trainer.model.state_dict().items()
               if name in replayed)

    ESTrainer(model=AutoModelForCausalLM.from_pretrained(TINY), reward_funcs=[answer_column_reward],
              train_dataset=arithmetic_rows(False, count=4), args=ESConfig(output_dir="object", **ES_SMALL))
    assert AutoTokenizer.from_pretrained("object/base_model").vocab == AutoTokenizer.from_pretrained(TINY).vocab


LOUD_SCRIPT = '''
import json, sys
from copes import ESConfig, ESTrainer
from copes.rollout.hf_engine import HFEngine
from helpers.tiny_models import ScriptedPolicy, build_tiny_checkpoint, build_tiny_tokenizer
import copes.rollout.agent

folder = sys.argv[1]
calls = {"tool": 0, "reward": 0}

def lookup(query: str) -> str:
    """Look a word up, printing a MiB of debugging on the way.

    Args:
        query: the word
    """
    calls["tool"] += 1
    print("@" * (1 << 20))
    return "42"

def loud_reward(completions, **kwargs):
    calls["reward"] += 1
    print("%" * (1 << 20), file=sys.stderr)
    return [1.0 for _ in completions]

tokenizer = build_tiny_tokenizer(folder, chat_template="qwen")
checkpoint = build_tiny_checkpoint(folder, chat_template="qwen")
policy = ScriptedPolicy(tokenizer, lambda prompt: "42" if "<tool_response>" in prompt else
                        '<tool_call>\\n{"name": "lookup", "arguments": {"query": "x"}}\\n</tool_call>')
copes.rollout.agent.engine_for = lambda model: HFEngine(policy, row_caches=False)
args = ESConfig(output_dir=folder + "/run", max_steps=2, population_size=2, num_subspaces=1, prompt_batch_size=2,
                max_completion_length=64, eval_size=0, chunk_size=4096, disable_tqdm=True)
rows = [{"prompt": [{"role": "user", "content": f"What is {n}?"}], "answer": "42"} for n in range(4)]
ESTrainer(model=str(checkpoint), reward_funcs=[loud_reward], args=args, train_dataset=rows,
          processing_class=tokenizer, tools=[lookup]).train()
print(json.dumps(calls), file=open(folder + "/calls.json", "w"))
'''


def test_a_tool_and_a_reward_that_print_a_mib_a_call_show_only_the_cap_said_once(tmp_path):
    """Issue #54: a user's tool and TRL reward function, called in the trainer's process (the tools several at once
    on the tool pool's threads), each print a MiB a call; a real ESTrainer process shows the first OUTPUT_CAP_BYTES of
    each call and says the cap once for each, instead of flooding the terminal with every MiB."""
    tests = Path(__file__).resolve().parents[1]
    environment = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tests), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, "-c", LOUD_SCRIPT, str(tmp_path)], capture_output=True, text=True,
                          env=environment, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    calls = json.loads((tmp_path / "calls.json").read_text())
    assert calls["tool"] >= 4 and calls["reward"] >= 4, calls
    output = done.stdout + done.stderr
    assert len(output) < (calls["tool"] + calls["reward"] + 8) * OUTPUT_CAP_BYTES, len(output)
    assert output.count("@" * OUTPUT_CAP_BYTES) == calls["tool"]
    assert output.count("%" * OUTPUT_CAP_BYTES) == calls["reward"]
    assert output.count("note: a tool printed") == 1 and output.count("note: a reward printed") == 1, output[-3000:]

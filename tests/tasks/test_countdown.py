"""Countdown: the public checker on hand-made right / wrong / malformed / hostile answers, the generated task
(deterministic, disjoint, solvable), its reward, a scripted rollout through `evaluate`, and `copes-run --task
countdown` on a locally built model."""

from __future__ import annotations

import json
import time

import pytest

from copes.rewards import countdown_correct
from copes.rollout.agent import AgentConfig
from copes.run.evaluation import evaluate
from copes.tasks import get_task
from copes.tasks.countdown import FORMAT_CREDIT

from helpers.cli_runs import copes_run
from helpers.timing import reading_seconds, seconds
from helpers.tiny_models import ScriptedPolicy, build_tiny_checkpoint, build_tiny_tokenizer


@pytest.mark.parametrize("answer, numbers, target", [
    ("(1 + 2) * 3", [1, 2, 3], 9),
    ("3*(2+1)", [3, 2, 1], 9),
    ("95 - (39 + 55 / 11)", [55, 11, 95, 39], 51),
    ("(7 - 3) / 2 * 5", [7, 3, 2, 5], 10),        # exact rationals: an intermediate value need not be an integer
    ("1 / 3 * 3 + 4", [1, 3, 3, 4], 5),           # a number given twice is used twice
    ("(1 + 2) * 3 = 9", [1, 2, 3], 9),            # the equation written out, with the target
    ("  ( 1 + 2 ) \u00d7 3  ", [1, 2, 3], 9),      # typographic multiplication sign, outer white space
    ("8 \u00f7 4 + 10", [8, 4, 10], 12),
    ("((((10))) - 4)", [10, 4], 6),
])
def test_right_answers(answer, numbers, target):
    assert countdown_correct(answer, numbers, target) is True


@pytest.mark.parametrize("answer, numbers, target", [
    ("(1 + 2) * 3", [1, 2, 3], 10),               # wrong value
    ("(1 + 2) * 3 = 10", [1, 2, 3], 10),          # a stated target that the expression does not reach
    ("(1 + 2) * 3 = 8", [1, 2, 3], 9),            # a stated result that is not the target
    ("1 + 2", [1, 2, 3], 3),                      # a number left unused
    ("(1 + 2) * 3 * 1", [1, 2, 3], 9),            # a number used twice
    ("(1 + 2) * 4", [1, 2, 3], 12),               # a number that was not given
    ("12 - 3", [1, 2, 3], 9),                     # digits glued into a new number
    ("-1 + 2 + 8", [1, 2, 8], 9),                 # unary minus makes a number that was not given
    ("+1 + 2 + 6", [1, 2, 6], 9),
    ("6 / (3 - 3) + 9", [6, 3, 3, 9], 9),         # division by zero
])
def test_wrong_answers(answer, numbers, target):
    assert countdown_correct(answer, numbers, target) is False


@pytest.mark.parametrize("answer", [
    "", "   ", "(1 + 2 * 3", "1 + 2) * 3", "1 + + 2 * 3", "1 2 3", "(1 + 2) * 3.0", "1.5 * 2 * 3", "3 ** 2",
    "(1 + 2) * 3 == 9", "nine", "__import__('os').system('true')", "1 + 2 * 3; 4", "[1, 2, 3]", "()",
    "(1 + 2) * 3 =", "= 9",
])
def test_malformed_answers(answer):
    assert countdown_correct(answer, [1, 2, 3], 9) is False


def test_hostile_answers_are_refused_quickly_without_errors():
    hostile = [
        "(" * 100_000 + "1" + ")" * 100_000,      # deep nesting: no RecursionError
        "(" * 40 + "1 + 2" + ")" * 40 + " * 3",   # deep but short: refused by the nesting cap
        "9" * 400 + " * " + "9" * 100,            # huge literals
        "1+" * 200_000 + "1",                     # long
        "=" * 100_000 + "9",
        "1 + 2 * 3 " + "= 9 " * 50_000,
        "\x00\ud800\u202e(1 + 2) * 3",
    ]
    benign = seconds(lambda: countdown_correct("(1 + 2) * 3", [1, 2, 3], 9))
    for answer in hostile:
        start = time.perf_counter()
        assert countdown_correct(answer, [1, 2, 3], 9) is False
        assert time.perf_counter() - start < 50 * (benign + reading_seconds(answer)), answer[:40]
    assert countdown_correct("(" * 20 + "1 + 2" + ")" * 20 + " * 3", [1, 2, 3], 9) is True  # within the cap


def test_non_string_answer_is_a_type_error():
    with pytest.raises(TypeError, match="answer must be a str"):
        countdown_correct(9, [1, 2, 3], 9)  # type: ignore[arg-type]


def test_generated_task_is_deterministic_disjoint_and_solvable():
    task = get_task("countdown", train_size=3000, validation_size=200, test_size=200)
    again = get_task("countdown", train_size=3000, validation_size=200, test_size=200)
    splits = {split: task.examples(split) for split in ("train", "validation", "test")}
    assert {split: [e.meta for e in examples] for split, examples in splits.items()} == {
        split: [e.meta for e in again.examples(split)] for split in splits}
    keys = {split: {(tuple(sorted(e.meta["numbers"])), e.meta["target"]) for e in examples}
            for split, examples in splits.items()}
    assert [len(keys[split]) for split in splits] == [3000, 200, 200]  # no instance twice within a split
    assert not (keys["train"] & keys["validation"] or keys["train"] & keys["test"] or keys["validation"] & keys["test"])
    for examples in splits.values():
        for example in examples:
            numbers, target = example.meta["numbers"], example.meta["target"]
            assert 3 <= len(numbers) <= 4 and all(1 <= n <= 99 for n in numbers) and 1 <= target <= 100
            assert countdown_correct(example.meta["solution"], numbers, target), example
    assert get_task("countdown", seed=1, train_size=50).examples("train") != task.examples("train", limit=50)
    prompt = task.prompt(splits["test"][0])
    assert str(splits["test"][0].meta["numbers"]) in prompt and "<answer>" in prompt


@pytest.mark.parametrize("options, message", [
    ({"source": "web"}, "source must be one of"),
    ({"min_numbers": 5, "max_numbers": 4}, "min_numbers <= max_numbers"),
    ({"max_target": 0}, "max_target must be >= 1"),
    ({"test_size": -1}, "split sizes must be >= 0"),
])
def test_bad_task_options_are_one_clear_error(options, message):
    with pytest.raises(ValueError, match=message):
        get_task("countdown", **options)


def test_reward_is_one_for_a_correct_answer_format_credit_for_a_wrong_one_and_zero_without_answer():
    task = get_task("countdown", test_size=5)
    example = task.examples("test")[0]
    solution = example.meta["solution"]
    right = task.score(f"<think>try it</think> <answer> {solution} </answer>", example)
    assert (right.reward, right.correct, right.answer) == (1.0, True, solution)
    wrong = task.score(f"<answer>{solution} + 1</answer>", example)
    assert (wrong.reward, wrong.correct) == (FORMAT_CREDIT, False)
    assert task.score(solution, example).reward == 0.0  # no answer tag: no credit even when the expression is right
    assert task.score(f"<answer>{solution}", example).reward == 0.0  # unclosed tag


def test_scripted_rollout_is_scored_through_evaluate(tmp_path):
    """The real rollout path (chat template, generate, decode, score) on a policy that answers with the reference
    solution for even-indexed questions and a wrong number for odd ones."""
    task = get_task("countdown", test_size=8)
    examples = task.examples("test")
    replies = {task.prompt(e): f"<think>ok</think><answer>{e.meta['solution'] if i % 2 == 0 else '1 + 1'}</answer>"
               for i, e in enumerate(examples)}
    tokenizer = build_tiny_tokenizer(tmp_path)
    policy = ScriptedPolicy(tokenizer, lambda prompt: next(reply for text, reply in replies.items() if text in prompt))
    result = evaluate(policy, tokenizer, task, examples, tools=(),
                      agent_config=AgentConfig(max_turns=1, max_new_tokens=96))
    assert result.accuracy == 0.5
    assert result.mean_reward == pytest.approx((4 * 1.0 + 4 * FORMAT_CREDIT) / 8)


@pytest.mark.integration
def test_copes_run_trains_on_countdown_with_a_locally_built_model(tmp_path):
    model = build_tiny_checkpoint(tmp_path / "model")
    out = tmp_path / "run"
    result = copes_run("--model", str(model), "--task", "countdown", "--no-tools", "--steps", "2",
                       "--output-dir", str(out))
    assert result.returncode == 0, result.stderr
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["config"]["task"] == "countdown" and summary["steps"] == 2
    assert 0 <= summary["eval_after"]["accuracy"] <= 1

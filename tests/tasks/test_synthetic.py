"""The synthetic arithmetic task and the embedded tiny model trained on it."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from copes.tasks import Example, get_task
from copes.tasks.synthetic import ArithmeticTask, digit_accuracy, problem_split, solve

from helpers.paths import REPO

TINY_MODEL = REPO / "copes" / "assets" / "tiny"
# The committed base model must be partially trained: good enough to give ES a signal, far from solved.
PARTIAL_ACCURACY_BAND = (0.25, 0.70)


@pytest.fixture(scope="module")
def task() -> ArithmeticTask:
    return ArithmeticTask(seed=0, train_size=5000, validation_size=300, test_size=300)


def test_registered_under_arithmetic() -> None:
    task = get_task("arithmetic", train_size=10, digit_shaping=0.25)
    assert isinstance(task, ArithmeticTask)
    assert (task.name, task.kind, task.chat) == ("arithmetic", "synthetic", False)
    assert task.digit_shaping == 0.25


def test_same_seed_same_problems_other_seed_other_problems(task: ArithmeticTask) -> None:
    again = ArithmeticTask(seed=0, train_size=5000, validation_size=300, test_size=300)
    other = ArithmeticTask(seed=1, train_size=5000, validation_size=300, test_size=300)
    for split in ("train", "validation", "test"):
        assert task.examples(split) == again.examples(split)
        assert [e.question for e in task.examples(split)] != [e.question for e in other.examples(split)]


def test_splits_are_disjoint_by_problem_and_unique(task: ArithmeticTask) -> None:
    questions = {split: [e.question for e in task.examples(split)] for split in ("train", "validation", "test")}
    for split, texts in questions.items():
        assert len(texts) == len(set(texts)) == task.sizes[split]
        assert all(problem_split(text) == split for text in texts)
    assert not set(questions["train"]) & set(questions["validation"])
    assert not set(questions["train"]) & set(questions["test"])
    assert not set(questions["validation"]) & set(questions["test"])


def test_other_seed_never_trains_on_this_seeds_test_problems(task: ArithmeticTask) -> None:
    other_train = {e.question for e in ArithmeticTask(seed=7, train_size=5000).examples("train")}
    assert not other_train & {e.question for e in task.examples("test")}


def test_problems_are_well_formed_and_golds_are_right(task: ArithmeticTask) -> None:
    examples = task.examples("train")
    for example in examples:
        left, operation, right = example.meta["left"], example.meta["operation"], example.meta["right"]
        assert example.question == f"{left}{operation}{right}=" == task.prompt(example)
        assert example.golds == (str(solve(left, operation, right)),)
        assert 0 <= left < 1000 and 0 <= right < 1000
    assert {e.meta["operation"] for e in examples} == {"+", "-"}
    # Digit counts are drawn uniformly, so one-digit operands are common, not 1% of the mix.
    assert sum(e.meta["left"] < 10 for e in examples) > len(examples) / 5
    assert any(e.golds[0].startswith("-") for e in examples)


def test_examples_limit_keeps_the_first_rows(task: ArithmeticTask) -> None:
    assert task.examples("test", 5) == task.examples("test")[:5]
    assert task.examples("test", 0) == []


def test_multiplication_when_asked() -> None:
    examples = ArithmeticTask(operations="*", max_digits=2, train_size=50).examples("train")
    assert all(e.golds[0] == str(e.meta["left"] * e.meta["right"]) for e in examples)


@pytest.mark.parametrize(
    ("completion", "correct"),
    [
        ("-307", True),
        ("-307\n12+5=17", True),  # the answer ends at the first newline
        ("  -307 \n", True),
        ("307", False),
        ("-0307", False),
        ("-307.0", False),
        ("", False),
        ("\n-307", False),
    ],
)
def test_score_exact_answer(completion: str, correct: bool) -> None:
    task = ArithmeticTask()
    example = Example(id="t", question="7-314=", golds=("-307",))
    score = task.score(completion, example)
    assert score.correct is correct
    assert score.reward == (1.0 if correct else 0.0)


def test_digit_shaping_gives_partial_credit_below_exact() -> None:
    example = Example(id="t", question="75+29=", golds=("104",))
    shaped = ArithmeticTask(digit_shaping=0.5)
    assert shaped.score("104", example).reward == 1.0
    assert shaped.score("105", example).reward == pytest.approx(0.5 * 2 / 3)
    assert shaped.score("4", example).reward == pytest.approx(0.5 * 1 / 3)  # right-aligned: units digit matches
    assert shaped.score("999", example).reward == 0.0
    assert digit_accuracy("-12", "12") == pytest.approx(2 / 3)
    assert digit_accuracy("", "") == 1.0


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"operations": "+/"}, "operations"),
        ({"operations": ""}, "operations"),
        ({"max_digits": 0}, "max_digits"),
        ({"digit_shaping": 1.0}, "digit_shaping"),
        ({"test_size": -1}, "test_size"),
    ],
)
def test_bad_options_are_named(options: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        ArithmeticTask(**options)


def test_bad_split_limit_and_oversized_split_are_named() -> None:
    task = ArithmeticTask(max_digits=1, operations="+", test_size=50)
    with pytest.raises(ValueError, match="split"):
        task.examples("dev")
    with pytest.raises(ValueError, match="limit"):
        task.examples("train", -1)
    with pytest.raises(ValueError, match="test_size=50"):
        task.examples("test")  # one-digit addition has 100 problems; test owns ~5 of them


@pytest.mark.skipif(not (TINY_MODEL / "model.safetensors").exists(), reason=f"no committed tiny model in {TINY_MODEL}")
def test_committed_tiny_model_is_partially_trained(task: ArithmeticTask) -> None:
    tokenizer = AutoTokenizer.from_pretrained(TINY_MODEL)
    model = AutoModelForCausalLM.from_pretrained(TINY_MODEL).eval()
    assert model.config.model_type == "qwen3"
    assert sum(p.numel() for p in model.parameters()) < 2_000_000
    assert tokenizer.padding_side == "left"
    assert tokenizer.decode(tokenizer("37+485=\n")["input_ids"]) == "37+485=\n"

    examples = task.examples("test", 200)
    inputs = tokenizer([task.prompt(e) for e in examples], return_tensors="pt", padding=True)
    with torch.no_grad():
        outputs = model.generate(**inputs, generation_config=model.generation_config)
    completions = tokenizer.batch_decode(outputs[:, inputs["input_ids"].shape[1] :], skip_special_tokens=True)
    accuracy = sum(task.score(text, e).correct for text, e in zip(completions, examples)) / len(examples)
    low, high = PARTIAL_ACCURACY_BAND
    assert low <= accuracy <= high, (
        f"held-out greedy accuracy {accuracy:.3f} is outside the partial band {PARTIAL_ACCURACY_BAND}"
    )

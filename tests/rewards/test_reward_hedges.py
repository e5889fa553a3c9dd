"""Every reward pays one committed answer: an output that hedges (states two candidate answers) never earns more,
on average, than committing to one of them. Math and QA golds come from the real datasets in the tests' data folder
(tests/helpers/datadir.py).

The hedge forms are the ones a policy finds: two values in one box with the second in prose inside `\\text{...}`,
two boxes in one answer span, "A or B" as a QA answer, "yes no" on a yes/no question, two countdown expressions.
"""

from __future__ import annotations

import json
from itertools import islice
from pathlib import Path

import pytest

from copes.errors import ConfigError
from copes.rewards import countdown_correct, format_reward, math_correct, qa_reward, qa_scores
from copes.tasks import get_task
from copes.tasks.base import Example
from copes.tasks.countdown import FORMAT_CREDIT

from helpers.datadir import DATA_DIR, FULL_DATA

DATA = DATA_DIR
PAIRS_PER_DATASET = 12


def _jsonl(path: Path, limit: int) -> list[dict]:
    with path.open(encoding="utf-8") as lines:
        return [json.loads(line) for line in islice(lines, limit)]


# --------------------------------------------------------------------------------------------------------- math

# Two golds a, b in one answer. The first four were each credited for BOTH golds before answers were parsed one
# way only (the box parse read a, the prose parse inside `\text{...}` read b).
MATH_HEDGES = [
    r"{a} \text{{ or {{the answer}} is }} {b}",
    r"{a} \text{{ or {{the answer}} is {b}}}",
    r"{a} \text{{ (or {{maybe}} {b})}}",
    r"{a} \textbf{{ or {{the answer}} is {b}}}",
    r"{a} \text{{ or }} {b}",
    r"{a} \text{{, but it could be }} {b}",
    "{a} or {b}",
    "The answer is {a} or maybe {b}.",
]


def _gold_pairs(golds: list[str]) -> list[tuple[str, str]]:
    """Neighbouring golds that are really different answers (math-verify does not equate them)."""
    pairs = [(a, b) for a, b in zip(golds, golds[1:]) if not math_correct(a, b) and not math_correct(b, a)]
    return pairs[:PAIRS_PER_DATASET]


@pytest.fixture(scope="module")
def math_gold_pairs() -> list[tuple[str, str]]:
    if not DATA.is_dir():
        pytest.skip(f"shared data folder not found at {DATA}")
    gsm8k_rows = _jsonl(DATA / "math" / "gsm8k_test.jsonl", 40)
    gsm8k = [row["answer"].rsplit("####", 1)[1].strip().replace(",", "") for row in gsm8k_rows]
    math500 = [row["answer"] for row in _jsonl(DATA / "math" / "math500_test.jsonl", 40)]
    return _gold_pairs(gsm8k) + _gold_pairs(math500)


def test_a_math_hedge_is_credited_for_at_most_one_gold(math_gold_pairs: list[tuple[str, str]]) -> None:
    task = get_task("math500", format_reward=False, tool_bonus=False)
    completions, examples = [], []
    for a, b in math_gold_pairs:
        for form in MATH_HEDGES:
            completion = f"<answer>\\boxed{{{form.format(a=a, b=b)}}}</answer>"
            completions += [completion, completion]
            examples += [Example(id="a", question="q", golds=(a,)), Example(id="b", question="q", golds=(b,))]
    scores = task.score_batch(completions, examples)
    both = [
        completions[index]
        for index in range(0, len(scores), 2)
        if scores[index].correct and scores[index + 1].correct
    ]
    assert len(math_gold_pairs) == 2 * PAIRS_PER_DATASET
    assert not both, f"{len(both)} hedges credited for two different golds, e.g. {both[:3]}"


def test_the_committed_math_answer_is_the_box_latex_not_the_prose_inside_it() -> None:
    # `\text{...}` is an annotation of the boxed value, nested braces and all: the answer is 5.
    hedge = r"5 \text{ or {the answer} is 7}"
    assert math_correct(hedge, "5") and not math_correct(hedge, "7")
    # A prose answer (no box) is read once, the way math-verify reads a sentence.
    assert math_correct("The answer is 18 dollars.", "18")


def test_math_format_term_pays_one_box_only() -> None:
    assert format_reward("<answer>\\boxed{3}</answer>", "math") == 0.0
    assert format_reward("<answer>\\boxed{3} or \\boxed{4}</answer>", "math") == -0.5
    assert format_reward("<answer>\\boxed{3}</answer> <answer>\\boxed{3}\\boxed{4}</answer>", "math") == -0.5
    assert format_reward("\\boxed{3} or maybe \\boxed{4}", "math") == -1.0
    assert format_reward("<answer>\\boxed{\\boxed{3} + 1}</answer>", "math") == 0.0  # one top-level box


def test_two_answer_spans_pay_only_the_last(math_gold_pairs: list[tuple[str, str]]) -> None:
    task = get_task("math500", format_reward=False, tool_bonus=False)
    a, b = math_gold_pairs[0]
    completion = f"<answer>\\boxed{{{a}}}</answer> <answer>\\boxed{{{b}}}</answer>"
    golds = [Example(id="a", question="q", golds=(a,)), Example(id="b", question="q", golds=(b,))]
    assert [score.correct for score in task.score_batch([completion] * 2, golds)] == [False, True]


# --------------------------------------------------------------------------------------------------------- QA

QA_HEDGES = ["{a} or {b}", "{a}, {b}", "either {a} or {b}", "{b} / {a}", "{a} {b}"]


@pytest.fixture(scope="module")
def hotpotqa_dev() -> list[Example]:
    if not DATA.is_dir():
        pytest.skip(f"shared data folder not found at {DATA}")
    return get_task("hotpotqa", data_dir=DATA).examples("validation")


@pytest.fixture(scope="module")
def qa_gold_pairs(hotpotqa_dev: list[Example]) -> list[tuple[str, str]]:
    """Pairs of different real answers: HotpotQA dev (not yes/no) and MuSiQue dev answers."""
    hotpot = [example.golds[0] for example in hotpotqa_dev if example.golds[0].lower() not in ("yes", "no")]
    musique = [example.golds[0] for example in get_task("musique", data_dir=DATA).examples("validation", limit=60)]
    pairs = []
    for golds in (hotpot[:60], musique):
        pairs += [(a, b) for a, b in zip(golds, golds[1:]) if qa_scores(a, [b])["em"] == 0.0]
    return pairs


def _expected(task, answer: str, a: str, b: str) -> float:
    """The mean reward of `answer` when the gold is a or b with equal odds (the policy's belief)."""
    examples = [Example(id="a", question="q", golds=(a,)), Example(id="b", question="q", golds=(b,))]
    return sum(task.score(f"<answer>{answer}</answer>", example).reward for example in examples) / 2


@pytest.mark.parametrize("options", [{}, {"qa_metric": "em"}, {"qa_metric": "f1"}], ids=["default", "em", "f1"])
def test_a_qa_hedge_never_beats_a_guess(qa_gold_pairs: list[tuple[str, str]], options: dict) -> None:
    task = get_task("hotpotqa", format_reward=False, tool_bonus=False, **options)
    beaten = []
    for a, b in qa_gold_pairs:
        best_guess = max(_expected(task, a, a, b), _expected(task, b, a, b))
        for form in QA_HEDGES:
            hedge = form.format(a=a, b=b)
            if _expected(task, hedge, a, b) > best_guess:
                beaten.append(hedge)
    assert len(qa_gold_pairs) > (80 if FULL_DATA else 60)  # the slices hold 15 HotpotQA dev rows, not 300
    assert not beaten, f"{len(beaten)} hedges beat the best guess, e.g. {beaten[:3]}"


def test_the_training_default_is_exact_match() -> None:
    task = get_task("hotpotqa", format_reward=False, tool_bonus=False)
    example = Example(id="h", question="q", golds=("Paris",))
    assert task.score("<answer>Paris or London</answer>", example).reward == 0.0
    assert task.score("<answer>paris</answer>", example).reward == 1.0


def test_length_gated_f1_keeps_partial_credit_for_a_committed_answer() -> None:
    assert qa_reward("Obama", ["Barack Obama"], "f1") == pytest.approx(2 / 3)  # shorter: its F1
    assert qa_reward("Barack Obama", ["Barack Obama"], "f1") == 1.0
    assert qa_reward("Barack Obama Jr", ["Barack Obama"], "f1") == 0.0  # longer than the gold: nothing
    assert qa_scores("Barack Obama Jr", ["Barack Obama"])["f1"] == pytest.approx(0.8)  # reporting F1 unchanged
    assert qa_reward("Obama", ["Barack Obama", "Obama"], "f1") == 1.0  # the best gold
    with pytest.raises(ValueError, match="metric"):
        qa_reward("Obama", ["Obama"], "bleu")


@pytest.mark.parametrize("hedge", ["yes no", "no or yes", "Yes, no", "yes/no"])
@pytest.mark.parametrize("normalization", ["official", "paper"])
def test_yes_and_no_together_are_wrong_on_every_yes_no_question(
    hotpotqa_dev: list[Example], hedge: str, normalization: str
) -> None:
    binary = [example for example in hotpotqa_dev if example.golds[0].lower() in ("yes", "no")]
    assert len(binary) == (19 if FULL_DATA else 3)
    for example in binary:
        assert qa_scores(hedge, example.golds, normalization) == {"em": 0.0, "f1": 0.0, "acc": 0.0}
        assert all(qa_reward(hedge, example.golds, metric, normalization) == 0.0 for metric in ("em", "f1"))
        assert qa_scores(example.golds[0].lower(), example.golds, normalization)["acc"] == 1.0


def test_accuracy_pays_a_list_of_candidates_so_it_is_refused_as_a_reward() -> None:
    """Guards #40: substring accuracy is a reporting metric; asked for as a training reward, it is refused."""
    assert qa_scores("Paris or London", ["London"])["acc"] == 1.0
    with pytest.raises(ConfigError, match="'em' \\(the default\\) or 'f1'"):
        get_task("hotpotqa", qa_metric="acc", format_reward=False, tool_bonus=False)
    with pytest.raises(ConfigError, match="cannot be a training reward"):
        qa_reward("Paris or London", ["London"], "acc")


def test_qa_answer_spans_pay_only_the_last() -> None:
    task = get_task("hotpotqa", format_reward=False, tool_bonus=False)
    completion = "<answer>Paris</answer> or rather <answer>London</answer>"
    assert task.score(completion, Example(id="h", question="q", golds=("Paris",))).reward == 0.0
    assert format_reward(completion, "qa") == 0.0  # the span is there; which one counts is extraction's rule


# --------------------------------------------------------------------------------------------------------- countdown


@pytest.mark.parametrize(
    "answer",
    [
        "(25 - 5) * 3 or 25 + 5 * 3",  # two expressions: not one expression
        "(25 - 5) * 3, 25 + 3 * 5",
        "(25 - 5) * 3 = 60 = 40",
        "25 - 5 * 3 = 60",  # states the target, but the expression gives 10
    ],
)
def test_a_countdown_hedge_is_not_an_answer(answer: str) -> None:
    assert not countdown_correct(answer, [25, 5, 3], 60)


def test_countdown_pays_only_the_last_answer_span() -> None:
    task = get_task("countdown")
    example = Example(id="c", question="q", golds=("60",), meta={"numbers": [25, 5, 3], "target": 60})
    right, wrong = "(25 - 5) * 3", "25 + 5 * 3"
    assert task.score(f"<answer>{wrong}</answer><answer>{right}</answer>", example).reward == 1.0
    assert task.score(f"<answer>{right}</answer><answer>{wrong}</answer>", example).reward == FORMAT_CREDIT

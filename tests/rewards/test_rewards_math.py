"""Math rewards: answer extraction, math-verify correctness through the worker pool, format terms."""

from __future__ import annotations

import json
import re
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from copes.rewards import extract_answer, format_reward, last_boxed, math_correct, math_correct_batch, tool_bonus
from copes.rewards.math import MathVerifierPool

from helpers.datadir import DATA_DIR

GSM8K_MODELS = ("6b_finetuning", "6b_verification", "175b_finetuning", "175b_verification")


def _read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]


# --------------------------------------------------------------------------------------------------------- extract


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("so <answer>\\boxed{\\frac{1}{2}}</answer>", "\\frac{1}{2}"),  # nested braces
        ("<answer>\\boxed{\\{1, 2\\}}</answer>", "\\{1, 2\\}"),  # escaped braces are literal
        ("<answer>\\fbox{7}</answer>", "7"),
        ("\\boxed{1} then <answer>\\boxed{2}</answer> and \\boxed{3}", "2"),  # the answer span wins
        ("<answer>\\boxed{1}</answer> <answer>\\boxed{2}</answer>", "2"),  # the last span
        ("<answer>\\boxed{1} or \\boxed{2}</answer>", "2"),  # the last box inside it
        ("<answer> Paris </answer>", "Paris"),  # no box: the span's content
        ("<answer>\\boxed{4} is wrong, it is \\boxed{5}", "5"),  # unclosed tag: the last box anywhere
        ("\\boxed{4} and then \\boxed{5", "4"),  # unclosed box ignored
        ("\\boxed{x^{2 and later \\boxed{9}", "9"),  # a complete box after an unclosed one
        ("\\boxed{\\boxed{6} + 1}", "\\boxed{6} + 1"),  # the outermost box
        ("  The answer is 12.\n", "The answer is 12."),  # no tags, no box: whole output, stripped
        ("", ""),
    ],
)
def test_extract_answer_edge_cases(text: str, expected: str) -> None:
    assert extract_answer(text) == expected


def test_last_boxed_without_a_complete_box_is_none() -> None:
    assert last_boxed("no box here") is None
    assert last_boxed("\\boxed{never closed") is None
    assert last_boxed("\\boxed {spaced}") == "spaced"


# --------------------------------------------------------------------------------------------------------- format


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("<answer>\\boxed{3}</answer>", 0.0),
        ("<answer>3</answer>", -0.5),  # no box inside the answer span
        ("\\boxed{3} <answer>3</answer>", -0.5),  # a box outside the span does not count
        ("the result is \\boxed{3}", -0.5),  # no answer span
        ("the result is 3", -1.0),
        ("<answer>\\boxed{3}", -0.5),  # unclosed tag: only the box counts
    ],
)
def test_math_format_reward(text: str, expected: float) -> None:
    assert format_reward(text, "math") == expected


def test_format_reward_rejects_unknown_kind() -> None:
    with pytest.raises(ValueError, match="kind"):
        format_reward("<answer>1</answer>", "chemistry")


def test_tool_bonus_only_for_correct_answers_with_a_tool() -> None:
    assert tool_bonus(correct=True, used_tool=True) == pytest.approx(0.1)
    assert tool_bonus(correct=True, used_tool=False) == 0.0
    assert tool_bonus(correct=False, used_tool=True) == 0.0


# --------------------------------------------------------------------------------------------------------- correctness


@pytest.mark.parametrize(
    ("prediction", "gold", "expected"),
    [
        ("0.5", "\\frac{1}{2}", True),
        ("\\dfrac{9}{7}", "\\frac{9}{7}", True),
        ("(3, \\frac{\\pi}{2})", "\\left( 3, \\frac{\\pi}{2} \\right)", True),
        ("x^2+2x+1", "(x+1)^2", True),
        ("2\\sqrt{2}", "\\sqrt{8}", True),
        ("\\{2, 1\\}", "\\{1, 2\\}", True),
        ("C", "\\text{(C)}", True),
        ("10 \\text{ cm}", "10", True),
        ("The answer is 18 dollars.", "18", True),  # prose: math-verify finds the number
        ("3", "4", False),
        ("6 - 5i", "5", False),  # a bare expression is not mined for numbers
        ("y = 2x + 3", "3", False),
        ("", "4", False),
    ],
)
def test_math_correct_pairs(prediction: str, gold: str, expected: bool) -> None:
    assert math_correct(prediction, gold) is expected


def test_batch_agrees_with_single_calls_and_keeps_order() -> None:
    predictions = ["1/2", "3", "\\frac{6}{4}", "7"]
    golds = ["0.5", "4", "1.5", "7"]
    assert math_correct_batch(predictions, golds) == [math_correct(p, g) for p, g in zip(predictions, golds)]
    with pytest.raises(ValueError, match="length"):
        math_correct_batch(["1"], ["1", "2"])


def test_math_correct_from_threads() -> None:
    # math-verify called directly from a non-main thread raises (signal.alarm); through the pool it works.
    pairs = [("\\frac{1}{3}", "1/3"), ("2", "3")] * 4
    with ThreadPoolExecutor(max_workers=4) as executor:
        verdicts = list(executor.map(lambda pair: math_correct(*pair), pairs))
    assert verdicts == [True, False] * 4


def test_hostile_input_times_out_and_the_pool_recovers() -> None:
    """The recovery check has a generous deadline of its own: on a loaded machine the fresh worker's first check
    once outlived the 1 s one (issue #37: this test failed under load and passed alone)."""
    pool = MathVerifierPool(num_workers=1, timeout_s=1.0)
    try:
        assert pool.correct("1", "1.0", timeout_s=60) is True  # waits for the worker's imports, not timed below
        # 9^(9^(9^9)) keeps sympy busy until math-verify's own 3 s alarm; the 1 s outer timeout cuts it first,
        # which kills the worker's process (after the alarm it would answer and stay).
        processes = {worker.process.pid for worker in pool._all}
        assert pool.correct("9^{9^{9^{9}}}", "1") is False
        assert processes.isdisjoint(worker.process.pid for worker in pool._all), "the outer timeout did not fire"
        assert pool.correct("\\frac{1}{4}", "0.25", timeout_s=60) is True  # a fresh process replaced the killed one
    finally:
        pool.close()


def test_pool_rejects_bad_arguments() -> None:
    with pytest.raises(ValueError, match="num_workers"):
        MathVerifierPool(num_workers=0)
    with pytest.raises(ValueError, match="timeout_s"):
        MathVerifierPool(timeout_s=0)


# --------------------------------------------------------------------------------------------------------- real data


def _gsm8k_final_answer(text: str) -> str:
    """The dataset's answer format: the text after the last "A:" line (no such line: no answer)."""
    answers = re.findall(r"^A:(.*)$", text, flags=re.MULTILINE)
    return answers[-1].strip() if answers else ""


def test_gsm8k_model_solutions_agree_with_labels() -> None:
    rows = _read_jsonl(DATA_DIR / "math" / "gsm8k_model_solutions.jsonl")
    predictions, golds, labels = [], [], []
    for row in rows:
        gold = _gsm8k_final_answer(row["ground_truth"])
        for model in GSM8K_MODELS:
            predictions.append(_gsm8k_final_answer(row[model]["solution"]))
            golds.append(gold)
            labels.append(row[model]["is_correct"])
    verdicts = math_correct_batch(predictions, golds)
    agreement = sum(v == label for v, label in zip(verdicts, labels)) / len(labels)
    print(f"gsm8k model solutions: agreement {agreement:.4%} on {len(labels)} solutions")
    assert len(labels) == 4 * len(rows)
    assert agreement >= 0.99


def test_math500_gold_solutions_match_their_own_answers() -> None:
    rows = _read_jsonl(DATA_DIR / "math" / "math500_test.jsonl")
    # The whole solution text goes to math-verify (no extraction), so the check is not a string comparison.
    verdicts = math_correct_batch([row["solution"] for row in rows], [row["answer"] for row in rows])
    failures = [row["unique_id"] for row, verdict in zip(rows, verdicts) if not verdict]
    print(f"MATH-500 self-consistency: {1 - len(failures) / len(rows):.2%}")
    assert not failures


def test_math500_answers_rarely_match_another_problem() -> None:
    rows = _read_jsonl(DATA_DIR / "math" / "math500_test.jsonl")
    # Pair each problem's extracted answer with its neighbour's gold answer.
    predictions = [extract_answer(row["solution"]) for row in rows]
    golds = [rows[(index + 1) % len(rows)]["answer"] for index in range(len(rows))]
    cross_matches = sum(math_correct_batch(predictions, golds))
    print(f"MATH-500 cross-match rate: {cross_matches / len(rows):.2%} ({cross_matches} of {len(rows)} pairs)")
    # Some neighbours share an answer (two problems whose answer is 3); anything beyond a few is a false positive.
    assert cross_matches / len(rows) <= 0.02

"""Math tasks: GSM8K, MATH (train / held-out validation / test), MATH-500, AIME 2024 and AIME 2025.

Reward = correctness (math-verify, 1 or 0) + format term (0 / -0.5 / -1) + tool bonus (+0.1 when correct with a
tool call); the last two can be switched off. Gold answers: GSM8K's `#### N` line (commas stripped), the last
`\\boxed{}` of a MATH solution, the `answer` field elsewhere.
"""

from __future__ import annotations

import functools
import random
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from copes.rewards import extract_answer, last_boxed, math_correct_batch
from copes.tasks.base import Example, Score, batch_used_tools, register
from copes.tasks.dataset import DatasetTask
from copes.tasks.loading import DatasetError, HubSplit, load_split_rows, resolve_data_dir

MATH_INSTRUCTION = (
    "Solve the following math problem. Reason step by step. You may use the available tools, for example run "
    "Python code to check a computation. Give your final answer inside <answer></answer> tags, written as "
    "\\boxed{...}, for example <answer>\\boxed{42}</answer>."
)


class MathTask(DatasetTask):
    """A math dataset as a `Task`; `splits` maps each split name to a function building its examples."""

    kind = "math"
    chat = True

    def __init__(
        self,
        name: str,
        splits: dict[str, Callable[[], list[Example]]],
        *,
        timeout_s: float | None = None,
        **reward_terms: bool,
    ) -> None:
        """`reward_terms`: DatasetTask's format_reward and tool_bonus switches."""
        super().__init__(name, splits, **reward_terms)
        self.timeout_s = timeout_s  # per math-verify check; None = the pool's default

    def prompt(self, example: Example) -> str:
        return f"{MATH_INSTRUCTION}\n\nProblem: {example.question}"

    def score(self, completion: str, example: Example, *, used_tool: bool = False) -> Score:
        return self.score_batch([completion], [example], used_tools=[used_tool])[0]

    def score_batch(
        self, completions: Sequence[str], examples: Sequence[Example], used_tools: Sequence[bool] | None = None
    ) -> list[Score]:
        """`score` for many rollouts at once: the math-verify checks run in parallel on the worker pool."""
        used_tools = batch_used_tools(completions, examples, used_tools)
        answers = [extract_answer(completion) for completion in completions]
        # One check per (rollout, accepted gold); a rollout is correct when any of its golds matches.
        owners = [index for index, example in enumerate(examples) for _ in example.golds]
        verdicts = math_correct_batch(
            [answers[index] for index in owners],
            [gold for example in examples for gold in example.golds],
            timeout_s=self.timeout_s,
        )
        correct = [False] * len(completions)
        for index, verdict in zip(owners, verdicts):
            correct[index] = correct[index] or verdict
        return [
            Score(reward=self._shaped_reward(float(is_correct), completion, is_correct, used_tool), correct=is_correct,
                  answer=answer)
            for completion, is_correct, used_tool, answer in zip(completions, correct, used_tools, answers)
        ]


def _gsm8k_gold(solution: str, where: str) -> str:
    if "####" not in solution:
        raise DatasetError(f"{where}: the answer has no '#### <number>' final line")
    return solution.rsplit("####", 1)[1].strip().replace(",", "")


def _boxed_gold(solution: str, where: str) -> str:
    boxed = last_boxed(solution)
    if boxed is None:
        raise DatasetError(f"{where}: the solution has no \\boxed{{}} answer")
    return boxed


def _examples(
    rows: list[dict[str, Any]], question: str, id_of: Callable[[int, dict[str, Any]], str],
    gold_of: Callable[[int, dict[str, Any]], str],
) -> list[Example]:
    """One Example per row; the row's remaining fields (level, subject, solution, ...) stay in `meta` for analysis
    (the question is not repeated)."""
    return [
        Example(id=id_of(index, row), question=row[question], golds=(gold_of(index, row),),
                meta={key: value for key, value in row.items() if key != question})
        for index, row in enumerate(rows)
    ]


def _gsm8k_split(data_dir: Path | None, split: str) -> list[Example]:
    rows = load_split_rows(
        data_dir, [f"math/gsm8k_{split}.jsonl"], HubSplit("openai/gsm8k", split, "main"), ("question", "answer")
    )
    return _examples(rows, "question", lambda index, _: f"gsm8k-{split}-{index}",
                     lambda index, row: _gsm8k_gold(row["answer"], f"gsm8k {split} row {index}"))


def _math_examples(rows: list[dict[str, Any]], split: str) -> list[Example]:
    return _examples(rows, "problem", lambda index, row: f"math-{split}-{row.get('idx', index)}",
                     lambda index, row: _boxed_gold(row["solution"], f"math {split} row {index}"))


def _answer_field_examples(rows: list[dict[str, Any]], name: str, id_field: str | None) -> list[Example]:
    return _examples(rows, "problem", lambda index, row: f"{name}-{row[id_field] if id_field else index}",
                     lambda _, row: str(row["answer"]).strip())


@register("gsm8k")
def gsm8k(data_dir: str | Path | None = None, **reward_options: Any) -> MathTask:
    """GSM8K train / test. `reward_options`: MathTask's format_reward, tool_bonus, timeout_s."""
    root = resolve_data_dir(data_dir)
    return MathTask(
        "gsm8k", {split: functools.partial(_gsm8k_split, root, split) for split in ("train", "test")}, **reward_options
    )


@register("math")
def hendrycks_math(
    data_dir: str | Path | None = None, validation_size: int = 750, split_seed: int = 0, **reward_options: Any
) -> MathTask:
    """MATH: "train" and "validation" partition the 7500 training problems (`validation_size` held out, chosen
    by `split_seed`, both in file order); "test" is the 5000-problem MATH test set (the paper's MATH-Test)."""
    if validation_size < 0:
        raise ValueError(f"validation_size must be >= 0, got {validation_size}")
    root = resolve_data_dir(data_dir)
    required = ("problem", "solution")

    @functools.cache
    def train_and_validation() -> tuple[list[Example], list[Example]]:
        hub = HubSplit("DigitalLearningGmbH/MATH-lighteval", "train")
        examples = _math_examples(load_split_rows(root, ["math/math_train.jsonl"], hub, required), "train")
        if validation_size > len(examples):
            raise ValueError(f"validation_size {validation_size} exceeds the {len(examples)} MATH training problems")
        held_out = set(random.Random(split_seed).sample(range(len(examples)), validation_size))
        return (
            [example for index, example in enumerate(examples) if index not in held_out],
            [example for index, example in enumerate(examples) if index in held_out],
        )

    def test() -> list[Example]:
        hub = HubSplit("DigitalLearningGmbH/MATH-lighteval", "test")
        return _math_examples(load_split_rows(root, ["math/math_test.jsonl"], hub, required), "test")

    splits = {"train": lambda: train_and_validation()[0], "validation": lambda: train_and_validation()[1], "test": test}
    return MathTask("math", splits, **reward_options)


def _answer_field_task(
    name: str, data_dir: str | Path | None, local_file: str, hub: HubSplit, id_field: str | None, **reward_options: Any
) -> MathTask:
    root = resolve_data_dir(data_dir)

    def test() -> list[Example]:
        return _answer_field_examples(load_split_rows(root, [local_file], hub, ("problem", "answer")), name, id_field)

    return MathTask(name, {"test": test}, **reward_options)


@register("math500")
def math500(data_dir: str | Path | None = None, **reward_options: Any) -> MathTask:
    """MATH-500 (test only)."""
    hub = HubSplit("HuggingFaceH4/MATH-500", "test")
    return _answer_field_task("math500", data_dir, "math/math500_test.jsonl", hub, "unique_id", **reward_options)


@register("aime24")
def aime24(data_dir: str | Path | None = None, **reward_options: Any) -> MathTask:
    """AIME 2024, 30 problems (test only)."""
    hub = HubSplit("HuggingFaceH4/aime_2024", "train")
    return _answer_field_task("aime24", data_dir, "math/aime24_test.jsonl", hub, "id", **reward_options)


@register("aime25")
def aime25(data_dir: str | Path | None = None, **reward_options: Any) -> MathTask:
    """AIME 2025, 30 problems (test only)."""
    hub = HubSplit("math-ai/aime25", "test")
    return _answer_field_task("aime25", data_dir, "math/aime25_test.jsonl", hub, None, **reward_options)

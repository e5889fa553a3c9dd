"""Countdown: reach a target with 3-4 given numbers and + - * / (the headline task of "ES at Scale" and EGGROLL,
in the TinyZero format).

Instances are generated offline from a seed: draw the numbers, then combine them at random (two values at a time,
each step an exact positive integer) into one expression, whose value is the target, so every instance is
solvable and carries a reference solution in `meta["solution"]`. Splits are disjoint by instance (numbers as a
multiset and target), owned through the same stable hash as the arithmetic task. `source="hub"` reads
Jiayi-Pan/Countdown-Tasks-3to4 instead (a local `countdown/countdown_train.jsonl` under the data dir wins), holding
out its last rows as test and validation as TinyZero does.

Reward, as in TinyZero: 1.0 when the last `<answer>...</answer>` is a correct expression
(`copes.rewards.countdown_correct`), `FORMAT_CREDIT` when the answer tag is there but the expression is wrong,
0 without an answer tag.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

from copes.rewards import answer_span, countdown_correct
from copes.tasks.base import Example, Score, TaskBase, check_split, register
from copes.tasks.loading import HubSplit, load_split_rows, resolve_data_dir
from copes.tasks.synthetic import problem_split

SPLITS = ("train", "validation", "test")
SOURCES = ("generated", "hub")
FORMAT_CREDIT = 0.1  # TinyZero's format score: an answer tag with a wrong expression
# The prompt of TinyZero's instruct template, which "ES at Scale" also uses.
PROMPT = (
    "Using the numbers {numbers}, create an equation that equals {target}. You can use basic arithmetic "
    "operations (+, -, *, /) and each number can only be used once. Show your work in <think> </think> tags. "
    "And return the final answer in <answer> </answer> tags, for example <answer> (1 + 2) / 3 </answer>."
)
# A split that needs more draws than this per requested instance is asking for more than its share exists.
_MAX_DRAWS_PER_INSTANCE = 200
_HUB = HubSplit("Jiayi-Pan/Countdown-Tasks-3to4", "train")


def _combine(numbers: list[int], rng: random.Random) -> tuple[int, str]:
    """A random expression using every number once, every step an exact positive integer: (value, text)."""
    terms = [(number, str(number)) for number in numbers]
    rng.shuffle(terms)
    while len(terms) > 1:
        (a, a_text), (b, b_text) = terms.pop(), terms.pop()
        if a < b:
            (a, a_text), (b, b_text) = (b, b_text), (a, a_text)
        choices = [(a + b, "+"), (a * b, "*")]
        if a > b:
            choices.append((a - b, "-"))
        if b > 1 and a % b == 0:
            choices.append((a // b, "/"))
        value, operator = rng.choice(choices)
        terms.insert(rng.randrange(len(terms) + 1), (value, f"({a_text} {operator} {b_text})"))
    value, text = terms[0]
    return value, text[1:-1] if text.startswith("(") else text


def _example(split: str, index: int, numbers: list[int], target: int, solution: str | None) -> Example:
    meta: dict[str, Any] = {"numbers": numbers, "target": target}
    if solution is not None:
        meta["solution"] = solution
    return Example(id=f"countdown-{split}-{index}", question=f"{numbers} -> {target}", golds=(str(target),), meta=meta)


@register("countdown")
class CountdownTask(TaskBase):
    """Options (all keyword): source ("generated" or "hub"), seed, min_numbers, max_numbers, max_number,
    max_target, split sizes, data_dir (hub source only)."""

    name = "countdown"
    kind = "countdown"
    chat = True

    def __init__(
        self,
        *,
        source: str = "generated",
        seed: int = 0,
        min_numbers: int = 3,
        max_numbers: int = 4,
        max_number: int = 99,
        max_target: int = 100,
        train_size: int = 50_000,
        validation_size: int = 500,
        test_size: int = 1000,
        data_dir: str | Path | None = None,
    ) -> None:
        if source not in SOURCES:
            raise ValueError(f"source must be one of {SOURCES}, got {source!r}")
        if not 2 <= min_numbers <= max_numbers:
            raise ValueError(f"need 2 <= min_numbers <= max_numbers, got {min_numbers} and {max_numbers}")
        if max_number < 1 or max_target < 1:
            raise ValueError(f"max_number and max_target must be >= 1, got {max_number} and {max_target}")
        self.sizes = {"train": train_size, "validation": validation_size, "test": test_size}
        if any(size < 0 for size in self.sizes.values()):
            raise ValueError(f"split sizes must be >= 0, got {self.sizes}")
        self.source, self.seed, self.data_dir = source, seed, resolve_data_dir(data_dir)
        self.count_range, self.max_number, self.max_target = (min_numbers, max_numbers), max_number, max_target
        self._cache: dict[str, list[Example]] = {}

    def _generate(self, split: str) -> list[Example]:
        rng = random.Random(f"countdown/{self.seed}/{split}")
        seen: set[str] = set()
        examples: list[Example] = []
        for _ in range(_MAX_DRAWS_PER_INSTANCE * self.sizes[split]):
            if len(examples) == self.sizes[split]:
                return examples
            numbers = [rng.randint(1, self.max_number) for _ in range(rng.randint(*self.count_range))]
            target, solution = _combine(numbers, rng)
            key = f"{sorted(numbers)}->{target}"
            if target > self.max_target or key in seen or problem_split(key) != split:
                continue
            seen.add(key)
            examples.append(_example(split, len(examples), numbers, target, solution))
        if len(examples) < self.sizes[split]:
            raise ValueError(f"{split}_size={self.sizes[split]} exceeds the countdown instances reachable with "
                             f"max_number={self.max_number}, max_target={self.max_target} (found {len(examples)})")
        return examples

    def _from_hub(self, split: str) -> list[Example]:
        rows = load_split_rows(self.data_dir, ["countdown/countdown_train.jsonl"], _HUB, ("target", "nums"))
        test_start = len(rows) - self.sizes["test"]
        validation_start = test_start - self.sizes["validation"]
        if validation_start < 0:
            raise ValueError(f"{len(rows)} countdown rows cannot hold out "
                             f"{self.sizes['validation']} + {self.sizes['test']}")
        start, stop = {"train": (0, validation_start), "validation": (validation_start, test_start),
                       "test": (test_start, len(rows))}[split]
        return [_example(split, index, [int(n) for n in row["nums"]], int(row["target"]), None)
                for index, row in enumerate(rows[start:stop])]

    def examples(self, split: str, limit: int | None = None) -> list[Example]:
        check_split(split, limit, SPLITS)
        if split not in self._cache:
            self._cache[split] = self._generate(split) if self.source == "generated" else self._from_hub(split)
        return self._cache[split][:limit]

    def prompt(self, example: Example) -> str:
        return PROMPT.format(numbers=example.meta["numbers"], target=example.meta["target"])

    def score(self, completion: str, example: Example, *, used_tool: bool = False) -> Score:
        span = answer_span(completion)
        if span is None:
            return Score(reward=0.0, correct=False, answer="")
        answer = span.strip()
        correct = countdown_correct(answer, example.meta["numbers"], example.meta["target"])
        return Score(reward=1.0 if correct else FORMAT_CREDIT, correct=correct, answer=answer)

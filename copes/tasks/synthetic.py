"""Synthetic integer arithmetic ("37+485=" -> "522"): the task the embedded tiny model is trained on.

Problems come from a seeded generator, so every split is reproducible without a data file. Each operand gets
a uniformly drawn digit count (1..max_digits) and then a uniform value with that many digits, which keeps
short problems in the mix instead of 90% three-digit ones.

Splits are disjoint by problem: a stable hash of the problem text (not of the seed) puts every possible
problem in exactly one split, so no seed or split size can leak a test problem into training.

The prompt is the raw problem text (chat=False); the model answers with the result and then EOS. The reward
is 1.0 for an exact answer; with `digit_shaping > 0` a wrong answer still earns `digit_shaping` times the
fraction of right-aligned characters it gets right, a dense signal for evolution strategies.
"""

from __future__ import annotations

import hashlib
import random

from copes.tasks.base import Example, Score, TaskBase, check_split, register

SPLITS = ("train", "validation", "test")
SUPPORTED_OPERATIONS = "+-*"
# Share of the problem space (in hash buckets out of 100) each held-out split owns; train owns the rest.
_HELD_OUT_BUCKETS = {"validation": range(5), "test": range(5, 10)}
# A split that needs more draws than this per requested problem is asking for more than its share exists.
_MAX_DRAWS_PER_PROBLEM = 200


def problem_split(text: str) -> str:
    """The split that owns problem `text` (e.g. "37+485="), fixed for every seed."""
    bucket = int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little") % 100
    for split, buckets in _HELD_OUT_BUCKETS.items():
        if bucket in buckets:
            return split
    return "train"


def solve(left: int, operation: str, right: int) -> int:
    if operation == "+":
        return left + right
    if operation == "-":
        return left - right
    if operation == "*":
        return left * right
    raise ValueError(f"operation must be one of {SUPPORTED_OPERATIONS!r}, got {operation!r}")


def extract_answer(completion: str) -> str:
    """The model's answer: its output up to the first newline (EOS is already gone after decoding)."""
    return completion.split("\n", 1)[0].strip()


def digit_accuracy(answer: str, gold: str) -> float:
    """Fraction of characters (digits and sign) that match when both strings are right-aligned."""
    width = max(len(answer), len(gold))
    if width == 0:
        return 1.0
    matches = sum(a == g for a, g in zip(answer.rjust(width), gold.rjust(width)))
    return matches / width


@register("arithmetic")
class ArithmeticTask(TaskBase):
    """Options (all keyword): seed, operations (subset of "+-*"), max_digits, split sizes, digit_shaping."""

    name = "arithmetic"
    kind = "synthetic"
    chat = False

    def __init__(
        self,
        *,
        seed: int = 0,
        operations: str = "+-",
        max_digits: int = 3,
        train_size: int = 100_000,
        validation_size: int = 2000,  # a 500-problem evaluation has a ~2-point standard error
        test_size: int = 1000,
        digit_shaping: float = 0.0,
    ) -> None:
        if not operations or any(op not in SUPPORTED_OPERATIONS for op in operations):
            raise ValueError(f"operations must be a non-empty string over {SUPPORTED_OPERATIONS!r}, got {operations!r}")
        if max_digits < 1:
            raise ValueError(f"max_digits must be >= 1, got {max_digits}")
        if not 0.0 <= digit_shaping < 1.0:
            raise ValueError(f"digit_shaping must be in [0, 1) so an exact answer stays the best, got {digit_shaping}")
        self.sizes = {"train": train_size, "validation": validation_size, "test": test_size}
        for split, size in self.sizes.items():
            if size < 0:
                raise ValueError(f"{split}_size must be >= 0, got {size}")
        self.seed = seed
        self.operations = sorted(set(operations), key=operations.index)
        self.max_digits = max_digits
        self.digit_shaping = digit_shaping
        self._cache: dict[str, list[Example]] = {}

    def _operand(self, rng: random.Random) -> int:
        digits = rng.randint(1, self.max_digits)
        return rng.randint(0 if digits == 1 else 10 ** (digits - 1), 10**digits - 1)

    def _generate(self, split: str) -> list[Example]:
        size = self.sizes[split]
        # The split name is part of the stream so each split draws its own sequence from the same seed.
        rng = random.Random(f"arithmetic/{self.seed}/{split}")
        seen: set[str] = set()
        examples: list[Example] = []
        for _ in range(_MAX_DRAWS_PER_PROBLEM * size):
            if len(examples) == size:
                break
            left, operation, right = self._operand(rng), rng.choice(self.operations), self._operand(rng)
            question = f"{left}{operation}{right}="
            if question in seen or problem_split(question) != split:
                continue
            seen.add(question)
            examples.append(
                Example(
                    id=f"{split}-{len(examples)}",
                    question=question,
                    golds=(str(solve(left, operation, right)),),
                    meta={"left": left, "operation": operation, "right": right},
                )
            )
        if len(examples) < size:
            raise ValueError(
                f"{split}_size={size} exceeds the {split} problems reachable with max_digits={self.max_digits} "
                f"and operations={''.join(self.operations)!r} (found {len(examples)})"
            )
        return examples

    def examples(self, split: str, limit: int | None = None) -> list[Example]:
        check_split(split, limit, SPLITS)
        if split not in self._cache:
            self._cache[split] = self._generate(split)
        return self._cache[split][:limit]

    def prompt(self, example: Example) -> str:
        return example.question

    def score(self, completion: str, example: Example, *, used_tool: bool = False) -> Score:
        answer = extract_answer(completion)
        gold = example.golds[0]
        if answer == gold:
            return Score(reward=1.0, correct=True, answer=answer)
        shaped = self.digit_shaping * digit_accuracy(answer, gold) if self.digit_shaping else 0.0
        return Score(reward=shaped, correct=False, answer=answer)

"""Reward functions by name or import path, with TRL's signature, user code isolated in worker processes.

A reward function is `FUNCTION(completions: list[str], **kwargs) -> list[float | None]`, TRL's `reward_funcs`
signature: it is called with the batch's `completions`, its `prompts` and every dataset column as a list (one
entry per completion), so a TRL reward function works unchanged. `None` (or NaN) marks an invalid reward,
which the trainer scores as today's invalid rewards (the worst finite reward of the step, counted in
`num_invalid_rewards`).

A spec names one: a built-in (`REWARD_NAMES`: exact, math, qa_em, qa_f1, countdown, format) or
`MODULE:FUNCTION`, imported from the working directory or PYTHONPATH. Built-ins run in this process (math's
verifier has its own pool). A user function runs in a persistent worker process of its own
(`copes.rewards.deadline`: a fresh interpreter that imports it by name, never re-running the caller's script) with
a per-call timeout: an exception, a hang, a dead worker or a malformed result makes that call's rewards invalid
and prints one warning per function (a hung worker is killed, and the function skipped for the rest of the step).
A reward invalid for every row of `--invalid-reward-steps` steps in a row stops the run (`copes.run.trainer`).
"""

from __future__ import annotations

import math
import numbers
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from copes.errors import ConfigError
from copes.rewards.countdown import countdown_correct
from copes.rewards.deadline import DeadlineWorker, WorkerDied, WorkerRaised, WorkerTimeout
from copes.rewards.extract import answer_span, extract_answer
from copes.rewards.format import format_reward
from copes.rewards.math import math_correct_batch
from copes.rewards.qa import qa_scores
from copes.user_code import import_object, is_import_path

RewardFunction = Callable[..., list[Any]]
DEFAULT_TIMEOUT_S = 30.0
# How long a fresh worker may take to import the user's module before its call counts as hung.
_STARTUP_TIMEOUT_S = 120.0


# ---------------------------------------------------------------------------------------------------------
# Built-ins: TRL-signature wrappers over copes.rewards, reading the gold from the task's answer column.


def _golds(value: Any) -> list[str]:
    """Accepted answers of one row: a list column holds several (QA aliases), anything else is one; a worked
    solution ending in GSM8K's `#### N` line counts as its N."""
    values = value if isinstance(value, (list, tuple)) and value else [value]
    return [str(v).rsplit("####", 1)[1].strip().replace(",", "") if "####" in str(v) else str(v) for v in values]


def _exact(completions: list[str], answers: list[Any]) -> list[float]:
    return [float(extract_answer(c) in _golds(a)) for c, a in zip(completions, answers)]


def _math(completions: list[str], answers: list[Any]) -> list[float]:
    return [float(ok) for ok in math_correct_batch([extract_answer(c) for c in completions],
                                                   [_golds(a)[0] for a in answers])]


def _qa(metric: str) -> Callable[[list[str], list[Any]], list[float]]:
    def score(completions: list[str], answers: list[Any]) -> list[float]:
        return [qa_scores(extract_answer(c), _golds(a))[metric] for c, a in zip(completions, answers)]

    return score


def _format(completions: list[str], answers: list[Any]) -> list[float]:
    return [format_reward(c, "math") for c in completions]


def _countdown(completions: list[str], columns: dict[str, list[Any]]) -> list[float]:
    numbers = columns.get("nums", columns.get("numbers"))
    if numbers is None or "target" not in columns:
        raise ConfigError("the countdown reward needs the columns 'target' and 'nums' (or 'numbers')")
    spans = [answer_span(c) for c in completions]
    return [float(span is not None and countdown_correct(span.strip(), [int(n) for n in row_numbers], int(target)))
            for span, row_numbers, target in zip(spans, numbers, columns["target"])]


_ANSWER_BUILTINS: dict[str, Callable[[list[str], list[Any]], list[float]]] = {
    "exact": _exact, "math": _math, "qa_em": _qa("em"), "qa_f1": _qa("f1"), "format": _format,
}
REWARD_NAMES = (*_ANSWER_BUILTINS, "countdown")


def builtin_reward(name: str, answer_field: str) -> RewardFunction:
    """The built-in `name` as a TRL-signature function reading the gold answers from column `answer_field`."""
    if name == "countdown":
        return lambda completions, **columns: _countdown(completions, columns)
    score = _ANSWER_BUILTINS[name]

    def reward(completions: list[str], **columns: Any) -> list[float]:
        if answer_field not in columns:
            raise ConfigError(f"the {name} reward reads the answer column {answer_field!r}, which the rows lack")
        return score(completions, columns[answer_field])

    return reward


# ---------------------------------------------------------------------------------------------------------
# Worker processes.


class RewardCallFailed(Exception):
    """A user reward call gave no usable rewards; the message says why (for the one warning)."""


class WorkerReward:
    """A user reward function in its own persistent worker process (`copes.rewards.deadline`); each call waits at
    most `timeout_s`, and after a timeout the function is abandoned until `new_step()`: a hanging reward costs one
    timeout per step, not one per call."""

    def __init__(self, function: str | Callable[..., Any], *, timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
        self.worker = DeadlineWorker(function, abandon_after_timeout=True, startup_timeout_s=_STARTUP_TIMEOUT_S)
        self.timeout_s = timeout_s

    def new_step(self) -> None:
        self.worker.resume()

    def stop(self) -> None:
        self.worker.close()

    def __call__(self, completions: list[str], **columns: Any) -> list[Any]:
        try:
            return self.worker.call(completions, timeout_s=self.timeout_s, **columns)
        except WorkerTimeout:
            raise RewardCallFailed(f"gave no answer within {self.timeout_s:g}s (its worker was killed; the reward "
                                   "is skipped for the rest of this step)") from None
        except WorkerDied as error:
            raise RewardCallFailed(str(error)) from None
        except WorkerRaised as error:
            raise RewardCallFailed(f"raised {error}") from None


# ---------------------------------------------------------------------------------------------------------
# A run's rewards: specs resolved, called on a batch, weighted into one reward per completion.


def callable_label(function: Callable[..., Any]) -> str:
    """`module:qualname` of a Python reward callable (what the journal and warnings call it)."""
    return f"{getattr(function, '__module__', '?')}:{getattr(function, '__qualname__', repr(function))}"


def resolve_reward(spec: str | Callable[..., Any], *, answer_field: str,
                   timeout_s: float = DEFAULT_TIMEOUT_S) -> tuple[str, RewardFunction]:
    """(label, function) for a built-in name, a `MODULE:FUNCTION` path or a callable; user code gets a worker."""
    if callable(spec):
        return callable_label(spec), WorkerReward(spec, timeout_s=timeout_s)
    if spec in REWARD_NAMES:
        return spec, builtin_reward(spec, answer_field)
    if is_import_path(spec):
        if not callable(import_object(spec, "--reward")):  # fails here, in one line, rather than in a worker
            raise ConfigError(f"--reward {spec} is not a function")
        return spec, WorkerReward(spec, timeout_s=timeout_s)
    raise ConfigError(f"unknown reward {spec!r}; give a built-in ({', '.join(REWARD_NAMES)}) or MODULE:FUNCTION")


def _described(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def validated(values: Any, rows: int) -> list[float]:
    """The one check of a reward function's result: a list or tuple of exactly one number per completion (None,
    NaN and inf mark an invalid reward and become NaN); anything else fails the whole call."""
    if not isinstance(values, (list, tuple)):
        raise RewardCallFailed(f"returned {type(values).__name__} {_described(values)}, not a list of {rows} rewards")
    if len(values) != rows:
        raise RewardCallFailed(f"returned {len(values)} rewards for {rows} completions (one per completion)")
    checked = []
    for value in values:
        if value is None:
            checked.append(math.nan)
        elif isinstance(value, numbers.Real):  # bool, int, float and numpy's scalars; "1.0" is not a number
            checked.append(float(value) if math.isfinite(value) else math.nan)
        else:
            raise RewardCallFailed(f"returned {type(value).__name__} {_described(value)} among its rewards "
                                   "(rewards are numbers, or None for an invalid one)")
    return checked


@dataclass
class RewardStepStats:
    """One reward function's values over a step: what `rewards/<label>/mean` and the invalid-reward stop read."""

    rows: int = 0
    valid: int = 0
    total: float = 0.0
    last_error: str | None = None

    def merged(self, other: RewardStepStats) -> RewardStepStats:
        return RewardStepStats(self.rows + other.rows, self.valid + other.valid, self.total + other.total,
                               other.last_error or self.last_error)

    @property
    def mean(self) -> float | None:
        return self.total / self.valid if self.valid else None


class RewardSet:
    """Several reward functions and their weights; a completion's reward is the weighted sum, NaN (invalid)
    when any of its terms is. Each function that fails is warned about once, and so is each that returns NaN or
    inf. `new_step()` starts a step's per-function statistics (`step_stats`) and serves abandoned functions again."""

    def __init__(self, rewards: Sequence[tuple[str, RewardFunction]], weights: Sequence[float] = ()) -> None:
        if not rewards:
            raise ConfigError("a reward set needs at least one reward function")
        if weights and len(weights) != len(rewards):
            raise ConfigError(f"--reward-weights gives {len(weights)} weights for {len(rewards)} rewards "
                              f"({', '.join(label for label, _ in rewards)})")
        self.rewards, self.weights = list(rewards), [float(w) for w in weights] or [1.0] * len(rewards)
        self.warned: set[tuple[str, str]] = set()
        self.step_stats = {label: RewardStepStats() for label in self.labels}

    @property
    def labels(self) -> list[str]:
        return [label for label, _ in self.rewards]

    def new_step(self) -> None:
        self.step_stats = {label: RewardStepStats() for label in self.labels}
        for _, function in self.rewards:
            if isinstance(function, WorkerReward):
                function.new_step()

    def _warn_once(self, label: str, kind: str, message: str) -> None:
        if (label, kind) not in self.warned:
            self.warned.add((label, kind))
            print(f"warning: reward {label} {message}", file=sys.stderr, flush=True)

    def _terms(self, label: str, function: RewardFunction, completions: list[str],
               columns: dict[str, list[Any]]) -> list[float]:
        stats = self.step_stats[label]
        stats.rows += len(completions)
        try:
            values = function(completions, **columns)
            terms = validated(values, len(completions))
        except RewardCallFailed as failure:
            stats.last_error = str(failure)
            self._warn_once(label, "failed", f"{failure}; those rewards count as invalid (later failures of this "
                                             "reward are not reported again)")
            return [math.nan] * len(completions)
        valid = [term for term in terms if not math.isnan(term)]
        stats.valid, stats.total = stats.valid + len(valid), stats.total + sum(valid)
        nonfinite = sum(value is not None and math.isnan(term) for value, term in zip(values, terms))
        if nonfinite:
            self._warn_once(label, "nonfinite", f"returned NaN or inf for {nonfinite} of {len(terms)} completions; "
                                                "those rewards count as invalid (return None to mark one on purpose)")
        if not valid:
            stats.last_error = f"no valid reward among {len(terms)} completions"
        return terms

    def score(self, completions: Sequence[str], prompts: Sequence[str],
              rows: Sequence[dict[str, Any]]) -> tuple[list[float], list[float]]:
        """(the weighted reward of each completion, the first function's value: what accuracy counts)."""
        names = dict.fromkeys(key for row in rows for key in row)
        columns = {name: [row.get(name) for row in rows] for name in names} | {"prompts": list(prompts)}
        terms = [self._terms(label, function, list(completions), columns) for label, function in self.rewards]
        totals = [sum(weight * term[i] for weight, term in zip(self.weights, terms)) for i in range(len(completions))]
        return totals, terms[0]

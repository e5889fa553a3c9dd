"""Reward functions by name or import path, with TRL's signature, user code isolated in worker processes.

A reward function is `FUNCTION(completions: list[str], **kwargs) -> list[float | None]`, TRL's `reward_funcs`
signature: it is called with the batch's `completions`, its `prompts` and every dataset column as a list (one
entry per completion), so a TRL reward function works unchanged. `None` (or NaN) marks an invalid reward,
which the trainer scores as today's invalid rewards (the worst finite reward of the step, counted in
`num_invalid_rewards`).

A spec names one: a built-in (`REWARD_NAMES`: exact, math, qa_em, qa_f1, countdown, format) or
`MODULE:FUNCTION`, imported from the working directory or PYTHONPATH. Built-ins run in this process (math's
verifier has its own pool). A user function runs in a persistent worker process of its own with a per-call
timeout: an exception, a hang, a dead worker or a malformed result makes that call's rewards invalid and prints
one warning per function, never ends the run (a hung worker is killed and a fresh one serves the next call).
"""

from __future__ import annotations

import math
import multiprocessing
import pickle
import sys
from collections.abc import Callable, Sequence
from typing import Any

from copes.errors import ConfigError
from copes.rewards.countdown import countdown_correct
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


def _serve(connection: Any, target: str | bytes | Callable[..., Any]) -> None:
    """Worker side: resolve the function once (an import path, a pickled reference, or inherited through fork),
    then answer (completions, columns) calls until the pipe closes."""
    try:
        if isinstance(target, str):
            function = import_object(target, "reward")
        else:
            function = pickle.loads(target) if isinstance(target, bytes) else target
    except Exception as error:  # noqa: BLE001 - reported to the parent, which warns
        connection.send(("error", f"could not be loaded: {type(error).__name__}: {error}"))
        return
    connection.send(("ready", None))
    while True:
        try:
            completions, columns = connection.recv()
        except EOFError:
            return
        try:
            connection.send(("ok", function(completions, **columns)))
        except Exception as error:  # noqa: BLE001 - any failure of user code is that call's invalid rewards
            connection.send(("error", f"{type(error).__name__}: {error}"))


class RewardCallFailed(Exception):
    """A user reward call gave no usable rewards; the message says why (for the one warning)."""


class WorkerReward:
    """A user reward function in its own persistent worker process; each call waits at most `timeout_s`."""

    def __init__(self, function: str | Callable[..., Any], *, timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
        self.target: str | bytes | Callable[..., Any] = function
        self.context = multiprocessing.get_context("spawn")  # spawned: the worker inherits no threads or model
        if callable(function):
            try:  # a module-level function travels into a spawned worker by reference
                self.target = pickle.dumps(function)
            except (pickle.PicklingError, AttributeError, TypeError):  # a lambda or closure: inherit it by fork
                self.context = multiprocessing.get_context("fork")
        self.timeout_s = timeout_s
        self.process: Any = None
        self.connection: Any = None
        self.startup: tuple[str, Any] = ("ready", None)

    def _start(self) -> None:
        parent, child = self.context.Pipe()
        self.process = self.context.Process(target=_serve, args=(child, self.target), daemon=True)
        self.process.start()
        child.close()
        self.connection = parent
        try:  # the worker first imports the user's module (and whatever that imports)
            self.startup = parent.recv() if parent.poll(_STARTUP_TIMEOUT_S) else ("hang", None)
        except (EOFError, OSError):
            self.startup = ("died", None)

    def stop(self) -> None:
        if self.process is not None:
            self.process.kill()
            self.process.join()
            self.connection.close()
        self.process = self.connection = None

    def __call__(self, completions: list[str], **columns: Any) -> list[Any]:
        if self.process is None or not self.process.is_alive():
            self._start()
        status, value = self.startup
        if status == "ready":
            try:
                self.connection.send((completions, columns))
                status, value = self.connection.recv() if self.connection.poll(self.timeout_s) else ("hang", None)
            except (EOFError, OSError):
                status, value = "died", None
        if status == "ok":
            return value
        self.stop()
        if status == "hang":
            raise RewardCallFailed(f"gave no answer within {self.timeout_s:g}s (its worker was killed and replaced)")
        if status == "died":
            raise RewardCallFailed("lost its worker process (a fresh one serves the next call)")
        raise RewardCallFailed(f"raised {value}")


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


def _checked(values: Any, rows: int) -> list[float]:
    """A reward function's result as floats (None -> NaN, the invalid marker); anything else is a failure."""
    if not isinstance(values, (list, tuple)) or len(values) != rows:
        raise RewardCallFailed(f"returned {type(values).__name__} {str(values)[:60]}, not a list of {rows} rewards")
    try:
        return [math.nan if value is None else float(value) for value in values]
    except (TypeError, ValueError):
        raise RewardCallFailed(f"returned a non-number among {str(values)[:60]}") from None


class RewardSet:
    """Several reward functions and their weights; a completion's reward is the weighted sum, NaN (invalid)
    when any of its terms is. Each function that fails is warned about once."""

    def __init__(self, rewards: Sequence[tuple[str, RewardFunction]], weights: Sequence[float] = ()) -> None:
        if not rewards:
            raise ConfigError("a reward set needs at least one reward function")
        if weights and len(weights) != len(rewards):
            raise ConfigError(f"--reward-weights gives {len(weights)} weights for {len(rewards)} rewards "
                              f"({', '.join(label for label, _ in rewards)})")
        self.rewards, self.weights = list(rewards), [float(w) for w in weights] or [1.0] * len(rewards)
        self.warned: set[str] = set()

    @property
    def labels(self) -> list[str]:
        return [label for label, _ in self.rewards]

    def _terms(self, label: str, function: RewardFunction, completions: list[str],
               columns: dict[str, list[Any]]) -> list[float]:
        try:
            return _checked(function(completions, **columns), len(completions))
        except RewardCallFailed as failure:
            if label not in self.warned:
                self.warned.add(label)
                print(f"warning: reward {label} {failure}; those rewards count as invalid (later failures of "
                      "this reward are not reported again)", file=sys.stderr, flush=True)
            return [math.nan] * len(completions)

    def score(self, completions: Sequence[str], prompts: Sequence[str],
              rows: Sequence[dict[str, Any]]) -> tuple[list[float], list[float]]:
        """(the weighted reward of each completion, the first function's value: what accuracy counts)."""
        names = dict.fromkeys(key for row in rows for key in row)
        columns = {name: [row.get(name) for row in rows] for name in names} | {"prompts": list(prompts)}
        terms = [self._terms(label, function, list(completions), columns) for label, function in self.rewards]
        totals = [sum(weight * term[i] for weight, term in zip(self.weights, terms)) for i in range(len(completions))]
        return totals, terms[0]

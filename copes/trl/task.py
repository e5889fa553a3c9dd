"""A TRL dataset as a copes Task, scored by reward functions called as TRL's GRPOTrainer calls them, with TRL's
tools and environments inside copes' agent loop (copes.ESTrainer's data side).

- Rows: TRL's formats. `prompt` is plain text (standard: fed raw, one turn) or a list of `{"role", "content"}`
  messages (conversational: rendered with the chat template and `chat_template_kwargs`, tools allowed). Every other
  column travels with the row and reaches each reward function as a keyword list.
- Rewards (`TRLRewards`): `f(prompts=, completions=, completion_ids=, trainer_state=, log_extra=, log_metric=,
  [environments=,] **columns) -> list[float | None]`; completions are strings (standard) or one-message assistant
  lists (conversational); async functions run to completion; `None` is NaN; what a call prints is capped (tools' too,
  `copes.user_code.OutputCap`). A completion's reward is TRL's: the
  weighted sum of the functions that scored it (`nansum`), NaN (invalid) only when none did.
- Tools: a function with type hints and a Google-style docstring (transformers' `get_json_schema`); a call past
  `tool_timeout_s` becomes an observation saying it timed out. Environments: one `environment_factory()` instance
  per rollout row, `reset(**row)` before the rollout (a returned string is appended to the last user message, as
  TRL does; without a train_dataset it is the user message), its public methods as tools of that row, and an
  optional `get_reward()` that becomes one more reward function (named after the class, weight 1).

Each member's completions for the shared prompt batch are scored in one call per function.
"""

from __future__ import annotations

import asyncio
import hashlib
import inspect
import json
import math
import random
import threading
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

from copes.errors import ConfigError
from copes.rewards import extract_answer
from copes.rewards.functions import REWARD_NAMES, builtin_reward
from copes.tasks.base import Example, Score, TaskBase, batch_used_tools
from copes.user_code import OutputCap

CORRECT_AT = 1.0  # the first reward's value from which a rollout counts as correct (held-out accuracy)


def is_conversational(row: dict[str, Any]) -> bool:
    prompt = row.get("prompt")
    return isinstance(prompt, list) and all(isinstance(message, dict) and "role" in message for message in prompt)


def dataset_rows(dataset: Any, what: str) -> list[dict[str, Any]]:
    """A `datasets.Dataset` (or any sequence of mappings) as a list of rows; one line when it is not one."""
    try:
        rows = [dict(row) for row in dataset]
    except (TypeError, ValueError):
        raise ConfigError(f"{what} must be a datasets.Dataset or a list of rows, not {type(dataset).__name__}"
                          ) from None
    if rows and "prompt" not in rows[0]:
        raise ConfigError(f"{what} has no 'prompt' column (TRL's prompt-only format); it has {sorted(rows[0])}")
    return rows


def rows_fingerprint(rows: Sequence[dict[str, Any]]) -> str:
    """A short sha256 of the rows' content: the run's task name, so a resume on other data is refused."""
    digest = hashlib.sha256()
    for row in rows:
        digest.update(json.dumps(row, sort_keys=True, default=str).encode())
    return digest.hexdigest()[:16]


def function_name(function: Any) -> str:
    """TRL's name of a reward function (its metrics key `rewards/<name>/mean`)."""
    return getattr(function, "__name__", None) or type(function).__name__


def _run(value: Any) -> Any:
    """The result of a call that may be a coroutine (an async reward function, tool or get_reward)."""
    return asyncio.run(value) if inspect.iscoroutine(value) else value


class TRLRewards:
    """Reward functions and their weights, called as TRL calls them. `names` are TRL's (metrics keys)."""

    def __init__(self, functions: Sequence[Callable[..., Any]], names: Sequence[str], weights: Sequence[float]) -> None:
        self.functions, self.names, self.weights = list(functions), list(names), [float(w) for w in weights]
        self.metrics: dict[str, list[float]] = {}  # log_metric(name, value) from the functions, drained per step

    def log_metric(self, name: str, value: float) -> None:
        self.metrics.setdefault(name, []).append(float(value))

    def log_extra(self, column: str, values: list[Any]) -> None:
        """TRL's completions-table hook: ES logs no completions table (samples.jsonl holds transcripts)."""

    def values(self, prompts: list[Any], completions: list[Any], completion_ids: list[list[int]],
               columns: dict[str, list[Any]], extra: dict[str, Any]) -> list[list[float]]:
        """[rows][functions] of rewards, NaN where a function returned None."""
        per_function = []
        for name, function in zip(self.names, self.functions):
            with REWARD_OUTPUT.this_thread():
                result = _run(function(prompts=prompts, completions=completions, completion_ids=completion_ids,
                                       **columns, **extra, log_extra=self.log_extra, log_metric=self.log_metric))
            if not isinstance(result, (list, tuple)) or len(result) != len(prompts):
                raise ConfigError(f"the reward function {name!r} returned {str(result)[:60]}, not one reward per "
                                  f"completion ({len(prompts)})")
            per_function.append([math.nan if value is None else float(value) for value in result])
        return [list(row) for row in zip(*per_function)]

    def total(self, values: Sequence[float]) -> float:
        """TRL's reward of one completion: the weighted nansum, NaN when every function returned None."""
        if all(math.isnan(value) for value in values):
            return math.nan
        return sum(weight * value for weight, value in zip(self.weights, values) if not math.isnan(value))


def text_reward(name: str, answer_field: str) -> Callable[..., Any]:
    """A copes built-in reward by name, on the completions' text (conversational completions unwrapped)."""
    score = builtin_reward(name, answer_field)

    def reward(completions: list[Any], **columns: Any) -> list[float]:
        texts = [c if isinstance(c, str) else c[-1]["content"] for c in completions]
        return score(texts, **{k: v for k, v in columns.items() if k not in ("prompts", "completion_ids")})

    reward.__name__ = name
    return reward


def resolve_reward_functions(reward_funcs: Any) -> list[Callable[..., Any]]:
    """GRPOTrainer's `reward_funcs` (one or a list of callables or built-in names) as callables; a reward model (a
    model id or an nn.Module) is refused in one line."""
    functions = reward_funcs if isinstance(reward_funcs, (list, tuple)) else [reward_funcs]
    resolved = []
    for function in functions:
        if isinstance(function, str):
            if function not in REWARD_NAMES:
                raise ConfigError(f"reward_funcs {function!r}: ESTrainer scores with functions, not reward models; "
                                  f"give a callable or a built-in ({', '.join(REWARD_NAMES)})")
            resolved.append(text_reward(function, "answer"))
        elif _is_module(function):
            raise ConfigError(f"reward_funcs: a {type(function).__name__} reward model needs gradients-era scoring "
                              "ESTrainer does not run; wrap it in a function that returns one float per completion")
        elif callable(function):
            resolved.append(function)
        else:
            raise ConfigError(f"reward_funcs: {function!r} is neither a callable nor a built-in reward name")
    return resolved


def _is_module(value: Any) -> bool:
    return any(cls.__name__ == "Module" and cls.__module__.startswith("torch.nn") for cls in type(value).__mro__)


# What a user's tool or reward function prints, per call: calls run in this process, several at once.
TOOL_OUTPUT, REWARD_OUTPUT = OutputCap("a tool"), OutputCap("a reward")


def call_within(seconds: float, name: str, call: Callable[[], Any]) -> str:
    """`call()`'s result as text, or an observation saying it timed out once `seconds` pass (0: no limit). The call
    runs on a daemon thread: one that never returns is left behind without holding up the rollout or the exit. What
    it prints is capped (TOOL_OUTPUT)."""
    def observation() -> str:
        with TOOL_OUTPUT.this_thread():  # the thread that runs the tool, whichever it is
            return str(_run(call()))

    if not seconds:
        return observation()
    outcome: dict[str, Any] = {}

    def run() -> None:
        try:
            outcome["observation"] = observation()
        except Exception as error:  # noqa: BLE001 - raised again in the caller, which turns it into an observation
            outcome["error"] = error

    worker = threading.Thread(target=run, name=f"tool {name}", daemon=True)
    worker.start()
    worker.join(seconds)
    if worker.is_alive():
        return f"Error: the {name} tool timed out after {seconds:g} s (tool_timeout_s); continue without its result."
    if "error" in outcome:
        raise outcome["error"]
    return outcome["observation"]


class FunctionTool:
    """A TRL tool (a plain function with type hints and a docstring) as a copes agent tool; a call past `timeout_s`
    seconds becomes an observation saying so."""

    def __init__(self, function: Callable[..., Any], schema: dict[str, Any] | None = None,
                 timeout_s: float = 0.0) -> None:
        from transformers.utils import get_json_schema

        try:
            schema = schema or get_json_schema(function)["function"]
        except Exception as error:  # noqa: BLE001 - transformers says what the docstring or hints lack
            raise ConfigError(f"tool {function_name(function)}: {str(error).splitlines()[0]}") from None
        self.function, self.timeout_s = function, timeout_s
        self.name, self.description = schema["name"], schema.get("description", "")
        self.parameters = schema.get("parameters", {"type": "object", "properties": {}})

    def call(self, arguments: dict) -> str:
        return call_within(self.timeout_s, self.name, lambda: self.function(**arguments))


class EnvironmentTool:
    """One public method of the environment class; each call runs on the calling row's own instance."""

    def __init__(self, environments: Environments, method: Callable[..., Any], timeout_s: float = 0.0) -> None:
        self.environments, self.method_name, self.timeout_s = environments, method.__name__, timeout_s
        described = FunctionTool(method)
        self.name, self.description, self.parameters = described.name, described.description, described.parameters

    def call_in_row(self, row: int, arguments: dict) -> str:
        method = getattr(self.environments.current[row], self.method_name)
        return call_within(self.timeout_s, self.name, lambda: method(**arguments))

    def call(self, arguments: dict) -> str:
        raise RuntimeError(f"the {self.name} tool belongs to an environment instance and needs the rollout row")


class Environments:
    """`environment_factory`'s instances: one per rollout row, reset with the row before the rollout; the rows'
    instances wait, in rollout order, for the scoring of the same rows (`get_reward`, `environments=`)."""

    def __init__(self, factory: Callable[[], Any]) -> None:
        self.factory = factory
        probe = factory()
        kind = type(probe)
        if not callable(getattr(probe, "reset", None)):
            raise ConfigError(f"environment_factory made a {kind.__name__}, which has no reset(**row) method")
        self.kind = kind
        self.methods = [getattr(probe, name) for name, _ in inspect.getmembers(kind, predicate=inspect.isfunction)
                        if name not in ("reset", "get_reward") and not name.startswith("_")]
        self.has_reward = callable(getattr(probe, "get_reward", None))
        self.current: list[Any] = []
        self.waiting: deque[list[Any]] = deque()
        self.owns_data = False  # True without a train_dataset: reset() deals each question (owned_rows)

    def owned_rows(self, count: int) -> list[dict[str, Any]]:
        """`count` empty conversational rows for an environment that owns the data: each reset() returns the
        row's question (TRL's train_dataset=None)."""
        self.owns_data = True
        return [{"prompt": []} for _ in range(count)]

    def tools(self, timeout_s: float = 0.0) -> list[EnvironmentTool]:
        return [EnvironmentTool(self, method, timeout_s) for method in self.methods]

    def start(self, rows: Sequence[dict[str, Any]], keys: Sequence[str]) -> list[Any]:
        """Fresh instances for `rows`, reset with each row; returns what each reset returned. Where the environment
        owns the data (no train_dataset), Python's `random` is seeded with the row's key before each reset, so
        every member is dealt the same question for a row (ES compares members on shared questions)."""
        self.current = [self.factory() for _ in rows]
        self.waiting.append(self.current)
        observations = []
        for environment, row, key in zip(self.current, rows, keys):
            if self.owns_data:
                random.seed(key)
            observations.append(_run(environment.reset(**row)))
        return observations

    def take(self, rows: int) -> list[Any]:
        """The instances of the oldest rollout not scored yet (its `rows` rows)."""
        if not self.waiting or len(self.waiting[0]) != rows:
            raise RuntimeError(f"scoring {rows} rows, but no rollout of {rows} environment rows waits for it")
        return self.waiting.popleft()

    def reward_function(self) -> Callable[..., list[float | None]]:
        kind = self.kind

        def get_reward(environments: list[Any], **_: Any) -> list[float | None]:
            return [_run(e.get_reward()) if type(e) is kind else None for e in environments]

        get_reward.__name__ = kind.__name__
        return get_reward


def _with_observation(prompt: Any, observation: Any) -> Any:
    """TRL's rule: a string `reset()` returns is appended to the last message's content (is the user message, for
    an environment that owns the data)."""
    if not isinstance(observation, str):
        if not prompt:
            raise ConfigError("the environment owns the data (no train_dataset), but its reset() returned "
                              f"{type(observation).__name__}, not the prompt text")
        return prompt
    if not prompt:
        return [{"role": "user", "content": observation}]
    if isinstance(prompt, str):
        return prompt + observation
    return [*prompt[:-1], {**prompt[-1], "content": prompt[-1]["content"] + observation}]


class DatasetTask(TaskBase):
    """TRL rows (train and held-out) as a copes Task, scored by `TRLRewards`; see the module docstring."""

    kind = "file"
    answer_field = "answer"

    def __init__(self, train_rows: list[dict[str, Any]], eval_rows: list[dict[str, Any]], rewards: TRLRewards,
                 tokenizer: Any, environments: Environments | None = None) -> None:
        if not train_rows:
            raise ConfigError("train_dataset is empty")
        self.rows = {"train": train_rows, "validation": eval_rows}
        self.chat = is_conversational(train_rows[0])
        mixed = [split for split, rows in self.rows.items() for row in rows if is_conversational(row) != self.chat]
        if mixed:
            raise ConfigError(f"the {mixed[0]} rows mix conversational and plain-text prompts; use one format")
        self.name = f"dataset-{rows_fingerprint(train_rows + eval_rows)}"
        self.rewards, self.tokenizer, self.environments = rewards, tokenizer, environments
        self.trainer_state: Any = None  # set by ESTrainer: reward functions receive it as `trainer_state`
        self.step_values: list[list[float]] = []  # per-function values of the training rollouts since the last log
        self.step_lengths: list[int] = []
        self.step_tokens = 0  # prompt and completion tokens of those rollouts (TRL's num_tokens)
        self._prompt_lengths: dict[str, int] = {}
        self.collecting = True  # False while the held-out set is scored
        self._examples: dict[str, list[Example]] = {}

    @property
    def owns_data(self) -> bool:
        """Whether the environment deals the training prompts (no train_dataset)."""
        return self.environments is not None and self.environments.owns_data

    def examples(self, split: str, limit: int | None = None) -> list[Example]:
        key = "train" if split == "train" else "validation"
        if split not in ("train", "validation", "test") or not self.rows[key] and split != "train":
            raise ValueError(f"no {split} rows (pass eval_dataset)")
        if key not in self._examples:
            self._examples[key] = [self._example(key, index, row) for index, row in enumerate(self.rows[key])]
        return self._examples[key][:limit]

    def _example(self, split: str, index: int, row: dict[str, Any]) -> Example:
        prompt = row["prompt"]
        question = prompt if isinstance(prompt, str) else str(prompt[-1].get("content", "")) if prompt else ""
        gold = row.get("solution", row.get(self.answer_field))
        golds = tuple(map(str, gold)) if isinstance(gold, (list, tuple)) else (() if gold is None else (str(gold),))
        return Example(id=f"{split}-{index}", question=question, golds=golds, meta=row)

    def prompt(self, example: Example) -> Any:
        return example.meta["prompt"]

    def _count_prompt_tokens(self, rows: Sequence[Example], prompts: Sequence[Any]) -> None:
        """Tokens of each row's prompt as the model reads it (chat template applied), once per row."""
        for example, prompt in zip(rows, prompts):
            if example.id not in self._prompt_lengths:
                ids = (self.tokenizer.apply_chat_template(prompt, tokenize=True, add_generation_prompt=True)
                       if self.chat else self.tokenizer(prompt, add_special_tokens=False)["input_ids"])
                self._prompt_lengths[example.id] = len(ids["input_ids"] if isinstance(ids, dict) else ids)

    def start_rollout(self, rows: Sequence[Example]) -> list[Any]:
        """The rows' prompts; with an environment, each row's instance is made and reset first."""
        prompts = [self.prompt(example) for example in rows]
        if self.environments is not None:
            observations = self.environments.start([example.meta for example in rows], [e.id for e in rows])
            prompts = [_with_observation(prompt, seen) for prompt, seen in zip(prompts, observations)]
        self._count_prompt_tokens(rows, prompts)
        return prompts

    def score(self, completion: str, example: Example, *, used_tool: bool = False) -> Score:
        return self.score_batch([completion], [example], [used_tool])[0]

    def score_batch(self, completions: Sequence[str], examples: Sequence[Example],
                    used_tools: Sequence[bool] | None = None) -> list[Score]:
        batch_used_tools(completions, examples, used_tools)
        rows = [example.meta for example in examples]
        names = [key for key in dict.fromkeys(k for row in rows for k in row) if key not in ("prompt", "completion")]
        columns = {name: [row.get(name) for row in rows] for name in names}
        extra: dict[str, Any] = {"trainer_state": self.trainer_state}
        if self.environments is not None:
            extra["environments"] = self.environments.take(len(rows))
        shown = [c if not self.chat else [{"role": "assistant", "content": c}] for c in completions]
        ids = self.tokenizer(list(completions), add_special_tokens=False)["input_ids"] if completions else []
        values = self.rewards.values([row["prompt"] for row in rows], shown, ids, columns, extra)
        if self.collecting:
            self.step_values += values
            self.step_lengths += [len(row_ids) for row_ids in ids]
            self.step_tokens += sum(map(len, ids)) + sum(self._prompt_lengths.get(e.id, 0) for e in examples)
        return [Score(reward=self.rewards.total(row_values),
                      correct=not math.isnan(row_values[0]) and row_values[0] >= CORRECT_AT,
                      answer=extract_answer(completion))
                for completion, row_values in zip(completions, values)]

    def drain_step_tally(self) -> dict[str, list[float]]:
        """This process's training rollouts since the last call, as the values behind GRPO's logged keys: each
        reward function's values (`rewards/<name>`), completion lengths, prompt + completion tokens and the
        functions' log_metric values; `step_log` merges every rank's into the logged keys."""
        values, lengths, tokens = self.step_values, self.step_lengths, self.step_tokens
        self.step_values, self.step_lengths, self.step_tokens = [], [], 0
        tally: dict[str, list[float]] = {"num_tokens": [float(tokens)]}
        for index, name in enumerate(self.rewards.names):
            if values:
                tally[f"rewards/{name}"] = [row[index] for row in values if not math.isnan(row[index])]
        if lengths:
            tally[LENGTHS] = [float(length) for length in lengths]
        tally.update(self.rewards.metrics)
        self.rewards.metrics = {}
        return tally


LENGTHS = "completions/length"  # a tally's completion lengths in tokens (logged as their mean, min, max, clipped)


def _std(values: Sequence[float]) -> float:
    """TRL's nanstd (Bessel-corrected) of valid values; 0 for fewer than two."""
    if len(values) < 2:
        return 0.0
    mean = sum(values) / len(values)
    return math.sqrt(sum((value - mean) ** 2 for value in values) / (len(values) - 1))


def step_log(tallies: Sequence[dict[str, list[float]]], reward_names: Sequence[str],
             max_completion_tokens: int) -> dict[str, float]:
    """Every rank's `drain_step_tally`, merged into GRPO's keys: `rewards/<name>/mean` and `/std` (NaN for a
    function no row scored validly), `completions/mean_length`, `min_length`, `max_length`, `clipped_ratio` (rows
    whose last turn used all `max_completion_tokens`), the step's `num_tokens`, and each log_metric name's mean."""
    merged: dict[str, list[float]] = {}
    for tally in tallies:
        for key, values in tally.items():
            merged.setdefault(key, []).extend(values)
    logged: dict[str, float] = {}
    for name in reward_names:
        if f"rewards/{name}" in merged:
            scored = merged.pop(f"rewards/{name}")
            logged[f"rewards/{name}/mean"] = sum(scored) / len(scored) if scored else math.nan
            logged[f"rewards/{name}/std"] = _std(scored) if scored else math.nan
    lengths = merged.pop(LENGTHS, [])
    if lengths:
        logged.update({"completions/mean_length": sum(lengths) / len(lengths),
                       "completions/min_length": min(lengths), "completions/max_length": max(lengths),
                       "completions/clipped_ratio": sum(n >= max_completion_tokens for n in lengths) / len(lengths)})
    logged["num_tokens"] = sum(merged.pop("num_tokens", []))
    logged.update({key: sum(values) / len(values) for key, values in merged.items() if values})
    return logged

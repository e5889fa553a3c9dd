"""A user's dataset as a task: a .jsonl / .json / .parquet file, or a hub dataset, scored by reward functions.

Each row becomes one `Example`: the prompt is its `prompt_field` column, the gold its `answer_field` column, and
every column (those two included) travels in `Example.meta`, so reward functions receive them by name
(`copes.rewards.functions`). Held-out rows come from `eval_file` (a file task) or `eval_split` (a hub dataset:
"validation", else "test", when not named).

`chat=True` puts the prompt through the model's chat template (with `system_prompt` as the system turn);
`chat=False` feeds the raw text, `system_prompt` (if any) in front of it.

Scoring: the task's `RewardSet` (default: the `exact` built-in, the extracted answer equal to the gold); a rollout
counts as correct (held-out accuracy) when the first reward function gives it at least 1.
"""

from __future__ import annotations

import inspect
import math
from abc import ABC, abstractmethod
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from copes.errors import ConfigError
from copes.rewards import extract_answer
from copes.rewards.functions import RewardSet, resolve_reward
from copes.tasks.base import Example, Score, TaskBase, batch_used_tools
from copes.tasks.loading import DatasetError, read_rows

HUB_PREFIX = "hf:"
HELD_OUT_SPLITS = ("validation", "test")
CORRECT_AT = 1.0  # the first reward's value from which a rollout counts as correct
DEFAULT_REWARD = "exact"  # without --reward: the extracted answer equal to the gold column


def parse_hub_spec(spec: str) -> tuple[str, str | None]:
    """`hf:OWNER/NAME[:CONFIG]` (or `hf:LOCAL_DIR[:CONFIG]`) -> (name or folder, config)."""
    body = spec[len(HUB_PREFIX):]
    name, sep, config = body.rpartition(":") if body.count(":") and not Path(body).exists() else (body, "", "")
    if not name:
        raise ConfigError(f"--task {spec} names no dataset; write hf:OWNER/NAME[:CONFIG]")
    return name, config or None


def hub_rows(spec: str) -> dict[str, list[dict[str, Any]]]:
    """Every split's rows of a hub dataset. A local folder works too: one written by `save_to_disk`, or data
    files / a loading script that `datasets.load_dataset` reads (tests and offline machines use these)."""
    from copes.extras import require

    datasets = require("datasets")
    name, config = parse_hub_spec(spec)
    try:
        if (Path(name) / "dataset_dict.json").is_file() or (Path(name) / "state.json").is_file():
            loaded = datasets.load_from_disk(name)
        else:
            loaded = datasets.load_dataset(name, config)
    except (FileNotFoundError, ValueError, ConnectionError) as error:
        raise DatasetError(f"--task {spec}: cannot load the dataset ({str(error).splitlines()[0]})") from None
    splits = loaded if isinstance(loaded, datasets.DatasetDict) else {"train": loaded}
    return {split: [dict(row) for row in rows] for split, rows in splits.items()}


def _bool_option(name: str, value: Any) -> bool:
    if isinstance(value, bool):
        return value
    if str(value).lower() in ("true", "false"):
        return str(value).lower() == "true"
    raise ConfigError(f"task option {name} must be true or false, got {value!r}")


class RewardScored(ABC):
    """Scoring by a RewardSet: the reward functions get each example's `columns` and prompt text."""

    rewards: RewardSet

    @abstractmethod
    def columns(self, example: Example) -> dict[str, Any]:
        """The row the reward functions see, column by column."""

    @abstractmethod
    def prompt(self, example: Example) -> str:
        """The prompt text (`prompts` for the reward functions)."""

    def score(self, completion: str, example: Example, *, used_tool: bool = False) -> Score:
        return self.score_batch([completion], [example], [used_tool])[0]

    def score_batch(self, completions: Sequence[str], examples: Sequence[Example],
                    used_tools: Sequence[bool] | None = None) -> list[Score]:
        batch_used_tools(completions, examples, used_tools)
        totals, first = self.rewards.score(completions, [self.prompt(e) for e in examples],
                                           [self.columns(e) for e in examples])
        return [Score(reward=total, correct=not math.isnan(value) and value >= CORRECT_AT,
                      answer=extract_answer(completion))
                for completion, total, value in zip(completions, totals, first)]


class FileTask(RewardScored, TaskBase):
    """Rows of a file or hub dataset as a task; see the module docstring for the options."""

    kind = "file"

    def __init__(
        self,
        source: str,
        *,
        prompt_field: str = "prompt",
        answer_field: str = "answer",
        eval_file: str | None = None,
        eval_split: str | None = None,
        chat: bool | str = True,
        system_prompt: str | None = None,
        rewards: RewardSet | None = None,
    ) -> None:
        """`rewards` None: the default `exact` reward, which reads the gold column (so a file without it is refused
        here); given rewards read whichever columns they name, and the gold column is checked only when the user
        named it (answer_field=), where a column no row has is a typo."""
        self.source, self.prompt_field, self.answer_field = source, prompt_field, answer_field
        self.eval_file = eval_file
        self.chat = _bool_option("chat", chat)
        self.name = Path(source).stem if not source.startswith(HUB_PREFIX) else source
        self.system_prompt = system_prompt if self.chat else None  # raw prompts carry it in their text instead
        self._prefix = "" if self.chat or not system_prompt else system_prompt
        gold_read = rewards is None or answer_field != "answer"
        self.rewards = rewards or RewardSet([resolve_reward(DEFAULT_REWARD, answer_field=answer_field)])
        self._rows = self._load_rows(eval_file, eval_split)
        self._cache: dict[str, list[Example]] = {}
        train_rows = self._rows["train"]
        if gold_read and not any(answer_field in row for row in train_rows):
            columns = sorted({key for row in train_rows[:100] for key in row})
            raise ConfigError(f"{self.source}: no row has the answer column {self.answer_field!r} (task option "
                              f"answer_field=); its columns are {columns}")

    def _load_rows(self, eval_file: str | None, eval_split: str | None) -> dict[str, list[dict[str, Any]]]:
        required = (self.prompt_field,)
        if self.source.startswith(HUB_PREFIX):
            if eval_file:
                raise ConfigError("task option eval_file is for a file task; a hub dataset takes eval_split=")
            rows = hub_rows(self.source)
            held_out = [eval_split] if eval_split else [s for s in HELD_OUT_SPLITS if s in rows]
            if eval_split and eval_split not in rows:
                raise ConfigError(f"--task {self.source} has no split {eval_split!r}; it has {sorted(rows)}")
            splits = {"train": rows.get("train", [])} | {split: rows[split] for split in held_out[:1]}
            for split, split_rows in splits.items():
                for index, row in enumerate(split_rows):
                    if self.prompt_field not in row:
                        raise DatasetError(f"{self.source} {split} row {index}: no {self.prompt_field!r} column "
                                           f"(prompt_field=); it has {sorted(row)}")
            return splits
        if eval_split:
            raise ConfigError("task option eval_split is for a hub dataset; a file task takes eval_file=")
        splits = {"train": read_rows(self.source, required)}
        if eval_file:
            splits["validation"] = read_rows(eval_file, required)
        return splits

    def examples(self, split: str, limit: int | None = None) -> list[Example]:
        # "validation" and "test" both mean the held-out rows, whichever split they came from.
        held_out = next((s for s in self._rows if s != "train"), None)
        key = split if split == "train" else held_out
        if split not in ("train", *HELD_OUT_SPLITS) or key is None:
            raise ValueError(f"task {self.name} has no {split} rows (give eval_file= or eval_split=, or --eval-size 0)")
        if key not in self._cache:
            self._cache[key] = [self._example(key, index, row) for index, row in enumerate(self._rows[key])]
        return self._cache[key][:limit]

    def _example(self, split: str, index: int, row: dict[str, Any]) -> Example:
        gold = row.get(self.answer_field)
        golds = tuple(map(str, gold)) if isinstance(gold, (list, tuple)) else (() if gold is None else (str(gold),))
        return Example(id=str(row.get("id", f"{split}-{index}")), question=str(row[self.prompt_field]), golds=golds,
                       meta=row)

    def prompt(self, example: Example) -> str:
        return self._prefix + example.question

    def columns(self, example: Example) -> dict[str, Any]:
        return dict(example.meta)


# The task options (`--task-options KEY=VALUE`) a data file or hub task takes: its keyword arguments.
FILE_TASK_OPTIONS = frozenset(inspect.signature(FileTask.__init__).parameters) - {"self", "source", "rewards"}

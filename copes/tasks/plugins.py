"""What `--task` and `--reward` can name, and the identity of the user code and data behind them.

`--task` is one of: a registered name (`task_names()`), a dataset file (`.jsonl`, `.json`, `.parquet`), a hub
dataset `hf:OWNER/NAME[:CONFIG]` (both `copes.tasks.file_task.FileTask`), or `MODULE:FACTORY`, a callable in a
module on the working directory or PYTHONPATH that returns a Task (it gets the task options as keywords). Each is
a plain string, so every rank and every resume rebuilds the same task from the run's config alone.

`--reward` specs (`copes.rewards.functions`) replace the task's own scoring: a file task passes them its rows'
columns; any other task gets a `RewardedTask` wrapper that passes its examples' metadata plus `question` and
`answer` (the gold, or the list of golds when there are several).

`user_sources` names and hashes (sha256) every file such a run depends on beyond copes itself: the data files,
the task module and each reward module. The journal records them, and a resume with a changed one is refused.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Literal

from copes.errors import ConfigError
from copes.rewards.functions import (
    DEFAULT_TIMEOUT_S,
    REWARD_NAMES,
    RewardSet,
    resolve_reward,
)
from copes.tasks.base import REGISTERED_TASKS, Example, Task, get_task, task_names
from copes.tasks.file_task import (
    FILE_TASK_OPTIONS,
    HUB_PREFIX,
    FileTask,
    RewardScored,
    parse_hub_spec,
)
from copes.tasks.loading import LOCAL_FORMATS
from copes.user_code import import_object, is_import_path, module_source, sha256_of

RewardSpec = str | Callable[..., Any]
TASK_FORMS = "a task name, a .jsonl/.json/.parquet file, hf:OWNER/NAME[:CONFIG] or MODULE:FACTORY"


class RewardedTask(RewardScored):
    """Another task with its scoring replaced by a RewardSet; everything else (prompt, splits, tools) is its own."""

    answer_field = "answer"

    def __init__(self, task: Task, rewards: RewardSet) -> None:
        self.task, self.rewards = task, rewards

    def __getattr__(self, name: str) -> Any:  # name, kind, chat, examples, corpus_paragraphs, ...
        return getattr(self.task, name)

    def prompt(self, example: Example) -> str:
        return self.task.prompt(example)

    def columns(self, example: Example) -> dict[str, Any]:
        gold: Any = example.golds[0] if len(example.golds) == 1 else list(example.golds)
        return {**example.meta, "question": example.question, "answer": gold}


def reward_set(rewards: Sequence[RewardSpec], weights: Sequence[float], answer_field: str,
               timeout_s: float = DEFAULT_TIMEOUT_S) -> RewardSet:
    return RewardSet([resolve_reward(spec, answer_field=answer_field, timeout_s=timeout_s) for spec in rewards],
                     weights)


TaskForm = Literal["builtin", "file", "hub", "plugin"]


def task_form(spec: str) -> TaskForm | None:
    """What `--task` names (see the module docstring), decided once for the whole build; None for none of them. A
    spec with a colon that is none of the others is a plugin: importing it says in one line what is wrong."""
    if spec in REGISTERED_TASKS:
        return "builtin"
    if spec.startswith(HUB_PREFIX):
        return "hub"
    if spec.endswith(LOCAL_FORMATS) or Path(spec).is_file():
        return "file"
    if ":" in spec:
        return "plugin"
    return None


def build_task(spec: str, options: dict[str, Any], *, rewards: Sequence[RewardSpec] = (),
               reward_weights: Sequence[float] = (), data_dir: str | None = None,
               reward_timeout_s: float = DEFAULT_TIMEOUT_S) -> Task:
    """The task `spec` names, scored by `rewards`, in one pass: its form decided once, the task built, then its
    rewards (a file or hub task is built with them: its rows' columns are what they read). `data_dir` goes to copes'
    own tasks (the others name their own data)."""
    form = task_form(spec)
    if form is None:
        raise ConfigError(f"unknown task {spec!r}: give {TASK_FORMS} (names: {', '.join(task_names())})")
    if form in ("file", "hub"):
        unknown = sorted(set(options) - FILE_TASK_OPTIONS)
        if unknown:
            raise ConfigError(f"unknown task option(s) {', '.join(unknown)} for a data file or hub task; its "
                              f"options are {', '.join(sorted(FILE_TASK_OPTIONS))}")
        answer_field = options.get("answer_field", "answer")
        scoring = reward_set(rewards, reward_weights, answer_field, reward_timeout_s) if rewards else None
        return FileTask(spec, **options, rewards=scoring)  # None: its default reward, on its gold column
    if form == "builtin":
        task = get_task(spec, **options, **({"data_dir": data_dir} if data_dir else {}))
    else:
        task = _plugin_task(spec, options)
    return with_rewards(task, rewards, reward_weights, reward_timeout_s)


def _plugin_task(spec: str, options: dict[str, Any]) -> Task:
    factory = import_object(spec, "--task")
    try:
        task = factory(**options)
    except TypeError as error:
        raise ConfigError(f"--task {spec}: the factory does not take these options ({error})") from None
    missing = [name for name in ("name", "kind", "chat", "examples", "prompt", "score_batch")
               if not hasattr(task, name)]
    if missing:
        raise ConfigError(f"--task {spec} returned {type(task).__name__}, not a Task (it lacks {', '.join(missing)})")
    return task


def with_rewards(task: Task, rewards: Sequence[RewardSpec], reward_weights: Sequence[float] = (),
                 timeout_s: float = DEFAULT_TIMEOUT_S) -> Task:
    """`task` scored by `rewards` instead of its own scoring when any are given (a file task takes them itself: it
    hands its rows' columns to them)."""
    if not rewards:
        return task
    if isinstance(task, FileTask):
        task.rewards = reward_set(rewards, reward_weights, task.answer_field, timeout_s)
        return task
    return RewardedTask(task, reward_set(rewards, reward_weights, RewardedTask.answer_field, timeout_s))


# ---------------------------------------------------------------------------------------------------------
# Identity of the user's code and data.


def _source_of(path: Path | None) -> dict[str, str | None]:
    if path is None or not path.exists():
        return {"path": None, "sha256": None}
    return {"path": str(path.resolve()), "sha256": sha256_of(path)}


def user_sources(spec: str, options: dict[str, Any], rewards: Sequence[RewardSpec]) -> dict[str, dict[str, str | None]]:
    """{what: {path, sha256}} of the data files, task module, reward modules and ESTrainer's tool and environment
    modules behind a run (copes' own tasks and built-in rewards have none); a file that cannot be found has path
    and sha256 None."""
    found: dict[str, dict[str, str | None]] = {}
    form = task_form(spec)  # None for the name of a Task object handed to copes.train: no file behind it
    if form == "hub" and (folder := Path(parse_hub_spec(spec)[0])).is_dir():
        found[f"dataset folder {folder}"] = _source_of(folder)
    elif form == "file":
        for path in [spec, *([options["eval_file"]] if options.get("eval_file") else [])]:
            found[f"data file {path}"] = _source_of(Path(path))
    elif form == "plugin":
        found[f"task module {spec.partition(':')[0]}"] = _source_of(module_source(spec))
    for kind, what in (("tools", "tool"), ("environment_factory", "environment")):  # ESTrainer's, as MODULE:NAME
        for label in options.get(kind) or ():
            if isinstance(label, str) and is_import_path(label):
                found[f"{what} module {label.partition(':')[0]}"] = _source_of(module_source(label))
    for reward in rewards:
        if callable(reward):
            module, source = reward.__module__, inspect.getsourcefile(reward)
            found[f"reward module {module}"] = _source_of(Path(source) if source else None)
        elif reward not in REWARD_NAMES and is_import_path(reward):
            found[f"reward module {reward.partition(':')[0]}"] = _source_of(module_source(reward))
    return found


def changed_source(recorded: dict[str, dict[str, str | None]], current: dict[str, dict[str, str | None]]) -> str | None:
    """The first user file that differs between a run's journal and now, as a phrase; None when all match."""
    for what in sorted(recorded.keys() | current.keys()):
        theirs, ours = recorded.get(what), current.get(what)
        if theirs is not None and ours is not None and theirs["sha256"] == ours["sha256"]:
            continue  # the same bytes, wherever they are now
        if ours is None or ours["sha256"] is None:
            return f"the {what} cannot be found any more (it was {(theirs or {}).get('path')})"
        if theirs is None:
            return f"the {what} was not part of the run"
        return (f"the {what} ({ours['path']}) changed since the run started (sha256 {str(theirs['sha256'])[:12]} "
                f"there, {str(ours['sha256'])[:12]} here)")
    return None

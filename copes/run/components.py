"""Turning a TrainConfig into the objects the trainer drives: the task and its data order, the ES strategy, the
agent's settings and its tools."""

from __future__ import annotations

import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from copes.choices import ALGORITHMS_BY_NAME
from copes.errors import ConfigError
from copes.run.config import TrainConfig
from copes.run.metrics import PhaseTimer
from copes.tasks import Example, Task, get_task

if TYPE_CHECKING:  # the strategies, the rollout code (and torch) load only when a run builds them
    from copes.es.strategies.base import Strategy
    from copes.rollout import AgentConfig


def build_strategy(cfg: TrainConfig, model: Any) -> Strategy:
    from copes.es import strategies

    common = dict(population=cfg.population, sigma=cfg.sigma, lr=cfg.lr, seed=cfg.seed,
                  include=cfg.include or None, exclude=cfg.exclude or None)
    if cfg.fitness is not None:  # otherwise each strategy's own default
        common["fitness"] = cfg.fitness
    algorithm = ALGORITHMS_BY_NAME[cfg.algorithm]
    if algorithm.per_member:
        common.update(chunk_size=cfg.chunk_size, restore=cfg.restore, antithetic=cfg.antithetic, optimizer=cfg.optimizer)
    if algorithm.subspaces or algorithm.per_member:
        common["num_subspaces"] = cfg.num_subspaces
    if algorithm.low_rank:
        common["rank"] = cfg.rank
    try:
        return getattr(strategies, algorithm.strategy)(model, **common)
    except ValueError as error:
        raise ConfigError(str(error)) from None


def task_from_config(cfg: TrainConfig) -> Task:
    """The run's task with its options (data_dir included); an unknown task or option is a ConfigError."""
    options = {**cfg.task_options, **({"data_dir": cfg.data_dir} if cfg.data_dir else {})}
    try:
        return get_task(cfg.task, **options)
    except (ValueError, TypeError) as error:  # unknown task, or an option the task does not take
        raise ConfigError(f"task {cfg.task}: {error}") from None


def batch_indices(step: int, batch: int, dataset_size: int, seed: int) -> list[int]:
    """Questions of `step`: a fresh permutation per epoch, a pure function of (seed, step) so resume needs no state."""
    positions = range(step * batch, (step + 1) * batch)
    permutations: dict[int, np.ndarray] = {}
    picked = []
    for position in positions:
        epoch = position // dataset_size
        if epoch not in permutations:
            permutations[epoch] = np.random.default_rng([seed, epoch]).permutation(dataset_size)
        picked.append(int(permutations[epoch][position % dataset_size]))
    return picked


def eval_examples(task: Task, cfg: TrainConfig, *, warn: bool) -> list[Example]:
    """The held-out questions: `cfg.eval_size` of the first of eval_split / validation / test the task has."""
    if cfg.eval_size == 0:
        return []
    for split in dict.fromkeys((cfg.eval_split, "validation", "test")):
        try:
            examples = task.examples(split, limit=cfg.eval_size)
        except ValueError:
            continue
        if examples:
            if len(examples) < cfg.eval_size and warn:
                print(f"warning: eval_size={cfg.eval_size} but the {split} split of {cfg.task} has "
                      f"{len(examples)} questions; evaluating on all {len(examples)}", file=sys.stderr)
            return examples
    raise ConfigError(f"task {cfg.task} has no held-out split to evaluate on")


def build_agent(cfg: TrainConfig, task: Task) -> AgentConfig:
    """The rollout settings: greedy decoding (the paper's), the limits, the tool-call format and budgets."""
    from copes.rollout import AgentConfig

    limits = dict(max_new_tokens=cfg.max_new_tokens, max_turns=cfg.max_turns, max_context_tokens=cfg.max_context_tokens,
                  greedy=True, batch_size=cfg.rollout_batch, tool_format=cfg.tool_format,
                  template_kwargs=cfg.template_kwargs, max_observation_tokens=cfg.max_observation_tokens)
    return AgentConfig.for_task(task, **limits, **({"budgets": cfg.tool_budgets} if cfg.tool_budgets else {}))


class TimedTool:
    """A tool whose calls add their wall time to the run's `tools` phase."""

    def __init__(self, tool: Any, timer: PhaseTimer) -> None:
        self.tool, self.timer = tool, timer
        self.name, self.description, self.parameters = tool.name, tool.description, tool.parameters

    def call(self, arguments: dict) -> str:
        start = time.perf_counter()
        try:
            return self.tool.call(arguments)
        finally:
            self.timer.add("tools", time.perf_counter() - start)


def build_tools(
    task: Task, *, enabled: bool, corpus: str | None, retriever_url: str | None, timer: PhaseTimer, corpus_dir: Path,
    unsafe_sandbox: bool = False,
) -> list[TimedTool]:
    """Python sandbox for every chat task; search too when a retriever or corpus is available.

    The sandbox is checked here, before any training: SandboxUnavailable (a ConfigError) names what this machine
    lacks, unless `unsafe_sandbox` asks to run without it."""
    if not enabled or not task.chat:
        return []
    from copes.tools import BM25Search, HttpRetriever, PythonSandbox, PythonTool, SearchTool

    python_tool = PythonTool(PythonSandbox(unsafe=unsafe_sandbox))
    python_tool.sandbox.check()
    tools: list[Any] = [python_tool]
    if retriever_url:
        tools.append(SearchTool(HttpRetriever(retriever_url)))
    elif corpus:
        if not Path(corpus).is_file():
            raise ConfigError(f"search corpus {corpus} does not exist")
        tools.append(SearchTool(BM25Search(corpus)))
    elif (built := task_corpus(task, corpus_dir)) is not None:
        tools.append(SearchTool(BM25Search(built)))
    return [TimedTool(tool, timer) for tool in tools]


def task_corpus(task: Task, folder: Path, splits: Sequence[str] | None = None) -> Path | None:
    """A BM25 corpus of every context paragraph the task's data carries (HotpotQA, 2Wiki), of `splits` only when
    given; None when it carries none (give --search-corpus or --retriever-url then)."""
    from copes.tools import write_corpus

    paragraphs = task.corpus_paragraphs(splits)
    if not paragraphs:
        return None
    path = folder / f"{task.name}_corpus.jsonl"
    write_corpus(paragraphs, path)
    return path

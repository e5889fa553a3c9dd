"""Turning a TrainConfig into the objects the trainer drives: the task and its data order, the ES strategy, the
agent's settings and its tools."""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from copes.choices import ALGORITHMS_BY_NAME
from copes.config.options import TrainConfig
from copes.errors import ConfigError
from copes.failpoints import failpoint
from copes.rewards.functions import callable_label
from copes.tasks import Example, Task
from copes.tasks.plugins import RewardSpec, build_task, with_rewards
from copes.timing import PhaseTimer

if TYPE_CHECKING:  # the strategies, the rollout code (and torch) load only when a run builds them
    from copes.es.strategies.base import Strategy
    from copes.rollout import AgentConfig
    from copes.rollout.vllm.lora import LoRASlots


def build_strategy(cfg: TrainConfig, model: Any) -> Strategy:
    from copes.es import strategies

    common = dict(population=cfg.population, sigma=cfg.sigma, lr=cfg.lr, seed=cfg.seed,
                  include=cfg.include or None, exclude=cfg.exclude or None)
    if cfg.fitness is not None:  # otherwise each strategy's own default
        common["fitness"] = cfg.fitness
    algorithm = ALGORITHMS_BY_NAME[cfg.algorithm]
    if algorithm.per_member:
        common.update(chunk_size=cfg.chunk_size, restore=cfg.restore, antithetic=cfg.antithetic,
                      optimizer=cfg.optimizer)
    if algorithm.subspaces or algorithm.per_member:
        common["num_subspaces"] = cfg.num_subspaces
    if algorithm.low_rank:
        common["rank"] = cfg.rank
    lora_targets = _lora_targets(cfg, model)
    if algorithm.low_rank and cfg.rollout_engine == "vllm":  # decided from the model alone: replay on HF agrees
        from copes.rollout.vllm.lora import tied_embeddings

        tied = tied_embeddings(model, cfg.algorithm, notice=lora_targets is not None)
        common["exclude"] = [*cfg.exclude, *tied] or None
    try:
        strategy = getattr(strategies, algorithm.strategy)(model, **common)
    except ValueError as error:
        raise ConfigError(str(error)) from None
    if lora_targets is not None:
        from copes.rollout.vllm.lora import check_lora_reach

        check_lora_reach(lora_targets, strategy.matrices, cfg.algorithm)
    return strategy


def _lora_targets(cfg: TrainConfig, model: Any) -> Any:
    """The vLLM engine's LoRA targets (copes.rollout.vllm.lora.LoRATargets) when a low-rank run's members ride as
    adapters; None otherwise (an HF model: copes-replay of a vLLM run)."""
    if not (ALGORITHMS_BY_NAME[cfg.algorithm].low_rank and cfg.rollout_engine == "vllm"):
        return None
    from copes.rollout.engine import engine_for

    return getattr(engine_for(model), "lora_targets", None)


def rollout_lora(cfg: TrainConfig, ranks: int) -> LoRASlots | None:
    """The vLLM engine's LoRA settings: one adapter per member of a rank's share of a low-rank population (the
    largest share: members_for_rank's sizes differ by at most one); None for hf and the per-member algorithms."""
    if cfg.rollout_engine != "vllm" or not ALGORITHMS_BY_NAME[cfg.algorithm].low_rank:
        return None
    from copes.rollout.vllm.lora import LoRASlots

    return LoRASlots(adapters=-(-cfg.population // ranks), rank=cfg.rank)


@dataclass(frozen=True)
class GivenParts:
    """What a Python caller hands `copes.train` as objects rather than names: a Task, and a reward list that
    holds callables (the config records the task's name and each callable as `module:qualname`)."""

    task: Task | None = None
    rewards: tuple[RewardSpec, ...] | None = None


def split_given(config: dict[str, Any]) -> tuple[dict[str, Any], GivenParts]:
    """A config mapping with a Task object or reward callables in it -> (the mapping of plain values, the objects)."""
    plain, task = dict(config), None
    if not isinstance(plain.get("task", ""), str):
        task = plain["task"]
        plain["task"] = str(getattr(task, "name", type(task).__name__))
    rewards = plain.get("reward")
    if isinstance(rewards, (str, Callable)):
        rewards = [rewards]
    if rewards is not None:
        plain["reward"] = [spec if isinstance(spec, str) else callable_label(spec) for spec in rewards]
    given_rewards = tuple(rewards) if rewards is not None and any(callable(r) for r in rewards) else None
    return plain, GivenParts(task, given_rewards)


def task_from_config(cfg: TrainConfig, given: GivenParts = GivenParts()) -> Task:
    """The run's task with its options and rewards (copes.tasks.plugins); an unknown task or option, or a bad
    reward, is a ConfigError."""
    rewards = given.rewards if given.rewards is not None else cfg.reward
    try:
        if given.task is not None:
            return with_rewards(given.task, rewards, cfg.reward_weights, cfg.reward_timeout_s)
        return build_task(cfg.task, cfg.task_options, rewards=rewards, reward_weights=cfg.reward_weights,
                          data_dir=cfg.data_dir, reward_timeout_s=cfg.reward_timeout_s)
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
    raise ConfigError(f"task {cfg.task_label} has no held-out split to evaluate on: give held-out rows (--task-options "
                      "eval_file=FILE for a data file, eval_split=SPLIT for a hub dataset), or --eval-size 0 to train "
                      "without a held-out evaluation")


def build_agent(cfg: TrainConfig, task: Task, *, rows: int | None, context_limit: int | None = None) -> AgentConfig:
    """The rollout settings: greedy decoding (the paper's), `rows` per generate call (None: all at once), the
    limits, the tool-call format and budgets. `context_limit` (the engine's longest context) caps
    --max-context-tokens at start, so a row that reaches it ends truncated instead of the engine refusing it
    mid-run."""
    from copes.rollout import AgentConfig

    context = min(cfg.max_context_tokens, context_limit) if context_limit else cfg.max_context_tokens
    limits = dict(max_new_tokens=cfg.max_new_tokens, max_turns=cfg.max_turns, max_context_tokens=context,
                  greedy=True, batch_size=rows, tool_format=cfg.tool_format,
                  template_kwargs=cfg.template_kwargs, max_observation_tokens=cfg.max_observation_tokens)
    return AgentConfig.for_task(task, **limits, **({"budgets": cfg.tool_budgets} if cfg.tool_budgets else {}))


class TimedTool:
    """A tool whose calls add their wall time to the run's `tools` phase (the rows' calls run in parallel: the time
    any of them was running, not their sum)."""

    def __init__(self, tool: Any, timer: PhaseTimer) -> None:
        self.tool, self.timer = tool, timer
        self.name, self.description, self.parameters = tool.name, tool.description, tool.parameters

    def call(self, arguments: dict) -> str:
        failpoint("tool")  # crash tests: die mid-turn, a tool call in flight
        with self.timer.overlapping("tools"):
            return self.tool.call(arguments)


def tools_on(enabled: bool | None, task: Task) -> bool:
    """Whether the agent gets tools: `--tools` / `--no-tools` as given; unset, on for copes' own tasks and task
    plugins and off for a data file or hub dataset (a user's rows expect plain answers, and the tools' instructions
    would take the prompt). A task without chat never has them."""
    from copes.tasks.file_task import FileTask

    return bool(task.chat) and (enabled if enabled is not None else not isinstance(task, FileTask))


def build_tools(
    task: Task, *, enabled: bool | None, corpus: str | None, retriever_url: str | None, timer: PhaseTimer,
    corpus_dir: Path, unsafe_sandbox: bool = False,
) -> list[TimedTool]:
    """Python sandbox for every chat task with tools on (`tools_on`); search too when a retriever or corpus is
    available.

    The sandbox is checked here, before any training: SandboxUnavailable (a ConfigError) names what this machine
    lacks, unless `unsafe_sandbox` asks to run without it."""
    if not tools_on(enabled, task):
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


# Share of a task's prompt tokens that, mapped to UNK or EOS, means the model cannot read the task's text.
UNREADABLE_SHARE = 0.5
PROMPTS_CHECKED = 1000  # the first training prompts, enough to show either problem without tokenizing a corpus


def startup_warnings(task: Task, examples: Sequence[Example], tokenizer: Any, model: Any) -> list[str]:
    """What a new user should hear before training: prompts longer than the model's positions, and a tokenizer
    that turns most of the prompts into UNK/EOS ids (a model whose vocabulary does not cover the task's text)."""
    prompts = [prompt_text(task.prompt(example)) for example in examples[:PROMPTS_CHECKED]]
    if not prompts:
        return []
    ids = tokenizer(prompts, add_special_tokens=False)["input_ids"]
    warnings = []
    positions = getattr(getattr(model, "config", None), "max_position_embeddings", None)
    too_long = [len(row) for row in ids if positions and len(row) > positions]
    if too_long:
        warnings.append(f"{len(too_long)} of the first {len(prompts)} prompts of {task.name} are longer than the "
                        f"model's {positions} positions (up to {max(too_long)} tokens); they cannot be read whole")
    unreadable = {token for token in (tokenizer.unk_token_id, tokenizer.eos_token_id) if token is not None}
    total = sum(len(row) for row in ids)
    lost = sum(token in unreadable for row in ids for token in row)
    if total and lost / total > UNREADABLE_SHARE:
        warnings.append(f"the tokenizer maps {100 * lost / total:.0f}% of {task.name}'s prompt tokens to UNK/EOS: "
                        "this model's vocabulary does not cover the task's text, so it cannot learn it")
    return warnings


def prompt_text(prompt: str | list[dict[str, Any]]) -> str:
    """A prompt's text: a conversational prompt (a list of messages) as its contents, one per line."""
    return prompt if isinstance(prompt, str) else "\n".join(str(message.get("content", "")) for message in prompt)


def warn_at_start(task: Task, examples: Sequence[Example], tokenizer: Any, model: Any) -> None:
    for line in startup_warnings(task, examples, tokenizer, model):
        print(f"warning: {line}", file=sys.stderr, flush=True)

"""Turning a TrainConfig into the objects the trainer drives: the ES strategy and the agent's tools."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from copes.config import ConfigError, TrainConfig
from copes.metrics import PhaseTimer
from copes.tasks import Task


def build_strategy(cfg: TrainConfig, model: Any) -> Any:
    from copes.strategies import EGGROLL, CoPES, CoPESLowRank

    common = dict(population=cfg.population, sigma=cfg.sigma, lr=cfg.lr, seed=cfg.seed,
                  include=cfg.include or None, exclude=cfg.exclude or None)
    if cfg.fitness is not None:  # otherwise each strategy's own default
        common["fitness"] = cfg.fitness
    try:
        if cfg.algorithm in ("copes", "es"):
            return CoPES(model, num_subspaces=cfg.num_subspaces, chunk_size=cfg.chunk_size, restore=cfg.restore, **common)
        if cfg.algorithm == "eggroll":
            return EGGROLL(model, rank=cfg.rank, **common)
        return CoPESLowRank(model, num_subspaces=cfg.subspaces, rank=cfg.rank, **common)
    except ValueError as error:
        raise ConfigError(str(error)) from None


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
    elif task.kind == "qa" and (built := task_corpus(task, corpus_dir)) is not None:
        tools.append(SearchTool(BM25Search(built)))
    return [TimedTool(tool, timer) for tool in tools]


def task_corpus(task: Task, folder: Path, splits: tuple[str, ...] = ("train", "validation", "test")) -> Path | None:
    """A BM25 corpus of every context paragraph the task's `splits` carry (HotpotQA, 2Wiki); None when they carry
    none (MuSiQue: give --search-corpus or --retriever-url)."""
    from copes.tasks.loading import DatasetError
    from copes.tools import write_corpus

    paragraphs = []
    for split in splits:
        try:
            examples = task.examples(split)
        except (ValueError, DatasetError):
            continue
        for example in examples:
            # HotpotQA sentences carry their own leading spaces, so plain concatenation restores the paragraph.
            paragraphs += [(title, "".join(sentences).strip()) for title, sentences in example.meta.get("paragraphs", [])]
    if not paragraphs:
        return None
    path = folder / f"{task.name}_corpus.jsonl"
    write_corpus(paragraphs, path)
    return path

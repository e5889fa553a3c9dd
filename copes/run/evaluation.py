"""Evaluation: run the agent over a task's examples (n samples each), score every rollout, report accuracy,
mean reward, pass@k and tool use, and print a per-benchmark table.
"""

from __future__ import annotations

import math
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from tqdm.auto import tqdm

from copes.rollout.agent import AgentConfig, Trajectory, derive_seed, run_agent
from copes.run.scoring import row_prompts, score_rollouts
from copes.tasks.base import Example, Score, Task
from copes.tools import Tool


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from n samples of which c are correct: 1 - C(n-c, k) / C(n, k).

    Computed as 1 - prod_{i=n-c+1}^{n} (1 - k/i), which never forms the huge binomials.
    """
    if n < 1:
        raise ValueError(f"n must be >= 1, got {n}")
    if not 0 <= c <= n:
        raise ValueError(f"c must be in [0, n={n}], got {c}")
    if not 1 <= k <= n:
        raise ValueError(f"k must be in [1, n={n}], got {k}")
    if n - c < k:
        return 1.0
    return 1.0 - math.prod(1.0 - k / i for i in range(n - c + 1, n + 1))


@dataclass
class EvalResult:
    """Scores of one task. `accuracy`: mean correctness of each example's first sample (the greedy one when
    n_samples == 1); `mean_reward`: over all rollouts; `tool_calls`: calls that ran per tool, plus "invalid"
    for calls that were malformed, unknown or over budget; `tool_use_rate`: rollouts with at least one call
    that ran."""

    task: str
    n_examples: int
    n_samples: int
    accuracy: float
    mean_reward: float
    pass_at_k: dict[int, float]
    tool_calls: dict[str, int]
    tool_use_rate: float
    mean_generated_tokens: float
    truncated_rate: float
    wall_seconds: float
    records: list[dict[str, Any]] = field(repr=False)

    def to_dict(self) -> dict[str, Any]:
        result = asdict(self)
        result["pass_at_k"] = {str(k): value for k, value in self.pass_at_k.items()}  # JSON keys are strings
        return result


def _sample_record(trajectory: Trajectory, score: Score) -> dict[str, Any]:
    return {
        "answer": score.answer,
        "reward": score.reward,
        "correct": score.correct,
        "used_tool": trajectory.used_tool,
        "num_turns": trajectory.num_turns,
        "generated_tokens": trajectory.generated_tokens,
        "finished_by": trajectory.finished_by,
        "truncated": trajectory.truncated,
        "tool_calls": [asdict(call) for call in trajectory.tool_calls],
        "final_text": trajectory.final_text,
        "completion": trajectory.completion,
    }


def _summarize(
    task_name: str, records: list[dict[str, Any]], n_samples: int, ks: Sequence[int], wall_seconds: float
) -> EvalResult:
    samples = [sample for record in records for sample in record["samples"]]
    tool_calls: Counter[str] = Counter()
    for sample in samples:
        tool_calls.update(call["name"] if call["valid"] else "invalid" for call in sample["tool_calls"])
    correct_counts = [sum(sample["correct"] for sample in record["samples"]) for record in records]
    return EvalResult(
        task=task_name,
        n_examples=len(records),
        n_samples=n_samples,
        accuracy=sum(record["samples"][0]["correct"] for record in records) / len(records),
        mean_reward=sum(sample["reward"] for sample in samples) / len(samples),
        pass_at_k={k: sum(pass_at_k(n_samples, c, k) for c in correct_counts) / len(records) for k in ks},
        tool_calls=dict(tool_calls),
        tool_use_rate=sum(sample["used_tool"] for sample in samples) / len(samples),
        mean_generated_tokens=sum(sample["generated_tokens"] for sample in samples) / len(samples),
        truncated_rate=sum(sample["truncated"] for sample in samples) / len(samples),
        wall_seconds=wall_seconds,
        records=records,
    )


def evaluate(
    model: Any,
    tokenizer: Any,
    task: Task,
    examples: Sequence[Example],
    *,
    n_samples: int = 1,
    temperature: float = 0.3,
    greedy: bool | None = None,
    ks: Sequence[int] = (1,),
    tools: Sequence[Tool] = (),
    agent_config: AgentConfig | None = None,
    system_prompt: str | None = None,
    batch_size: int = 64,
    seed: int = 0,
    progress: bool = True,
    deadline: float | None = None,
) -> EvalResult:
    """Roll out `n_samples` per example (greedy iff n_samples == 1 unless `greedy` says otherwise) and score
    each rollout's last turn (`score_rollouts`). `agent_config` defaults to the paper's budgets for the task's
    kind; the decoding arguments here override its greedy/temperature. Rollouts run `batch_size` at a time.
    Past `deadline` (a time.perf_counter() value) no further batch starts: the result covers the examples whose
    samples all ran (`n_examples`; at least the first batch's).
    """
    if not examples:
        raise ValueError("examples is empty")
    if n_samples < 1:
        raise ValueError(f"n_samples must be >= 1, got {n_samples}")
    if not ks or any(not 1 <= k <= n_samples for k in ks):
        raise ValueError(f"ks must be non-empty with every k in [1, n_samples={n_samples}], got {tuple(ks)}")
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    greedy = n_samples == 1 if greedy is None else greedy
    if agent_config is None:
        agent_config = AgentConfig.for_task(task)
    config = replace(agent_config, greedy=greedy, temperature=temperature)

    started = time.perf_counter()
    rows = [example for example in examples for _ in range(n_samples)]
    samples: list[dict[str, Any]] = []
    with tqdm(total=len(rows), desc=f"eval {task.name}", unit="rollout", disable=not progress) as bar:
        for batch_number, start in enumerate(range(0, len(rows), batch_size)):
            if batch_number and deadline is not None and time.perf_counter() > deadline:
                break
            batch = rows[start : start + batch_size]
            trajectories = run_agent(
                model,
                tokenizer,
                row_prompts(task, batch),
                tools=tools if task.chat else (),  # raw-prompt tasks run one turn without tools
                config=config,
                system_prompt=system_prompt if system_prompt is not None else getattr(task, "system_prompt", None),
                chat=task.chat,
                seed=derive_seed(seed, batch_number),
            )
            scores = score_rollouts(task, batch, trajectories)
            samples += [_sample_record(trajectory, score) for trajectory, score in zip(trajectories, scores)]
            bar.update(len(batch))
    records = [
        {
            "id": example.id,
            "golds": list(example.golds),
            "samples": samples[index * n_samples : (index + 1) * n_samples],
        }
        for index, example in enumerate(examples[: len(samples) // n_samples])
    ]
    return _summarize(task.name, records, n_samples, ks, time.perf_counter() - started)


def merge_results(parts: Sequence[EvalResult | None]) -> EvalResult:
    """One result from the results of disjoint shares of a task's examples (ranks' shares, in rank order; None for
    a share with no examples), as if one evaluation had covered them all; its wall time is the slowest share's."""
    done = [part for part in parts if part is not None]
    if not done:
        raise ValueError("no share of the examples was evaluated")
    first = done[0]
    return _summarize(first.task, [record for part in done for record in part.records], first.n_samples,
                      tuple(first.pass_at_k), max(part.wall_seconds for part in done))


def format_table(results: dict[str, EvalResult]) -> str:
    """A Markdown table, one row per benchmark: accuracy, reward, pass@k, tool use, tokens, time."""
    ks = sorted({k for result in results.values() for k in result.pass_at_k})
    header = ["benchmark", "n", "acc", "reward", *(f"pass@{k}" for k in ks), "tool use", "calls", "tokens", "seconds"]
    rows = [
        [
            name,
            f"{result.n_examples}x{result.n_samples}",
            f"{100 * result.accuracy:.1f}",
            f"{result.mean_reward:.3f}",
            *(f"{100 * result.pass_at_k[k]:.1f}" if k in result.pass_at_k else "-" for k in ks),
            f"{100 * result.tool_use_rate:.1f}%",
            " ".join(f"{tool}:{count}" for tool, count in sorted(result.tool_calls.items())) or "-",
            f"{result.mean_generated_tokens:.0f}",
            f"{result.wall_seconds:.1f}",
        ]
        for name, result in results.items()
    ]
    widths = [max(len(cells[column]) for cells in [header, *rows]) for column in range(len(header))]
    lines = [
        "| " + " | ".join(cell.ljust(width) for cell, width in zip(cells, widths)) + " |" for cells in [header, *rows]
    ]
    lines.insert(1, "|" + "|".join("-" * (width + 2) for width in widths) + "|")
    return "\n".join(lines)

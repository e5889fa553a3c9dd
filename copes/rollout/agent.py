"""The multi-turn agent loop: generate for every row at once, run the tool calls, continue only the rows that
called a tool, until each row answers or runs out of turns, tokens or context.

Per turn:
1. Count each active row's context; a row with no room left ends here (truncated).
2. Generate for the remaining rows in batches (order = row order); the engine enters `row_context(indices)` around
   the forwards that compute those rows (the HF engine per forward, with that forward's rows).
3. A row that stopped on a tool call gets its calls parsed and run (per-tool budgets per row; a malformed,
   unknown or over-budget call gets an error observation instead), the results are appended through the
   chat template (or as `<result>` blocks in the tag format), and the row stays active.
   A row that stopped on EOS or its token limit is finished.

Everything is text: the context of a row is its prompt plus its completion so far, re-tokenized each turn; each
batch row is named to the engine by its index, so an engine may keep the row's cache from its previous turn and
prefill only the tokens the turn added (copes.rollout.hf_engine).
So tool output is untrusted text: every observation has its chat-markup strings neutralized (a printed
`<|im_end|><|im_start|>user` stays plain text, never special tokens) and is clipped to `max_observation_tokens`;
`Trajectory.model_spans` says which parts of the completion the model generated, the only parts rewards read.
Nothing here raises on model output; limits end rows, they never end the run.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from copes.rollout.engine import engine_for
from copes.rollout.generate import Generation, prompt_token_counts
from copes.rollout.hf_engine import HFEngine, RowContext
from copes.rollout.templates import (
    TOOL_FORMATS,
    ParsedCall,
    observation_text,
    parse_tool_calls,
    render_prompt_in_format,
    resolve_tool_format,
    tag_results_suffix,
    tool_results_suffix,
    tool_stop_strings,
)
from copes.tools import Tool

# Tool budgets per row from the paper: math gets 3 searches + 5 Python runs, multi-hop QA 5 + 5.
BUDGETS_BY_KIND = {"math": {"python": 5, "search": 3}, "qa": {"python": 5, "search": 5}}



@dataclass
class AgentConfig:
    max_turns: int = field(default=8, metadata={"help": "model turns per row; each tool call costs one turn"})
    max_new_tokens: int = field(default=1024, metadata={"help": "new tokens per turn"})
    max_context_tokens: int = field(
        default=131072, metadata={"help": "prompt + transcript token limit; a row that reaches it ends, truncated"}
    )
    budgets: dict[str, int] = field(
        default_factory=lambda: dict(BUDGETS_BY_KIND["math"]),
        metadata={"help": "calls allowed per tool per row; tools not listed are limited only by max_turns"},
    )
    greedy: bool = field(default=True, metadata={"help": "greedy decoding; False samples with temperature/top_p"})
    temperature: float = field(default=1.0, metadata={"help": "sampling temperature (greedy=False only)"})
    top_p: float = field(default=1.0, metadata={"help": "nucleus sampling mass (greedy=False only)"})
    tool_format: str = field(
        default="auto",
        metadata={
            "help": "'qwen' (<tool_call> JSON via the chat template), 'tags' (<python>/<search>), 'auto' detects"
        },
    )
    batch_size: int | None = field(
        default=None, metadata={"help": "rows per generate call (and per row_context); None: all active rows"}
    )
    tool_workers: int = field(default=8, metadata={"help": "threads running one turn's tool calls concurrently"})
    max_observation_tokens: int = field(
        default=1024, metadata={"help": "each tool result is clipped to this many tokens before it enters the context"}
    )
    template_kwargs: dict[str, Any] = field(
        default_factory=dict, metadata={"help": "extra chat-template variables, e.g. {enable_thinking: false}"}
    )

    def __post_init__(self) -> None:
        for name in ("max_turns", "max_new_tokens", "max_context_tokens", "tool_workers", "max_observation_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.batch_size is not None and self.batch_size < 1:
            raise ValueError(f"batch_size must be >= 1 or None, got {self.batch_size}")
        if self.tool_format not in TOOL_FORMATS:
            raise ValueError(f"tool_format must be one of {TOOL_FORMATS}, got {self.tool_format!r}")
        if any(budget < 0 for budget in self.budgets.values()):
            raise ValueError(f"budgets must be >= 0, got {self.budgets}")
        if not self.greedy and self.temperature <= 0:
            raise ValueError(f"temperature must be > 0 when sampling, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")

    @classmethod
    def for_kind(cls, kind: str, **overrides: Any) -> AgentConfig:
        """The paper's budgets for a task kind ("math" or "qa"), with any field overridden."""
        if kind not in BUDGETS_BY_KIND:
            raise ValueError(f"kind must be one of {sorted(BUDGETS_BY_KIND)}, got {kind!r}")
        return cls(**{"budgets": dict(BUDGETS_BY_KIND[kind]), **overrides})

    @classmethod
    def for_task(cls, task: Any, **overrides: Any) -> AgentConfig:
        """The one rule for a task's agent: the paper's budgets for its `kind` where the paper gives them (math,
        qa), the defaults otherwise (raw-prompt tasks run one turn without tools anyway); `overrides` win."""
        if task.kind in BUDGETS_BY_KIND:
            return cls.for_kind(task.kind, **overrides)
        return cls(**overrides)


@dataclass(frozen=True)
class ToolCallRecord:
    """`valid`: the call was well-formed, named a known tool and was within budget, so the tool ran.
    Otherwise `observation` is the error message the model was shown."""

    name: str | None
    arguments: dict[str, Any]
    valid: bool
    observation: str


@dataclass
class Trajectory:
    """One row's rollout. `prompt + completion` is the model's whole context; `completion` holds every turn
    and every tool result as the model saw them, `final_text` only the last turn's generated text.

    `finished_by`: "eos" (the model ended), "length" (a turn hit max_new_tokens), "context" (max_context_tokens
    reached; `truncated` is True) or "max_turns" (still calling tools when the turns ran out).
    `model_spans`: (start, end) offsets into `completion` of each turn the model generated; everything between
    them is tool results and template glue, which answer extraction and rewards must never read.
    """

    prompt: str
    completion: str = ""
    final_text: str = ""
    tool_calls: list[ToolCallRecord] = field(default_factory=list)
    num_turns: int = 0
    generated_tokens: int = 0
    truncated: bool = False
    finished_by: str | None = None  # None while the row is still active
    model_spans: list[tuple[int, int]] = field(default_factory=list)

    @property
    def used_tool(self) -> bool:
        return any(call.valid for call in self.tool_calls)

    @property
    def context(self) -> str:
        return self.prompt + self.completion

    @property
    def model_text(self) -> str:
        """Only what the model generated, every turn, in order (no tool results, no template text)."""
        return "".join(self.completion[start:end] for start, end in self.model_spans)


def _call_tool(tool: Tool, arguments: dict[str, Any], row: int) -> str:
    try:
        # A tool bound to per-row state (an environment instance per rollout, copes.trl.task) is told the row.
        return tool.call_in_row(row, arguments) if hasattr(tool, "call_in_row") else tool.call(arguments)
    # A failing tool must cost one observation, not the whole population's rollout.
    except Exception as error:  # noqa: BLE001
        return f"Error: the {tool.name} tool failed: {type(error).__name__}: {error}"


def _refusal(call: ParsedCall, budgets: dict[str, int], calls_made: Counter[str]) -> str | None:
    """The error observation for a call that must not run; None admits it and charges it to the row's budget."""
    if not call.valid:
        return f"Error: {call.error}"
    budget = budgets.get(call.name)
    if budget is not None and calls_made[call.name] >= budget:
        return f"Error: the {call.name} budget of {budget} calls is used up; continue without it."
    calls_made[call.name] += 1
    return None


def _run_calls(
    calls_by_row: list[list[ParsedCall]],
    tools: dict[str, Tool],
    config: AgentConfig,
    calls_made: list[Counter[str]],
    rows: list[int],
) -> list[list[ToolCallRecord]]:
    """Judge every call of the turn in order (budgets are charged per row), then run the admitted ones, on the
    thread pool when there are several: sandboxed Python runs are separate processes, searches are lookups."""
    judged = [
        [(call, _refusal(call, config.budgets, made)) for call in calls]
        for calls, made in zip(calls_by_row, calls_made)
    ]
    jobs = [
        (tools[call.name], call.arguments, index)
        for index, calls in zip(rows, judged)
        for call, refusal in calls
        if refusal is None
    ]
    if config.tool_workers > 1 and len(jobs) > 1:
        with ThreadPoolExecutor(max_workers=min(config.tool_workers, len(jobs))) as pool:
            observations = iter(list(pool.map(lambda job: _call_tool(*job), jobs)))
    else:
        observations = iter([_call_tool(*job) for job in jobs])
    return [
        [
            ToolCallRecord(
                call.name, call.arguments, refusal is None, next(observations) if refusal is None else refusal
            )
            for call, refusal in row
        ]
        for row in judged
    ]


def derive_seed(seed: int, *keys: int) -> int:
    """An independent, reproducible seed for each (seed, keys...) combination, e.g. one per (turn, batch)."""
    return int(np.random.SeedSequence([seed, *keys]).generate_state(1)[0])


def _initial_prompts(
    tokenizer: Any,
    user_prompts: Sequence[str | list[dict[str, Any]]],
    tools: Sequence[Tool],
    fmt: str | None,
    system_prompt: str | None,
    chat: bool,
    config: AgentConfig,
) -> list[str]:
    if not chat:
        return list(user_prompts)
    system = [{"role": "system", "content": system_prompt}] if system_prompt is not None else []
    return [
        render_prompt_in_format(
            tokenizer,
            [*system, *(text if isinstance(text, list) else [{"role": "user", "content": text}])],
            tools,
            fmt,
            config.template_kwargs,
        )
        for text in user_prompts
    ]


def run_agent(
    model: Any,
    tokenizer: Any,
    user_prompts: list[str] | list[list[dict[str, Any]]],
    *,
    tools: Sequence[Tool] = (),
    config: AgentConfig,
    system_prompt: str | None = None,
    chat: bool = True,
    row_context: RowContext | None = None,
    seed: int | None = None,
) -> list[Trajectory]:
    """Roll out every user prompt, one trajectory per prompt in the same order. A prompt is the user turn's text or
    a whole conversation (a list of {"role", "content"} messages, TRL's conversational format).

    `chat=False` feeds the raw prompt text for a single turn without tools (the synthetic task).
    `row_context(indices)` wraps every forward (or, on an engine that runs a batch at once, every generate call);
    `indices` are the positions in `user_prompts` of that forward's rows, in batch order.
    """
    if not chat and (tools or system_prompt is not None):
        raise ValueError("chat=False runs raw prompts for a single turn: pass no tools and no system_prompt")
    if seed is not None and seed < 0:
        raise ValueError(f"seed must be >= 0 or None, got {seed}")
    tools_by_name = {tool.name: tool for tool in tools}
    if len(tools_by_name) != len(tools):
        raise ValueError(f"tool names must be unique, got {[tool.name for tool in tools]}")
    fmt = resolve_tool_format(tokenizer, config.tool_format, config.template_kwargs) if tools else None
    stop_strings = tool_stop_strings(fmt, tools) if fmt else ()
    trajectories = [
        Trajectory(prompt)
        for prompt in _initial_prompts(tokenizer, user_prompts, tools, fmt, system_prompt, chat, config)
    ]
    calls_made: list[Counter[str]] = [Counter() for _ in trajectories]
    max_turns = config.max_turns if chat else 1
    engine = engine_for(model)
    if not stop_strings and type(engine) is HFEngine:  # no tool call, no next turn: no row cache worth keeping
        engine = HFEngine(model, row_caches=False)
    engine.start_rollout()
    # An engine that keeps each tool-calling row's cache until the row's next turn holds, turn-major, the caches of
    # every row of the rollout at once; row-major (each batch of rows through all its turns before the next batch)
    # bounds them by one generate call's rows, what the memory plan counts.
    keeps_caches = bool(stop_strings) and getattr(engine, "keeps_row_caches", False)
    size = config.batch_size or max(len(trajectories), 1)
    everyone = list(range(len(trajectories)))
    groups = [everyone[start : start + size] for start in range(0, len(everyone), size)] if keeps_caches else [everyone]
    for group in groups:
        _run_turns(engine, tokenizer, trajectories, group, tools, fmt, stop_strings, config, calls_made, max_turns,
                   seed, row_context)
        if keeps_caches:
            engine.start_rollout()  # caches kept at the group's last turn serve no later call: free them now

    for trajectory in trajectories:
        if trajectory.finished_by is None:
            trajectory.finished_by = "max_turns"
    return trajectories


def _run_turns(engine: Any, tokenizer: Any, trajectories: list[Trajectory], rows: list[int],
               tools: Sequence[Tool], fmt: str | None, stop_strings: Sequence[str], config: AgentConfig,
               calls_made: list[Counter[str]], max_turns: int, seed: int | None,
               row_context: RowContext | None) -> None:
    """Every turn of the trajectories `rows` (indices into `trajectories`), turn-major, in generate calls of at
    most `config.batch_size` rows."""
    tools_by_name = {tool.name: tool for tool in tools}
    for turn in range(max_turns):
        active = [index for index in rows if trajectories[index].finished_by is None]
        if not active:
            break
        counts = prompt_token_counts(tokenizer, [trajectories[index].context for index in active])
        limits: dict[int, int] = {}
        for index, count in zip(active, counts):
            room = config.max_context_tokens - count
            if room < 1:
                trajectories[index].finished_by, trajectories[index].truncated = "context", True
            else:
                limits[index] = min(config.max_new_tokens, room)
        ready = list(limits)
        size = config.batch_size or max(len(ready), 1)
        generations: dict[int, Generation] = {}
        for start in range(0, len(ready), size):
            batch = ready[start : start + size]
            outputs = engine.generate(
                tokenizer,
                [trajectories[index].context for index in batch],
                max_new_tokens=[limits[index] for index in batch],
                greedy=config.greedy,
                temperature=config.temperature,
                top_p=config.top_p,
                stop_strings=stop_strings,
                seed=None if seed is None else derive_seed(seed, turn, batch[0]),
                rows=batch,
                keep=turn < max_turns - 1,  # the last turn's caches would serve no next turn
                row_context=row_context,
            )
            generations.update(zip(batch, outputs))

        calling = [index for index in ready if generations[index].finished_by == "stop"]
        for index in ready:
            trajectory, generation = trajectories[index], generations[index]
            trajectory.num_turns += 1
            trajectory.generated_tokens += generation.num_tokens
            trajectory.final_text = generation.text
            start = len(trajectory.completion)
            trajectory.completion += generation.text
            trajectory.model_spans.append((start, len(trajectory.completion)))
            if generation.finished_by == "eos":
                trajectory.finished_by = "eos"
            elif generation.finished_by == "length":
                cut_by_context = limits[index] < config.max_new_tokens
                trajectory.finished_by = "context" if cut_by_context else "length"
                trajectory.truncated = cut_by_context
        parsed = [parse_tool_calls(generations[index].text, fmt, tools) for index in calling]
        records = _run_calls(parsed, tools_by_name, config, [calls_made[index] for index in calling], calling)
        for index, row_records in zip(calling, records):
            trajectory = trajectories[index]
            # The record keeps the observation exactly as the model was shown it.
            budget = config.max_observation_tokens
            row_records = [
                replace(record, observation=observation_text(tokenizer, record.observation, budget))
                for record in row_records
            ]
            trajectory.tool_calls += row_records
            observations = [record.observation for record in row_records]
            trajectory.completion += (
                tool_results_suffix(tokenizer, observations, config.template_kwargs)
                if fmt == "qwen"
                else tag_results_suffix(observations)
            )

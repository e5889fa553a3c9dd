"""Rollouts: batched generation, chat templates and tool-call formats, the multi-turn agent loop."""

from copes.rollout.agent import AgentConfig, ToolCallRecord, Trajectory, run_agent
from copes.rollout.generate import Generation, generate_batch, prompt_token_counts
from copes.rollout.templates import ParsedCall, parse_tool_calls, render_prompt, resolve_tool_format

__all__ = [
    "AgentConfig",
    "Generation",
    "ParsedCall",
    "ToolCallRecord",
    "Trajectory",
    "generate_batch",
    "parse_tool_calls",
    "prompt_token_counts",
    "render_prompt",
    "resolve_tool_format",
    "run_agent",
]

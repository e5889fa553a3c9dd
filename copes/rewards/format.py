"""Shaping terms added to the correctness reward: the paper's format term and the tool bonus.

Format term (math): 0 when the output has both a complete `<answer>...</answer>` and exactly one complete
top-level `\\boxed{}` in it, -0.5 when one of the two is missing, -1 when both are. The box must sit inside the
answer span when there is one, because `<answer>\\boxed{...}</answer>` is the format the prompt asks for;
without an answer span a box anywhere counts (that is also where extraction falls back to). Two or more boxes
where one belongs (`\\boxed{3} or \\boxed{4}`) are no committed answer: the box part counts as missing.

Format term (QA): QA answers are free text and are never boxed, so only the answer span counts:
0 with a complete `<answer>...</answer>`, -1 without.

Tool bonus: +0.1 when the answer is correct and the rollout called a tool, to encourage tool use that pays off
without rewarding tool calls on their own.

Like extraction, the format term reads only model-generated text, never tool results (see `copes.rewards.extract`).
"""

from __future__ import annotations

from copes.rewards.extract import answer_span, boxed_contents

FORMAT_PENALTY_PER_MISSING_PART = 0.5
QA_MISSING_ANSWER_PENALTY = 1.0
TOOL_BONUS = 0.1
FORMAT_KINDS = ("math", "qa")


def format_reward(text: str, kind: str) -> float:
    """The format term for a whole model output of a `kind` ("math" or "qa") task; 0 is the best value."""
    if kind not in FORMAT_KINDS:
        raise ValueError(f"kind must be one of {FORMAT_KINDS}, got {kind!r}")
    span = answer_span(text)
    if kind == "qa":
        return 0.0 if span is not None else -QA_MISSING_ANSWER_PENALTY
    has_box = len(boxed_contents(text if span is None else span)) == 1
    missing_parts = (span is None) + (not has_box)
    return -FORMAT_PENALTY_PER_MISSING_PART * missing_parts


def tool_bonus(correct: bool, used_tool: bool) -> float:
    """+TOOL_BONUS for a correct answer reached with at least one tool call, else 0."""
    return TOOL_BONUS if correct and used_tool else 0.0

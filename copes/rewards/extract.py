"""Final-answer extraction from a model's whole output.

The prompts ask for `<answer>\\boxed{...}</answer>` (math) or `<answer>...</answer>` (QA). Extraction follows
the paper, most specific first:

1. the last complete `<answer>...</answer>`: the last `\\boxed{}` inside it, else its whole (stripped) content;
2. otherwise the last `\\boxed{}` anywhere in the output;
3. otherwise the whole output, stripped.

A tag or box that is opened but never closed (a truncated generation) does not count as complete.

This is the one committed answer every reward reads: an output that states several answers (two spans, two
boxes) is held to the last one, never credited for any of the others.

Pass only text the model generated (`Trajectory.final_text`, or `Trajectory.model_text`), never a transcript with
tool results in it: a tool the policy controls can print any `\\boxed{}` it likes.
"""

from __future__ import annotations

import re

ANSWER_OPEN, ANSWER_CLOSE = "<answer>", "</answer>"
# `\fbox` is what some models (and a few AIME solutions) write instead of `\boxed`.
_BOX_OPENING = re.compile(r"\\(?:boxed|fbox)\s*\{")

# Everything here runs on policy output, which can be hostile (thousands of unclosed tags or boxes): each
# function is one left-to-right pass, never a rescan from every opening.


def answer_span(text: str) -> str | None:
    """The content of the last complete `<answer>...</answer>` in `text`, or None when there is none.

    Each `<answer>` pairs with the first `</answer>` after it; the scan resumes after that closing tag."""
    span = None
    position = 0
    while (start := text.find(ANSWER_OPEN, position)) != -1:
        end = text.find(ANSWER_CLOSE, start + len(ANSWER_OPEN))
        if end == -1:
            break  # no later opening can close either
        span = text[start + len(ANSWER_OPEN) : end]
        position = end + len(ANSWER_CLOSE)
    return span


def closing_braces(text: str) -> dict[int, int]:
    """Index of every `{` that closes -> index of its `}`, in one pass.

    `\\{` and `\\}` are literal braces in LaTeX (set notation), so a backslash skips the next character."""
    closing: dict[int, int] = {}
    open_braces: list[int] = []
    index = 0
    while index < len(text):
        char = text[index]
        if char == "\\":
            index += 2
            continue
        if char == "{":
            open_braces.append(index)
        elif char == "}" and open_braces:
            closing[open_braces.pop()] = index
        index += 1
    return closing


def boxed_contents(text: str) -> list[str]:
    """Contents of every complete top-level `\\boxed{...}` (or `\\fbox{...}`) in `text`, in order.

    Braces are balanced, so `\\boxed{\\frac{1}{2}}` gives `\\frac{1}{2}`. Boxes nested inside a box belong to
    the outer one's content; an unclosed box is ignored, so a complete box before or after it is used.
    """
    if "box" not in text:
        return []
    closing = closing_braces(text)
    found: list[str] = []
    skip_until = 0  # the end of the last complete box: boxes inside it are part of its content
    for match in _BOX_OPENING.finditer(text):
        open_index = match.end() - 1
        close_index = closing.get(open_index)
        if match.start() < skip_until or close_index is None:
            continue
        found.append(text[open_index + 1 : close_index].strip())
        skip_until = close_index + 1
    return found


def last_boxed(text: str) -> str | None:
    """Content of the last complete top-level box in `text` (see `boxed_contents`), or None."""
    boxes = boxed_contents(text)
    return boxes[-1] if boxes else None


def extract_answer(text: str) -> str:
    """The model's final answer in `text` (see the module docstring for the order of fallbacks)."""
    span = answer_span(text)
    if span is not None:
        boxed = last_boxed(span)
        return boxed if boxed is not None else span.strip()
    boxed = last_boxed(text)
    return boxed if boxed is not None else text.strip()

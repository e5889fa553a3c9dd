"""Final-answer extraction from a model's whole output.

The prompts ask for `<answer>\\boxed{...}</answer>` (math) or `<answer>...</answer>` (QA). Extraction follows
the paper, most specific first:

1. the last complete `<answer>...</answer>`: the last `\\boxed{}` inside it, else its whole (stripped) content;
2. otherwise the last `\\boxed{}` anywhere in the output;
3. otherwise the whole output, stripped.

A tag or box that is opened but never closed (a truncated generation) does not count as complete.
"""

from __future__ import annotations

import re

# Non-greedy so that each <answer> pairs with its own closing tag; DOTALL because answers span lines.
_ANSWER_SPAN = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
# `\fbox` is what some models (and a few AIME solutions) write instead of `\boxed`.
_BOX_OPENING = re.compile(r"\\(?:boxed|fbox)\s*\{")


def answer_span(text: str) -> str | None:
    """The content of the last complete `<answer>...</answer>` in `text`, or None when there is none."""
    spans = _ANSWER_SPAN.findall(text)
    return spans[-1] if spans else None


def _closing_brace(text: str, open_index: int) -> int | None:
    """Index of the brace closing the `{` at `open_index`, or None when it never closes.

    `\\{` and `\\}` are literal braces in LaTeX (set notation), so they do not change the depth.
    """
    depth = 0
    index = open_index
    while index < len(text):
        char = text[index]
        if char == "\\":
            index += 2  # skip the escaped character, whatever it is
            continue
        if char == "{":
            depth += 1
        elif char == "}":
            depth -= 1
            if depth == 0:
                return index
        index += 1
    return None


def last_boxed(text: str) -> str | None:
    """Content of the last complete top-level `\\boxed{...}` (or `\\fbox{...}`) in `text`, or None.

    Braces are balanced, so `\\boxed{\\frac{1}{2}}` gives `\\frac{1}{2}`. Boxes nested inside a box belong to
    the outer one's content; an unclosed box is ignored, so a complete box before or after it is used.
    """
    found: str | None = None
    search_from = 0
    while (match := _BOX_OPENING.search(text, search_from)) is not None:
        open_index = match.end() - 1
        close_index = _closing_brace(text, open_index)
        if close_index is None:
            # Unclosed (a truncated or mistyped box): skip just this opening, complete boxes may follow.
            search_from = match.end()
            continue
        found = text[open_index + 1 : close_index].strip()
        search_from = close_index + 1
    return found


def extract_answer(text: str) -> str:
    """The model's final answer in `text` (see the module docstring for the order of fallbacks)."""
    span = answer_span(text)
    if span is not None:
        boxed = last_boxed(span)
        return boxed if boxed is not None else span.strip()
    boxed = last_boxed(text)
    return boxed if boxed is not None else text.strip()

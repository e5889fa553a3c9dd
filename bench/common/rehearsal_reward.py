"""A reward that tells a random model's members apart, for the dress rehearsal (bench/dress_rehearsal.py).

The rehearsal's random Qwen3.5-4B solves nothing, so the task's own reward is the same for every member and the step
would apply no update: the update's memory, and replay and resume over a real update, would go untested at 4B. Added
to the task's reward (`--reward math --reward bench.common.rehearsal_reward:distinct_characters`), it scores each
completion by the share of distinct characters in its text, which differs between members whose tokens differ. It is
an instrument, not a reward to train with: it pays no answer.
"""

from __future__ import annotations

from typing import Any


def completion_text(completion: Any) -> str:
    """A TRL completion as text: a string, or a conversation's messages (their contents joined)."""
    if isinstance(completion, str):
        return completion
    return " ".join(str(message.get("content") or "") for message in completion)


def distinct_characters(completions: list[Any], **_: Any) -> list[float]:
    """TRL's reward signature: distinct characters / characters of each completion (0 for an empty one)."""
    texts = [completion_text(completion) for completion in completions]
    return [len(set(text)) / len(text) if text else 0.0 for text in texts]

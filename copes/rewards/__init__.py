"""Rewards: answer extraction (one committed answer), math correctness (math-verify), QA reporting scores
(EM/F1/Acc) and the QA training reward, Countdown correctness and format terms (see docs/rewards.md)."""

from copes.rewards.countdown import countdown_correct
from copes.rewards.extract import answer_span, extract_answer, last_boxed
from copes.rewards.format import format_reward, tool_bonus
from copes.rewards.math import MathVerifierPool, math_correct, math_correct_batch
from copes.rewards.qa import qa_reward, qa_scores

__all__ = [
    "MathVerifierPool",
    "answer_span",
    "countdown_correct",
    "extract_answer",
    "format_reward",
    "last_boxed",
    "math_correct",
    "math_correct_batch",
    "qa_reward",
    "qa_scores",
    "tool_bonus",
]

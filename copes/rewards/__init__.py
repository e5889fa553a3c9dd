"""Rewards: answer extraction, math correctness (math-verify), QA scores (EM/F1/Acc), Countdown correctness and
format terms."""

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

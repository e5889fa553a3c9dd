"""One TRL training script, run as is by `trl.GRPOTrainer` and by `copes.ESTrainer`: only the trainer and config
classes (the import line) and the fields only one of them has differ (docs/from-trl.md). Module-level functions, so
ESTrainer can hash them into its journal and rebuild them in other ranks.
"""

from __future__ import annotations

from typing import Any

from datasets import Dataset
from transformers import AutoTokenizer, TrainerCallback

from copes.modeling import resolve_model_path

TINY = resolve_model_path("tiny")  # the embedded 66.6K-parameter arithmetic model (characters 0-9 + - * = and \n)
# The embedded tokenizer has no chat template; this one renders a conversation as its contents, which it can spell.
CONTENTS_TEMPLATE = "{% for message in messages %}{{ message['content'] }}{% endfor %}"
SHARED_KEYS = ("reward", "reward_std", "frac_reward_zero_std", "completions/mean_length", "completions/min_length",
               "completions/max_length", "completions/clipped_ratio", "num_tokens", "learning_rate", "step_time")


def contents_tokenizer() -> Any:
    """The embedded tokenizer with CONTENTS_TEMPLATE, for conversational rows."""
    tokenizer = AutoTokenizer.from_pretrained(TINY)
    tokenizer.chat_template = CONTENTS_TEMPLATE
    return tokenizer


def arithmetic_rows(conversational: bool, count: int = 12) -> Dataset:
    """Problems like the embedded model's, with `solution` (TRL's accuracy_reward reads it) and `answer` columns."""
    pairs = [(a, b) for a in range(12, 90, 17) for b in range(7, 60, 13)][:count]
    rows = [{"prompt": [{"role": "user", "content": f"{a}+{b}="}] if conversational else f"{a}+{b}=",
             "solution": str(a + b), "answer": str(a + b)} for a, b in pairs]
    return Dataset.from_list(rows)


def answer_column_reward(completions: list[Any], answer: list[str], **kwargs: Any) -> list[float]:
    """A user reward reading the `answer` column: 1 for the exact sum, else 0.1 per right leading digit."""
    texts = [c if isinstance(c, str) else c[0]["content"] for c in completions]
    rewards = []
    for text, gold in zip(texts, answer):
        text = text.strip()
        right = next((i for i, (x, y) in enumerate(zip(text, gold)) if x != y), min(len(text), len(gold)))
        rewards.append(1.0 if text == gold else 0.1 * right)
    return rewards


class KeyRecorder(TrainerCallback):
    """Remembers every event and every logged dict."""

    def __init__(self) -> None:
        self.events: list[str] = []
        self.logs: list[dict[str, float]] = []

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.events.append("train_begin")

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.events.append(f"step_end {state.global_step}")

    def on_log(self, args: Any, state: Any, control: Any, logs: dict[str, float] | None = None, **kwargs: Any) -> None:
        self.logs.append(dict(logs or {}))

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.events.append("train_end")


class StopAfter(TrainerCallback):
    """Asks training to stop at the end of step `steps`."""

    def __init__(self, steps: int) -> None:
        self.steps = steps

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> Any:
        if state.global_step >= self.steps:
            control.should_training_stop = True
        return control


def train_twin(trainer_class: type, config_class: type, *, conversational: bool, output_dir: str,
               **own_fields: Any) -> tuple[Any, KeyRecorder]:
    """The script: 2 steps on the embedded model with TRL's accuracy_reward (conversational data) and a user reward
    reading a column; `own_fields` are the config fields only this trainer has."""
    from trl.rewards import accuracy_reward

    tokenizer = contents_tokenizer() if conversational else AutoTokenizer.from_pretrained(TINY)
    recorder = KeyRecorder()
    args = config_class(output_dir=output_dir, max_steps=2, logging_steps=1, learning_rate=0.0025, seed=0,
                        max_completion_length=4, report_to="none", **own_fields)
    trainer = trainer_class(model=TINY, reward_funcs=[accuracy_reward, answer_column_reward] if conversational
                            else [answer_column_reward], args=args, train_dataset=arithmetic_rows(conversational),
                            processing_class=tokenizer, callbacks=[recorder])
    trainer.train()
    return trainer, recorder

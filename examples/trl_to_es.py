"""A TRL GRPO script moved to evolution strategies: two lines change (docs/from-trl.md).

    python examples/trl_to_es.py [--steps 3] [--output-dir runs/trl_to_es] [--device-memory-gib GIB]

It trains the embedded tiny model (66.6K parameters, adds and subtracts integers) on a `datasets.Dataset` with a
`prompt` column and an extra `answer` column, scored by a TRL-signature reward function that reads that column, with
a transformers callback printing GRPO's log keys. With `from trl import GRPOTrainer as Trainer, GRPOConfig as Config`
and GRPO's own fields (num_generations, per_device_train_batch_size) in place of the ES ones, the same script runs
TRL's GRPO.
"""

from __future__ import annotations

import argparse
import random

from datasets import Dataset
from transformers import TrainerCallback

from copes import ESConfig as Config  # was: from trl import GRPOConfig as Config
from copes import ESTrainer as Trainer  # was: from trl import GRPOTrainer as Trainer


def sums(count: int, seed: int) -> Dataset:
    """`a+b=` problems in the embedded model's format (raw text: TRL's standard prompt-only data)."""
    rng = random.Random(seed)
    pairs = [(rng.randint(0, 999), rng.randint(0, 999)) for _ in range(count)]
    return Dataset.from_list([{"prompt": f"{a}+{b}=", "answer": str(a + b)} for a, b in pairs])


def exact_sum(completions: list[str], answer: list[str], **kwargs) -> list[float]:
    """TRL's reward signature: the completions, and every other column as a keyword list."""
    return [float(completion.strip() == gold) for completion, gold in zip(completions, answer)]


class PrintRewards(TrainerCallback):
    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs and "reward" in logs:
            print(f"step {state.global_step}: reward {logs['reward']:.3f} (std {logs['reward_std']:.3f}), "
                  f"completions/mean_length {logs['completions/mean_length']:.2f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--output-dir", default="runs/trl_to_es")
    parser.add_argument("--device-memory-gib", type=float, help="the memory the plan budgets (default: what is free)")
    options = parser.parse_args()
    args = Config(output_dir=options.output_dir, max_steps=options.steps, learning_rate=0.0025, logging_steps=1,
                  max_completion_length=6, seed=0,
                  # the ES-only fields: a population of 8 perturbations in 2 subspaces, 32 questions per step
                  population_size=8, num_subspaces=2, sigma=0.01, prompt_batch_size=32, chunk_size=4096, cpu_threads=1,
                  device_memory_gib=options.device_memory_gib)
    trainer = Trainer(model="tiny", reward_funcs=[exact_sum], args=args, train_dataset=sums(2000, seed=0),
                      eval_dataset=sums(64, seed=1), callbacks=[PrintRewards()])
    before = trainer.evaluate()
    trainer.train()
    after = trainer.evaluate()
    print(f"held-out reward {before['eval_reward']:.3f} -> {after['eval_reward']:.3f}")
    trainer.save_model()


if __name__ == "__main__":
    main()

"""Train the embedded small model (copes/assets/small): the larger model of the paper-claims ablations.

The tiny model (66.6K parameters, 17 symbols) cannot separate the ablations' configurations at 5 seeds and cannot
write a Countdown prompt (docs/paper-claims.md). This one is the same architecture family (Qwen3) at a few million
parameters, pretrained with AdamW (backprop: this is the base model, not the ES run) on the train splits of the
repository's own synthetic tasks, rendered exactly as a `copes-run` rollout renders them:

- arithmetic: the raw problem (`37+485=`, no chat), then the answer and EOS;
- countdown: the TinyZero prompt as a user turn in the plain role-labelled text a tokenizer without a chat template
  gets (copes.rollout.templates), then ` <answer>EXPRESSION</answer>` and EOS, the expression the task's reference
  solution.

The tokenizer is the tiny agent's (BPE over printable ASCII, digits one token each) with the Countdown prompt's
fixed text and the answer tags one token each. The loss covers only what the model writes. Training stops at the
first check where every task's greedy validation accuracy reaches its `--stop` value, on purpose: a half-trained
model leaves ES room on both tasks. The final accuracies come from copes' own evaluation (copes.run.evaluation).

    nice -n 10 python examples/train_small_model.py            # writes copes/assets/small/
    python examples/train_small_model.py --out /tmp/small --max-steps 50 --eval-every 25 --eval-size 20
"""

from __future__ import annotations

import argparse
import random
import time
from pathlib import Path

import torch
from train_tiny_agent_model import (
    Transcript,
    add_shape_arguments,
    batch_tensors,
    build_model,
    build_tokenizer,
    encode,
    save,
    train_step,
)
from transformers import GenerationConfig, Qwen3ForCausalLM

from copes.rollout import AgentConfig
from copes.rollout.templates import render_prompt_in_format
from copes.run.evaluation import evaluate
from copes.tasks.base import Example, TaskBase
from copes.tasks.countdown import PROMPT, CountdownTask
from copes.tasks.synthetic import ArithmeticTask

DEFAULT_OUT = Path(__file__).resolve().parents[1] / "copes" / "assets" / "small"
ANSWER_OPEN, ANSWER_CLOSE = "<answer>", "</answer>"
# The longest completion either task needs: ` <answer>` + a 4-number expression with parentheses + `</answer>` + EOS.
MAX_NEW_TOKENS = 32


def countdown_fixed_text() -> list[str]:
    """The Countdown prompt's text around its two blanks, as the plain rendering shows it: one token each."""
    rendered = render_prompt_in_format(None, [{"role": "user", "content": PROMPT.format(numbers="\0", target="\1")}],
                                       (), None)
    return [piece for piece in rendered.replace("\1", "\0").split("\0") if piece] + [ANSWER_OPEN, ANSWER_CLOSE]


def transcript(task: TaskBase, example: Example) -> Transcript:
    if not task.chat:
        return task.prompt(example), [(example.golds[0], True)]
    prompt = render_prompt_in_format(None, [{"role": "user", "content": task.prompt(example)}], (), None)
    return prompt, [(f" {ANSWER_OPEN}{example.meta['solution']}{ANSWER_CLOSE}", True)]


def held_out_accuracy(model: Qwen3ForCausalLM, tokenizer, task: TaskBase, size: int) -> float:
    """Greedy validation accuracy through copes' own evaluation (the rollout a `copes-run` scores)."""
    model.eval()
    agent = AgentConfig.for_task(task, max_new_tokens=MAX_NEW_TOKENS, max_turns=1)
    result = evaluate(model, tokenizer, task, task.examples("validation", size), agent_config=agent,
                      batch_size=100, progress=False)
    model.train()
    return result.accuracy


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="where save_pretrained writes the model")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=2, help="torch threads")
    parser.add_argument("--vocab-size", type=int, default=160, help="BPE vocabulary before the fixed-text tokens")
    add_shape_arguments(parser, hidden_size=128, intermediate_size=512, num_layers=8, num_heads=4)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--warmup-steps", type=int, default=100)
    parser.add_argument("--max-steps", type=int, default=6000)
    parser.add_argument("--eval-every", type=int, default=250, help="steps between validation checks")
    parser.add_argument("--eval-size", type=int, default=200, help="validation problems per task per check")
    parser.add_argument("--stop", nargs=2, type=float, default=(0.3, 0.2), metavar=("ARITHMETIC", "COUNTDOWN"),
                        help="stop at the first check where both tasks' validation accuracy reach these")
    parser.add_argument("--final-eval-size", type=int, default=500, help="validation problems per task at the end")
    args = parser.parse_args()
    if not all(0.0 < stop <= 1.0 for stop in args.stop):
        raise ValueError(f"--stop values must be in (0, 1], got {args.stop}")

    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    started = time.perf_counter()
    tasks = (ArithmeticTask(seed=args.seed), CountdownTask(seed=args.seed))
    transcripts = [transcript(task, example) for task in tasks for example in task.examples("train")]
    random.Random(args.seed).shuffle(transcripts)
    texts = [prompt + "".join(part for part, _ in parts) for prompt, parts in transcripts]
    tokenizer = build_tokenizer(texts, args.vocab_size, countdown_fixed_text())
    rows = encode(tokenizer, transcripts)
    print(f"{len(rows):,} transcripts, vocab {len(tokenizer)}, tokens per transcript: mean "
          f"{sum(len(ids) for ids, _ in rows) / len(rows):.0f}, max {max(len(ids) for ids, _ in rows)} "
          f"({time.perf_counter() - started:.0f}s)", flush=True)

    model = build_model(tokenizer, args)
    model.generation_config = GenerationConfig(do_sample=False, max_new_tokens=MAX_NEW_TOKENS,
                                               eos_token_id=tokenizer.eos_token_id,
                                               pad_token_id=tokenizer.pad_token_id)
    parameters = sum(p.numel() for p in model.parameters())
    print(f"model: {parameters:,} parameters", flush=True)

    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01, betas=(0.9, 0.98))
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: min(1.0, (step + 1) / args.warmup_steps))
    shuffle = torch.Generator().manual_seed(args.seed)
    order, position = torch.randperm(len(rows), generator=shuffle).tolist(), 0
    checks: list[dict[str, float]] = []
    model.train()
    for step in range(1, args.max_steps + 1):
        if position + args.batch_size > len(order):
            order, position = torch.randperm(len(rows), generator=shuffle).tolist(), 0
        batch = batch_tensors([rows[index] for index in order[position : position + args.batch_size]],
                              tokenizer.pad_token_id)
        position += args.batch_size
        loss = train_step(model, batch, optimizer, schedule)
        if step % args.eval_every == 0:
            accuracy = {task.name: held_out_accuracy(model, tokenizer, task, args.eval_size) for task in tasks}
            checks.append({"step": step, "loss": round(loss, 4), **accuracy})
            shown = "  ".join(f"{name} {value:.3f}" for name, value in accuracy.items())
            print(f"step {step:5d}  loss {loss:.4f}  validation {shown}  "
                  f"({time.perf_counter() - started:.0f}s)", flush=True)
            if all(accuracy[task.name] >= stop for task, stop in zip(tasks, args.stop)):
                break
    training_seconds = time.perf_counter() - started

    held_out = {task.name: held_out_accuracy(model, tokenizer, task, args.final_eval_size) for task in tasks}
    print(f"stopped at step {step}: validation ({args.final_eval_size} per task) {held_out}")
    summary = {key: value for key, value in vars(args).items() if key != "out"}
    summary.update(steps_taken=step, parameters=parameters, transcripts=len(rows),
                   training_seconds=round(training_seconds), checks=checks, held_out=held_out)
    save(model, tokenizer, args.out, summary)
    print(f"saved to {args.out} ({time.perf_counter() - started:.0f}s in all)")


if __name__ == "__main__":
    main()

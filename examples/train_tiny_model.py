"""Train the embedded tiny model (copes/assets/tiny) that `copes-run` fine-tunes with ES by default.

A character-level tokenizer and a small Qwen3 causal LM are pretrained with AdamW (backprop is fine: this is
the base model, not the ES run) on the train split of the synthetic arithmetic task. Training stops as soon as
greedy validation accuracy reaches `--stop-accuracy`, on purpose: a half-trained model leaves room for ES to
show held-out accuracy rising.

    python examples/train_tiny_model.py                    # writes copes/assets/tiny/
    python examples/train_tiny_model.py --out /tmp/tiny --stop-accuracy 0.5
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import GenerationConfig, PreTrainedTokenizerFast, Qwen3Config, Qwen3ForCausalLM

from copes.tasks.base import Example
from copes.tasks.synthetic import ArithmeticTask

DEFAULT_OUT = Path(__file__).resolve().parents[1] / "copes" / "assets" / "tiny"
PAD_TOKEN = "<|pad|>"
EOS_TOKEN = "<|endoftext|>"
CHARACTERS = "0123456789+-*=\n"


def build_tokenizer() -> PreTrainedTokenizerFast:
    """One token per character; left padding so batched greedy generation appends after every prompt."""
    vocab = {token: index for index, token in enumerate([PAD_TOKEN, EOS_TOKEN, *CHARACTERS])}
    tokenizer = Tokenizer(models.WordLevel(vocab=vocab, unk_token=EOS_TOKEN))
    # [\s\S] (unlike ".") also matches newlines, so every character becomes its own piece.
    tokenizer.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    tokenizer.decoder = decoders.Fuse()  # concatenate characters back without spaces
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        pad_token=PAD_TOKEN,
        eos_token=EOS_TOKEN,
        padding_side="left",
        clean_up_tokenization_spaces=False,
        model_max_length=64,
    )


def build_model(tokenizer: PreTrainedTokenizerFast, args: argparse.Namespace) -> Qwen3ForCausalLM:
    config = Qwen3Config(
        vocab_size=len(tokenizer),
        hidden_size=args.hidden_size,
        intermediate_size=args.intermediate_size,
        num_hidden_layers=args.num_layers,
        num_attention_heads=args.num_heads,
        num_key_value_heads=args.num_heads,
        head_dim=args.head_dim,
        max_position_embeddings=64,
        tie_word_embeddings=True,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=None,
    )
    return Qwen3ForCausalLM(config)


def training_batch(tokenizer: PreTrainedTokenizerFast, examples: list[Example]) -> dict[str, torch.Tensor]:
    """Right-padded "prompt answer EOS" rows; the loss only covers the answer and EOS."""
    rows, answer_starts = [], []
    for example in examples:
        prompt_ids = tokenizer(example.question)["input_ids"]
        answer_ids = tokenizer(example.golds[0])["input_ids"] + [tokenizer.eos_token_id]
        rows.append(prompt_ids + answer_ids)
        answer_starts.append(len(prompt_ids))
    width = max(len(row) for row in rows)
    input_ids = torch.full((len(rows), width), tokenizer.pad_token_id)
    labels = torch.full((len(rows), width), -100)
    attention_mask = torch.zeros((len(rows), width), dtype=torch.long)
    for index, (row, start) in enumerate(zip(rows, answer_starts)):
        input_ids[index, : len(row)] = torch.tensor(row)
        labels[index, start : len(row)] = torch.tensor(row[start:])
        attention_mask[index, : len(row)] = 1
    return {"input_ids": input_ids, "labels": labels, "attention_mask": attention_mask}


@torch.no_grad()
def greedy_accuracy(
    model: Qwen3ForCausalLM,
    tokenizer: PreTrainedTokenizerFast,
    task: ArithmeticTask,
    examples: list[Example],
    batch_size: int = 256,
) -> float:
    model.eval()
    correct = 0
    for start in range(0, len(examples), batch_size):
        batch = examples[start : start + batch_size]
        inputs = tokenizer([task.prompt(example) for example in batch], return_tensors="pt", padding=True)
        outputs = model.generate(**inputs, generation_config=model.generation_config)
        completions = tokenizer.batch_decode(outputs[:, inputs["input_ids"].shape[1] :], skip_special_tokens=True)
        correct += sum(task.score(text, example).correct for text, example in zip(completions, batch))
    model.train()
    return correct / len(examples)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="where save_pretrained writes the model")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=1, help="torch threads; more only slows a model this small")
    parser.add_argument("--hidden-size", type=int, default=32)
    parser.add_argument("--intermediate-size", type=int, default=128)
    parser.add_argument("--num-layers", type=int, default=4)
    parser.add_argument("--num-heads", type=int, default=1)
    parser.add_argument("--head-dim", type=int, default=32, help="vLLM's CPU attention needs head_dim >= 32")
    parser.add_argument("--batch-size", type=int, default=128)
    parser.add_argument("--lr", type=float, default=5e-3)
    parser.add_argument("--warmup-steps", type=int, default=100)
    parser.add_argument("--max-steps", type=int, default=20_000)
    parser.add_argument("--eval-every", type=int, default=100, help="steps between validation evaluations")
    parser.add_argument("--eval-size", type=int, default=500, help="validation problems per evaluation")
    parser.add_argument("--stop-accuracy", type=float, default=0.3, help="stop once validation accuracy reaches this")
    args = parser.parse_args()
    if not 0.0 < args.stop_accuracy <= 1.0:
        raise ValueError(f"--stop-accuracy must be in (0, 1], got {args.stop_accuracy}")

    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    task = ArithmeticTask(seed=args.seed)
    train = task.examples("train")
    validation = task.examples("validation", args.eval_size)
    tokenizer = build_tokenizer()
    model = build_model(tokenizer, args)
    longest_answer = max(len(example.golds[0]) for example in train)
    model.generation_config = GenerationConfig(
        do_sample=False,
        max_new_tokens=longest_answer + 1,  # the answer and its EOS, nothing more: this bounds ES rollout time
        eos_token_id=[tokenizer.eos_token_id, tokenizer.convert_tokens_to_ids("\n")],
        pad_token_id=tokenizer.pad_token_id,
    )
    parameter_count = sum(p.numel() for p in model.parameters())
    print(f"model: {parameter_count:,} parameters, vocab {len(tokenizer)}, {len(train):,} training problems")

    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01, betas=(0.9, 0.98))
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: min(1.0, (step + 1) / args.warmup_steps))
    shuffle = torch.Generator().manual_seed(args.seed)
    order = torch.randperm(len(train), generator=shuffle)
    position, accuracy, started = 0, 0.0, time.perf_counter()
    model.train()
    for step in range(1, args.max_steps + 1):
        if position + args.batch_size > len(order):
            order, position = torch.randperm(len(train), generator=shuffle), 0
        batch = [train[index] for index in order[position : position + args.batch_size].tolist()]
        position += args.batch_size
        loss = model(**training_batch(tokenizer, batch)).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        if step % args.eval_every == 0:
            accuracy = greedy_accuracy(model, tokenizer, task, validation)
            elapsed = time.perf_counter() - started
            print(f"step {step:6d}  loss {loss.item():.4f}  validation accuracy {accuracy:.3f}  ({elapsed:.0f}s)")
            if accuracy >= args.stop_accuracy:
                break

    test_accuracy = greedy_accuracy(model, tokenizer, task, task.examples("test"))
    print(f"stopped at step {step}: validation {accuracy:.3f}, test {test_accuracy:.3f}")
    args.out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(args.out, safe_serialization=True)
    tokenizer.save_pretrained(args.out)
    # transformers 5 writes its own class name (TokenizersBackend); the 4.x name loads under both majors.
    tokenizer_config_path = args.out / "tokenizer_config.json"
    tokenizer_config = json.loads(tokenizer_config_path.read_text())
    tokenizer_config["tokenizer_class"] = "PreTrainedTokenizerFast"
    tokenizer_config_path.write_text(json.dumps(tokenizer_config, indent=2) + "\n")
    training = {key: value for key, value in vars(args).items() if key != "out"}
    training.update(steps=step, validation_accuracy=accuracy, test_accuracy=test_accuracy)
    (args.out / "training_summary.json").write_text(json.dumps(training, indent=2) + "\n")
    print(f"saved to {args.out}")


if __name__ == "__main__":
    main()

"""Train the embedded tool-using model (copes/assets/tiny-agent) that the `configs/tiny-agent-*.yaml` runs start from.

Synthetic transcripts of the repository's own tool tasks (copes/tasks/tool_use.py), rendered exactly as the agent
loop renders them (copes.rollout.templates, "tags" format, no chat template), teach a small Qwen3 to call tools:

- tool-arithmetic: products and chains get `<python>print(EXPR)</python>`, the program's output comes back in
  `<result>`, and the model copies it into `<answer></answer>`; one-digit sums are answered directly;
- tool-lookup: `<search>NAME</search>` over the made-up world's corpus (the real BM25 search, real observations),
  and for two-hop questions a second `<search>TOWN</search>` with the town read from the first result.

The Python tool's observation is the printed value of the expression, which the script computes with Python's own
arithmetic (what the sandbox prints for `print(EXPR)`; running 50,000 sandboxes would take hours). A BPE tokenizer
over printable ASCII (digits one token each, so numbers copy digit by digit) is trained on the transcripts; the
loss covers only what the model writes (its turns and their EOS), never the prompt or tool output. At the end the
model is evaluated through the real agent loop with the real sandbox and search on held-out questions, and the
accuracy and tool-use rate land in training_summary.json.

    nice -n 10 python examples/train_tiny_agent_model.py          # writes copes/assets/tiny-agent/
    python examples/train_tiny_agent_model.py --out /tmp/agent --steps 200 --eval-size 20
"""

from __future__ import annotations

import argparse
import functools
import json
import random
import time
from collections.abc import Callable
from pathlib import Path

import torch
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import GenerationConfig, PreTrainedTokenizerFast, Qwen3Config, Qwen3ForCausalLM

from copes.rollout import AgentConfig
from copes.rollout.templates import render_prompt_in_format, tag_format_instructions, tag_results_suffix
from copes.run.evaluation import evaluate
from copes.tasks.base import Example
from copes.tasks.tool_use import ANSWER_INSTRUCTION, ToolArithmeticTask, ToolLookupTask
from copes.tools import BM25Search, PythonSandbox, PythonTool, SearchTool, write_corpus

DEFAULT_OUT = Path(__file__).resolve().parents[1] / "copes" / "assets" / "tiny-agent"
PAD_TOKEN, EOS_TOKEN, UNK_TOKEN = "<|pad|>", "<|endoftext|>", "<|unk|>"
ALPHABET = [*(chr(code) for code in range(32, 127)), "\n", "\t"]  # printable ASCII, newline and tab
# Words (with their leading space) are merged by BPE; every digit and every other character stays one piece, so
# a number is copied digit by digit and tool-call tags never merge with the text around them.
PIECES = r" ?[A-Za-z]+|[0-9]|\s|[^\sA-Za-z0-9]"
MAX_POSITIONS = 1024

# A transcript: the prompt, then alternating (model turn, observation) parts; the last part is the model's answer.
Transcript = tuple[str, list[tuple[str, bool]]]  # (prompt, [(text, written by the model)])


def arithmetic_transcript(task: ToolArithmeticTask, example: Example, prompt: str) -> Transcript:
    answer = f"<answer>{example.golds[0]}</answer>"
    if not example.meta["needs_tool"]:
        return prompt, [(answer, True)]
    printed = str(eval(example.meta["expression"]))  # noqa: S307 - digits and + - * only, built by the task
    call = f"<python>print({example.meta['expression']})</python>"
    return prompt, [(call, True), (tag_results_suffix([printed]), False), (answer, True)]


def lookup_transcript(search: Callable[[str], str], task: ToolLookupTask, example: Example, prompt: str) -> Transcript:
    person = task.world.person(example.meta["person"])
    parts: list[tuple[str, bool]] = []
    for query in [person.name] + ([person.town.name] if example.meta["hops"] == 2 else []):
        parts += [(f"<search>{query}</search>", True), (tag_results_suffix([search(query)]), False)]
    return prompt, [*parts, (f"<answer>{example.golds[0]}</answer>", True)]


def build_tokenizer(texts: list[str], vocab_size: int, fixed_strings: list[str]) -> PreTrainedTokenizerFast:
    """BPE over printable ASCII. `fixed_strings` (the tool instructions and the answer instruction every prompt
    repeats word for word) become one token each: a prompt costs ~30 tokens instead of ~130, in pretraining and
    in every ES rollout, and any other text still tokenizes (and decodes back) exactly."""
    tokenizer = Tokenizer(models.BPE(unk_token=UNK_TOKEN))
    tokenizer.pre_tokenizer = pre_tokenizers.Split(Regex(PIECES), behavior="isolated")
    tokenizer.decoder = decoders.Fuse()  # the pieces carry their own spaces
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[PAD_TOKEN, EOS_TOKEN, UNK_TOKEN],
                                  initial_alphabet=ALPHABET, show_progress=False)
    tokenizer.train_from_iterator(texts, trainer)
    tokenizer.add_tokens([AddedToken(text, normalized=False) for text in fixed_strings])
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, pad_token=PAD_TOKEN, eos_token=EOS_TOKEN,
                                   unk_token=UNK_TOKEN, padding_side="left", clean_up_tokenization_spaces=False,
                                   model_max_length=MAX_POSITIONS)


def model_spans(transcript: Transcript) -> tuple[str, list[tuple[int, int]]]:
    """The transcript's whole text and the (start, end) character spans the model wrote."""
    prompt, parts = transcript
    text, spans = prompt, []
    for part, by_model in parts:
        if by_model:
            spans.append((len(text), len(text) + len(part)))
        text += part
    return text, spans


def encode(tokenizer: PreTrainedTokenizerFast, transcripts: list[Transcript]) -> list[tuple[list[int], list[int]]]:
    """(ids, labels) of each transcript tokenized whole, as the agent loop tokenizes a context; labels are -100
    except on tokens inside a model turn, plus an EOS after the last one."""
    texts, spans = zip(*(model_spans(transcript) for transcript in transcripts))
    encoded = tokenizer(list(texts), return_offsets_mapping=True, add_special_tokens=False)
    rows = []
    for ids, offsets, row_spans in zip(encoded["input_ids"], encoded["offset_mapping"], spans):
        labels = [token if any(start <= begin and end <= stop for start, stop in row_spans) else -100
                  for token, (begin, end) in zip(ids, offsets)]
        rows.append((ids + [tokenizer.eos_token_id], labels + [tokenizer.eos_token_id]))
    return rows


def batch_tensors(rows: list[tuple[list[int], list[int]]], pad: int) -> dict[str, torch.Tensor]:
    width = max(len(ids) for ids, _ in rows)
    input_ids = torch.full((len(rows), width), pad)
    labels = torch.full((len(rows), width), -100)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for index, (ids, row_labels) in enumerate(rows):
        input_ids[index, : len(ids)] = torch.tensor(ids)
        labels[index, : len(ids)] = torch.tensor(row_labels)
        mask[index, : len(ids)] = 1
    return {"input_ids": input_ids, "labels": labels, "attention_mask": mask}


def add_shape_arguments(parser: argparse.ArgumentParser, *, hidden_size: int, intermediate_size: int,
                        num_layers: int, num_heads: int) -> None:
    """The Qwen3 shape options of the scripts that train on this tokenizer (this one and train_small_model.py)."""
    parser.add_argument("--hidden-size", type=int, default=hidden_size)
    parser.add_argument("--intermediate-size", type=int, default=intermediate_size)
    parser.add_argument("--num-layers", type=int, default=num_layers)
    parser.add_argument("--num-heads", type=int, default=num_heads)
    parser.add_argument("--head-dim", type=int, default=32, help="vLLM's CPU attention needs head_dim >= 32")


def build_model(tokenizer: PreTrainedTokenizerFast, args: argparse.Namespace) -> Qwen3ForCausalLM:
    """A fresh Qwen3 of the shape options' size, tied embeddings, the tokenizer's pad and EOS."""
    config = Qwen3Config(
        vocab_size=len(tokenizer), hidden_size=args.hidden_size, intermediate_size=args.intermediate_size,
        num_hidden_layers=args.num_layers, num_attention_heads=args.num_heads, num_key_value_heads=args.num_heads,
        head_dim=args.head_dim, max_position_embeddings=MAX_POSITIONS, tie_word_embeddings=True,
        pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id, bos_token_id=None,
    )
    return Qwen3ForCausalLM(config)


def train_step(model: Qwen3ForCausalLM, batch: dict[str, torch.Tensor], optimizer: torch.optim.Optimizer,
               schedule: torch.optim.lr_scheduler.LRScheduler) -> float:
    """One clipped AdamW step on `batch`; returns its loss."""
    loss = model(**batch).loss
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    schedule.step()
    optimizer.zero_grad(set_to_none=True)
    return loss.item()


def save(model: Qwen3ForCausalLM, tokenizer: PreTrainedTokenizerFast, out: Path, summary: dict) -> None:
    """The model, its tokenizer (loadable under transformers 4 and 5) and training_summary.json in `out`."""
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    # transformers 5 writes its own class name (TokenizersBackend); the 4.x name loads under both majors.
    tokenizer_config_path = out / "tokenizer_config.json"
    tokenizer_config = json.loads(tokenizer_config_path.read_text())
    tokenizer_config["tokenizer_class"] = "PreTrainedTokenizerFast"
    tokenizer_config_path.write_text(json.dumps(tokenizer_config, indent=2) + "\n")
    (out / "training_summary.json").write_text(json.dumps(summary, indent=2) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="where save_pretrained writes the model")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=1, help="torch threads")
    parser.add_argument("--vocab-size", type=int, default=512)
    add_shape_arguments(parser, hidden_size=64, intermediate_size=128, num_layers=4, num_heads=2)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--warmup-steps", type=int, default=100)
    parser.add_argument("--steps", type=int, default=1500)
    parser.add_argument("--log-every", type=int, default=50)
    parser.add_argument("--max-minutes", type=float, default=None,
                        help="stop training after this much wall time (the summary records the steps taken; "
                             "--steps with that number replays the same model)")
    parser.add_argument("--eval-size", type=int, default=50, help="held-out questions per task for the final report")
    args = parser.parse_args()

    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    started = time.perf_counter()
    arithmetic, lookup = ToolArithmeticTask(seed=args.seed), ToolLookupTask(seed=args.seed)
    args.out.mkdir(parents=True, exist_ok=True)
    corpus_path = args.out / "corpus.jsonl"  # committed with the model: what its search tool searched in training
    write_corpus(lookup.corpus_paragraphs(), corpus_path)
    python_tool = PythonTool(PythonSandbox())
    search = SearchTool(BM25Search(corpus_path))
    observation = functools.cache(lambda query: search.call({"query": query}))  # ~4 questions per person
    # The tools each task gets in a copes-run (copes.config.components.build_tools): Python always, search where the
    # task has a corpus. A transcript's prompt lists exactly those, as the agent loop renders it.
    tools = {arithmetic.name: [python_tool], lookup.name: [python_tool, search]}

    def prompt(task: ToolArithmeticTask | ToolLookupTask, example: Example) -> str:
        messages = [{"role": "user", "content": task.prompt(example)}]
        return render_prompt_in_format(None, messages, tools[task.name], "tags")

    # As many transcripts as the steps read (5 arithmetic to 3 lookup), each seen once.
    wanted = args.steps * args.batch_size
    transcripts = [arithmetic_transcript(arithmetic, e, prompt(arithmetic, e))
                   for e in arithmetic.examples("train", wanted * 5 // 8)]
    transcripts += [lookup_transcript(observation, lookup, e, prompt(lookup, e))
                    for e in lookup.examples("train", wanted - len(transcripts))]
    random.Random(args.seed).shuffle(transcripts)
    texts = [model_spans(transcript)[0] for transcript in transcripts]
    fixed = [*tag_format_instructions(tools[lookup.name]).split("\n"), ANSWER_INSTRUCTION]
    tokenizer = build_tokenizer(texts, args.vocab_size, fixed)
    rows = encode(tokenizer, transcripts)
    longest = max(len(ids) for ids, _ in rows)
    print(f"{len(rows):,} transcripts, vocab {len(tokenizer)}, tokens per transcript: mean "
          f"{sum(len(ids) for ids, _ in rows) / len(rows):.0f}, max {longest} ({time.perf_counter() - started:.0f}s)")

    model = build_model(tokenizer, args)
    model.generation_config = GenerationConfig(do_sample=False, max_new_tokens=48,
                                               eos_token_id=tokenizer.eos_token_id,
                                               pad_token_id=tokenizer.pad_token_id)
    parameters = sum(p.numel() for p in model.parameters())
    print(f"model: {parameters:,} parameters")

    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01, betas=(0.9, 0.98))
    # Linear warmup, then cosine decay to a tenth: the last steps settle the copying instead of jittering it.
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: min(
        (step + 1) / args.warmup_steps,
        0.1 + 0.45 * (1 + torch.cos(torch.tensor(torch.pi * step / args.steps)).item())))
    order = torch.randperm(len(rows), generator=torch.Generator().manual_seed(args.seed)).tolist()
    model.train()
    losses = []
    deadline = None if args.max_minutes is None else time.perf_counter() + 60 * args.max_minutes
    for step in range(1, args.steps + 1):
        if deadline is not None and time.perf_counter() > deadline:
            step -= 1
            print(f"stopped by --max-minutes after {step} steps")
            break
        start = (step - 1) * args.batch_size % (len(order) - args.batch_size + 1)
        batch = batch_tensors([rows[index] for index in order[start : start + args.batch_size]],
                              tokenizer.pad_token_id)
        losses.append(train_step(model, batch, optimizer, schedule))
        if step % args.log_every == 0:
            recent = sum(losses[-args.log_every:]) / args.log_every
            print(f"step {step:5d}  loss {recent:.4f}  ({time.perf_counter() - started:.0f}s)", flush=True)
    training_seconds = time.perf_counter() - started

    model.eval()
    held_out = {}
    for task in (arithmetic, lookup):
        agent = AgentConfig.for_task(task, max_new_tokens=48, max_turns=4, tool_format="tags")
        result = evaluate(model, tokenizer, task, task.examples("validation", args.eval_size),
                          tools=tools[task.name], agent_config=agent, batch_size=50, progress=False)
        held_out[task.name] = {"validation_questions": result.n_examples, "accuracy": result.accuracy,
                               "tool_use_rate": result.tool_use_rate}
        print(f"{task.name}: held-out accuracy {result.accuracy:.3f}, tool use {result.tool_use_rate:.3f}")

    summary = {key: value for key, value in vars(args).items() if key != "out"}
    summary.update(steps_taken=step, parameters=parameters, transcripts=len(rows),
                   final_loss=sum(losses[-100:]) / len(losses[-100:]),
                   training_seconds=round(training_seconds), held_out=held_out)
    save(model, tokenizer, args.out, summary)
    print(f"saved to {args.out} ({time.perf_counter() - started:.0f}s in all)")


if __name__ == "__main__":
    main()

"""vLLM rollouts on 1 rank vs 2: aggregate generated tokens/s of one batched greedy generation when the batch is
split across ranks, each rank running its own in-process engine (vLLM's external-launcher mode inside a gloo
world, as `copes-run --workers 2 --rollout-engine vllm` runs it), against one engine generating the whole batch.

Same random Qwen3 (built locally, saved once), same prompts, every row generating exactly --new-tokens (EOS
ignored is not needed: a random model's greedy rows rarely stop; the tokens each row did generate are counted).
Per rank count it reports the best of --repeats rounds after a warm-up: the batch's generated tokens / the slowest
rank's seconds. On CPU the ranks share the machine's cores (--threads each), so the ratio shows how well the
split uses them; on N GPUs each rank has a device of its own.

    python bench/vllm_ranks.py                               # CPU, 1 thread per rank
    python bench/vllm_ranks.py --device cuda --threads 0     # one GPU per rank

Needs vLLM (pip install -e ".[vllm]"). Prints one line per rank count and the ratio.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))


def build_model(folder: Path, hidden: int, layers: int) -> Path:
    from helpers.tiny_models import build_tiny_tokenizer, tiny_qwen3

    tokenizer = build_tiny_tokenizer(folder)
    tiny_qwen3(tokenizer, head_dim=32, hidden_size=hidden, intermediate_size=4 * hidden, num_hidden_layers=layers,
               num_attention_heads=hidden // 32, num_key_value_heads=max(1, hidden // 128)).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def prompts(count: int) -> list[str]:
    return [f"Question {i}: what is {i} plus {2 * i + 1}? Think step by step." for i in range(count)]


def measure(args: argparse.Namespace) -> None:
    """One rank's part (under torch.distributed.run, or alone): generate its share, report tokens and seconds."""
    import torch.distributed as dist

    from copes.rollout.vllm.engine import VLLMEngine
    from copes.run.distributed import init_distributed, members_for_rank

    context = init_distributed(args.device)
    rank, world = (context.rank, context.world_size) if context else (0, 1)
    engine = VLLMEngine(args.model, device=str(context.device) if context else args.device, cpu_threads=args.threads,
                        kv_cache_gib=args.kv_cache_gib, cpu_weights="packed")
    mine = [prompts(args.prompts)[i] for i in members_for_rank(args.prompts, rank, world)]
    best = None
    for _ in range(args.repeats + 1):  # the first round warms up
        if context:
            dist.barrier()
        started = time.perf_counter()
        rows = engine.generate(engine.tokenizer, mine, max_new_tokens=args.new_tokens)
        seconds = time.perf_counter() - started
        totals = torch.tensor([float(sum(row.num_tokens for row in rows)), seconds], dtype=torch.float64)
        if context:
            tokens = totals[:1].clone()
            dist.all_reduce(tokens)
            slowest = totals[1:].clone()
            dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
            totals = torch.cat((tokens, slowest))
        rate = float(totals[0] / totals[1])
        best = rate if best is None else max(best, rate)
    if rank == 0:
        print(json.dumps({"ranks": world, "tokens_per_s": round(best, 1)}), flush=True)


def run_ranks(ranks: int, args: argparse.Namespace, model: str) -> float:
    own = [__file__, "--measure", "--model", model, "--device", args.device, "--threads",
           str(args.threads), "--prompts", str(args.prompts), "--new-tokens", str(args.new_tokens), "--repeats",
           str(args.repeats), "--kv-cache-gib", str(args.kv_cache_gib)]
    launcher = [sys.executable] if ranks == 1 else [sys.executable, "-m", "torch.distributed.run", "--standalone",
                                                    "--nproc-per-node", str(ranks)]
    env = {**os.environ, "OMP_NUM_THREADS": str(max(args.threads, 1))}
    done = subprocess.run([*launcher, *own], capture_output=True, text=True, env=env, check=False)
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode or not lines:
        raise SystemExit(f"{ranks} rank(s) failed:\n{done.stderr[-3000:]}")
    return json.loads(lines[-1])["tokens_per_s"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per rank on CPU (0: torch's default)")
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--kv-cache-gib", type=float, default=0.25)
    parser.add_argument("--model", default=None, help="a local model folder (default: a random Qwen3 built here)")
    parser.add_argument("--measure", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.measure:
        measure(args)
        return
    with tempfile.TemporaryDirectory() as scratch:
        model = args.model or str(build_model(Path(scratch), args.hidden, args.layers))
        one, two = run_ranks(1, args, model), run_ranks(2, args, model)
    print(f"1 rank: {one} tokens/s")
    print(f"2 ranks: {two} tokens/s")
    print(f"2 ranks / 1 rank: {two / one:.2f}x")


if __name__ == "__main__":
    main()

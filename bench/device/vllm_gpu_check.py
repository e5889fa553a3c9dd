"""The vLLM engine's device check: perturb -> generate -> restore -> generate, bitwise, with CUDA graphs on, and
the decode speed with CUDA graphs on vs off (eager), measured in the same run.

CUDA graphs capture kernel launches with the weights' addresses baked in. ES writes the weights in place (perturb,
restore and update never move storage), so a captured graph must read the written values: the check fails if the
perturbed generation equals the base one (the graph ran stale weights) or if the restored generation differs from
the base by a single token.

    python bench/device/vllm_gpu_check.py --model <folder>              # a local model; default: a random tiny Qwen3
    python bench/device/vllm_gpu_check.py --device cpu                   # the same check on vLLM-CPU (eager)

`check_perturb_restore(engine, ...)` and `lora_canaries(model, ...)` are what the GPU check script calls; they
return results and raise on a mismatch (AssertionError) or an adapter vLLM drops or computes as NaN (UserError).
Prints one `key: value` line per result.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))

PROMPTS = ["What is 12 plus 7?", "Name a prime number.", "Spell the word cat backwards.", "Count: one, two,"]


def check_perturb_restore(engine: Any, tokenizer: Any, *, sigma: float = 0.05, new_tokens: int = 16) -> dict[str, Any]:
    """Base, perturbed and restored greedy generations on `engine` (a copes VLLMEngine); asserts the perturbed
    one differs and the restored one is the base bit for bit (tokens, and every weight's bytes)."""
    from copes.es.params import ParameterSpace

    def rollout() -> list:
        engine.start_rollout()
        return engine.generate(tokenizer, PROMPTS, max_new_tokens=new_tokens)

    weights = {name: tensor.clone() for name, tensor in engine.model.named_parameters()}
    base = rollout()
    space = ParameterSpace(engine.model, chunk_size=1 << 16)
    space.perturb(space.partition(seed=11, num_subspaces=1), seed=11, member=0, subspace=0, sigma=sigma)
    try:
        perturbed = rollout()
    finally:
        space.restore()
    restored = rollout()
    assert perturbed != base, "the perturbed generation equals the base one: the engine ran stale weights"
    assert restored == base, "the restored generation differs from the base one"
    for name, tensor in engine.model.named_parameters():
        assert torch.equal(tensor.view(-1).view(torch.uint8), weights[name].view(-1).view(torch.uint8)), name
    return {"perturb_restore_bitwise": True, "cuda_graphs": not engine.llm.llm_engine.model_config.enforce_eager}


def decode_tokens_per_second(engine: Any, tokenizer: Any, *, new_tokens: int, repeats: int = 3) -> float:
    """Best-of-`repeats` generated tokens per second of one batched greedy generation (no weight write between)."""
    best = 0.0
    for _ in range(repeats + 1):  # the first round warms up
        engine.start_rollout()
        started = time.perf_counter()
        rows = engine.generate(tokenizer, PROMPTS, max_new_tokens=new_tokens)
        seconds = time.perf_counter() - started
        best = max(best, sum(len(row.token_ids) for row in rows) / seconds)
    return best


def tiny_model(folder: Path) -> Path:
    from helpers.tiny_models import build_tiny_tokenizer, tiny_qwen3

    tokenizer = build_tiny_tokenizer(folder)
    tiny_qwen3(tokenizer, head_dim=32).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def lora_canaries(model: str, *, device: str, dtype: str, kv_cache_gib: float) -> dict[int, float]:
    """EGGROLL's members as vLLM LoRA adapters on `model` (a Qwen3.5: gated delta-net layers): each member's largest
    log-probability difference from the base on a 512-token prompt (VLLMEngine.lora_canary, which raises on a NaN or
    an adapter vLLM leaves at zero: open vLLM LoRA bugs on Hopper past ~128 tokens and on gated delta-net layers)."""
    from copes.es.strategies import EGGROLL
    from copes.rollout.engine import engine_for, load_rollout_model
    from copes.rollout.vllm.lora import LoRASlots, tied_embeddings

    views, _, _ = load_rollout_model(model, engine="vllm", device=device, dtype=dtype, kv_cache_gib=kv_cache_gib,
                                     vllm_cpu_weights="plain", lora=LoRASlots(3, 2))
    tied = tied_embeddings(views, "EGGROLL", notice=False)  # no adapter can carry a tied embedding
    strategy = EGGROLL(views, population=3, sigma=0.5, rank=2, seed=3, exclude=[*tied, "lm_head.weight"])
    engine, seen = engine_for(views), {}

    def fitness(_: torch.nn.Module, row_members: Any) -> torch.Tensor:
        with row_members(torch.tensor([0, 1, 2])) as routing:
            seen.update(engine.lora_canary(routing, prompt_tokens=512))
        return torch.zeros(strategy.population)

    strategy.evaluate(fitness)
    return {member: round(difference, 4) for member, difference in seen.items()}


def run(model: str, *, device: str, dtype: str, kv_cache_gib: float, new_tokens: int) -> dict[str, Any]:
    """The check with CUDA graphs (on CUDA), then decode tokens/s with graphs on and off, in one process."""
    from copes.rollout.vllm.engine import VLLMEngine

    results: dict[str, Any] = {}
    for graphs in (True, False) if device != "cpu" else (False,):
        engine = VLLMEngine(model, device=device, dtype=dtype, kv_cache_gib=kv_cache_gib, cuda_graphs=graphs,
                            cpu_weights="plain")
        label = "graphs" if graphs else "eager"
        if graphs or device == "cpu":
            results.update(check_perturb_restore(engine, engine.tokenizer))
        results[f"decode_tokens_per_s_{label}"] = round(decode_tokens_per_second(engine, engine.tokenizer,
                                                                                 new_tokens=new_tokens), 1)
        del engine
    if "decode_tokens_per_s_graphs" in results:
        speedup = results["decode_tokens_per_s_graphs"] / results["decode_tokens_per_s_eager"]
        results["graphs_speedup"] = round(speedup, 2)
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="a local model folder (default: a random tiny Qwen3)")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--kv-cache-gib", type=float, default=1.0)
    parser.add_argument("--new-tokens", type=int, default=64)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as scratch:
        model = args.model or str(tiny_model(Path(scratch)))
        results = run(model, device=args.device, dtype=args.dtype, kv_cache_gib=args.kv_cache_gib,
                      new_tokens=args.new_tokens)
    for key, value in results.items():
        print(f"{key}: {value}")


if __name__ == "__main__":
    main()

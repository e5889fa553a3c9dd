"""EGGROLL's population on vLLM as LoRA adapters (copes.rollout.vllm.lora) against plain vLLM inference and
against the HF EGGROLL path: the "fraction of inference" the EGGROLL paper reports (91% there, on GPUs).

Same random ~100M-parameter Qwen3 (bench/rollout_engines.py's model, built locally), same P members x Q prompts
of random tokens, each row generating exactly --new-tokens greedy tokens (EOS ignored), same torch threads:

  vllm            a vLLM engine without LoRA, the P x Q requests in one generate call: plain inference
  vllm-lora-off   the LoRA-enabled engine, the same requests without adapters (what enabling LoRA costs)
  vllm-lora       the LoRA-enabled engine, each request with its member's adapter, all P members in one call
                  (inside an EGGROLL evaluation: the adapters are this step's; built once, then reused)
  hf-eggroll      copes' HF engine under `row_members`: every linear a base GEMM plus a rank-r term per row

tokens/s is P x Q x new tokens over the best of --repeats rounds (the contenders alternating each round, after
a warm-up). `adapters_s` is the first generate call of a fresh step's noise minus a warm one: building P
adapters from the contract and loading them into the engine, once per step; `ratio_with_adapters` charges it
to one generate call. Goal on CPU: vllm-lora >= 0.7 of vllm; on a GPU >= 0.9.

    OMP_NUM_THREADS=1 python bench/vllm_eggroll_throughput.py --members 4 --prompts 8 --new-tokens 32

Needs vLLM (pip install -e ".[vllm]"). Writes results/vllm_eggroll_throughput_<device>.csv.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
from rollout_engines import MODEL_SHAPE, build_model_folder, random_tokens
from transformers import Qwen3Config

import copes
from copes.modeling import load_model
from copes.rollout.engine import HFEngine, engine_for, load_rollout_model
from copes.rollout.vllm.lora import LoRASlots

from common.harness import add_engine_timing_arguments, alternating_best_seconds, machine_note, report

GOAL_CPU, GOAL_GPU = 0.7, 0.9


def vllm_generate(views: torch.nn.Module, prompts: list[list[int]], new_tokens: int,
                  adapters: list | None = None) -> None:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(max_tokens=new_tokens, min_tokens=new_tokens, ignore_eos=True, temperature=0.0,
                            detokenize=False)
    engine_for(views).llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], [params] * len(prompts),
                                   lora_request=adapters, use_tqdm=False)


def in_evaluation(strategy: copes.EGGROLL, body: Callable[[Callable], None]) -> None:
    """Run `body(row_members)` inside one EGGROLL evaluation (where row_members is valid); weights unchanged."""
    def fitness(model: torch.nn.Module, row_members: Callable) -> list[float]:
        body(row_members)
        return [0.0] * strategy.population

    strategy.evaluate(fitness)
    strategy.apply_update(torch.zeros(strategy.population))  # equal rewards: the step ends, the weights stay


def measure(folder: Path, args: argparse.Namespace) -> list[dict[str, object]]:
    vocab = Qwen3Config.from_pretrained(folder).vocab_size
    P, Q = args.members, args.prompts
    prompts = random_tokens([args.prompt_tokens] * Q, vocab) * P  # member-major: row b is member b // Q
    member_of_row = torch.arange(P).repeat_interleave(Q)
    common = dict(engine="vllm", device="cpu", dtype=args.dtype, cpu_threads=args.threads,
                  kv_cache_gib=args.kv_cache_gib)
    plain, _, _ = load_rollout_model(str(folder), **common)
    lora, _, _ = load_rollout_model(str(folder), **common, lora=LoRASlots(P, args.rank))
    hf, _, _ = load_model(str(folder), device="cpu", dtype=args.dtype)
    torch.set_num_threads(args.threads)
    exclude = ["model.embed_tokens.weight"]  # the same targets on both (the tied embedding has no LoRA form)
    on_vllm = copes.EGGROLL(lora, population=P, sigma=1e-3, rank=args.rank, exclude=exclude)
    on_hf = copes.EGGROLL(hf, population=P, sigma=1e-3, rank=args.rank, exclude=exclude)
    adapters = engine_for(lora).adapters
    seconds: dict[str, float] = {}

    def timed_lora(row_members: Callable) -> None:
        with row_members(member_of_row) as routing:
            start = time.perf_counter()
            vllm_generate(lora, prompts, args.new_tokens, adapters.requests(routing, len(prompts)))  # builds them
            seconds["first"] = time.perf_counter() - start
            requests = adapters.requests(routing, len(prompts))
            assert len({r.lora_int_id for r in requests}) == P
            seconds.update(alternating_best_seconds({
                "vllm": lambda: vllm_generate(plain, prompts, args.new_tokens),
                "vllm-lora-off": lambda: vllm_generate(lora, prompts, args.new_tokens),
                "vllm-lora": lambda: vllm_generate(lora, prompts, args.new_tokens, requests),
            }, args.repeats))

    def timed_hf(row_members: Callable) -> None:
        engine = HFEngine(hf, row_caches=False)
        context = lambda rows: row_members(member_of_row[rows])  # noqa: E731
        seconds.update(alternating_best_seconds({
            "hf-eggroll": lambda: engine.generate_ids(prompts, [args.new_tokens] * len(prompts), eos=set(),
                                                      row_context=context)}, args.repeats))

    in_evaluation(on_vllm, timed_lora)
    in_evaluation(on_hf, timed_hf)
    tokens = P * Q * args.new_tokens
    adapters_s = max(seconds["first"] - seconds["vllm-lora"], 0.0)
    goal = GOAL_GPU if torch.cuda.is_available() else GOAL_CPU
    return [{
        "dtype": args.dtype, "engine": name, "members": P, "prompts": Q, "rank": args.rank, "threads": args.threads,
        "tokens": tokens, "tokens_per_s": tokens / seconds[name], "vs_vllm": seconds["vllm"] / seconds[name],
        "adapters_s": adapters_s if name == "vllm-lora" else None,
        "ratio_with_adapters": seconds["vllm"] / (seconds[name] + adapters_s) if name == "vllm-lora" else None,
        "goal": (f">= {goal}: " + ("met" if seconds["vllm"] / seconds[name] >= goal else "not met"))
        if name == "vllm-lora" else "",
    } for name in ("vllm", "vllm-lora-off", "vllm-lora", "hf-eggroll")]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--members", type=int, default=4, help="P: members, one adapter each")
    parser.add_argument("--prompts", type=int, default=8, help="Q: prompts per member")
    parser.add_argument("--prompt-tokens", type=int, default=32, help="tokens per prompt")
    parser.add_argument("--new-tokens", type=int, default=32, help="greedy tokens generated per row")
    parser.add_argument("--rank", type=int, default=1, help="EGGROLL rank r")
    parser.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    add_engine_timing_arguments(parser, kv_cache_help="each vLLM engine's KV cache")
    args = parser.parse_args()
    started = time.perf_counter()
    with tempfile.TemporaryDirectory() as folder:
        parameters = build_model_folder(Path(folder), MODEL_SHAPE)
        rows = measure(Path(folder), args)
    report("vllm_eggroll_throughput", rows,
           f"EGGROLL rank-{args.rank} population as vLLM LoRA adapters vs plain vLLM vs HF EGGROLL, random Qwen3 of "
           f"{parameters / 1e6:.1f}M parameters; {machine_note()}; {time.perf_counter() - started:.0f}s")


if __name__ == "__main__":  # vLLM may start worker processes: keep module import side-effect free
    main()

"""Do the members of a vLLM population generate something other than the base model? One engine, one check per
algorithm, on any checkpoint (the dress rehearsal runs it on the random bf16 Qwen3.5-4B in the wrapper layout):

  base     greedy tokens of --prompts prompts of --prompt-tokens random token ids, the weights untouched
  copes    member 0 of a CoPES population (K = 4): its perturbation of one subspace, at sigma x sqrt(K), written in
           place into the engine's weights
           (ParameterSpace, as copes-run does), the same prompts, then restored; the base tokens must come back
  eggroll  every member of an EGGROLL population as a LoRA adapter (copes.rollout.vllm.lora), all in one generate
           call, and the LoRA canary (finite logits that differ from the base's on a 512-token prompt)

Prints, per member, whether its tokens differ from the base's, and the canary's largest |log-prob difference|.

    PYTHONPATH=$PWD python bench/vllm_members_vs_base.py --model /work/4b --members 2 --new-tokens 8

Needs vLLM (pip install -e ".[vllm]").
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import time
from collections.abc import Callable

import torch

from copes.es.params import ParameterSpace
from copes.es.strategies import EGGROLL
from copes.rollout.engine import engine_for, load_rollout_model
from copes.rollout.vllm.lora import LoRASlots, tied_embeddings

SUBSPACES = 4


def greedy_tokens(views: torch.nn.Module, prompts: list[list[int]], new_tokens: int,
                  row_context: Callable | None = None) -> list[list[int]]:
    """Greedy token ids of every prompt (exactly `new_tokens`, EOS ignored), with each row's member adapter when
    `row_context` routes rows."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    engine = engine_for(views)
    engine.start_rollout()
    params = SamplingParams(max_tokens=new_tokens, min_tokens=new_tokens, ignore_eos=True, temperature=0.0)
    with (row_context(list(range(len(prompts)))) if row_context else contextlib.nullcontext()) as routing:
        adapters = engine._member_adapters(routing, len(prompts))
        outputs = engine.llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], [params] * len(prompts),
                                      lora_request=adapters, use_tqdm=False)
    return [list(output.outputs[0].token_ids) for output in outputs]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True)
    parser.add_argument("--members", type=int, default=2)
    parser.add_argument("--prompts", type=int, default=1)
    parser.add_argument("--prompt-tokens", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=8)
    parser.add_argument("--sigma", type=float, default=0.02)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--kv-cache-gib", type=float, default=1.0)
    args = parser.parse_args()

    started = time.perf_counter()
    views, tokenizer, _ = load_rollout_model(args.model, engine="vllm", dtype="bfloat16", cpu_threads=args.threads,
                                             kv_cache_gib=args.kv_cache_gib, vllm_cpu_weights="plain",
                                             lora=LoRASlots(args.members, 1))
    result: dict = {"load_s": round(time.perf_counter() - started, 1)}
    generator = torch.Generator().manual_seed(0)
    vocab = len(tokenizer)
    prompts = [torch.randint(0, vocab, (args.prompt_tokens,), generator=generator).tolist()
               for _ in range(args.prompts)]
    base = greedy_tokens(views, prompts, args.new_tokens)

    space = ParameterSpace(views, chunk_size=65536)
    # The headline's K: the member's restore backup is one subspace (1/K of the weights), as in copes-run.
    space.perturb(space.partition(seed=1, num_subspaces=SUBSPACES), seed=1, member=0, subspace=0,
                  sigma=args.sigma * math.sqrt(SUBSPACES))
    try:
        copes_member = greedy_tokens(views, prompts, args.new_tokens)
    finally:
        space.restore()
    result["copes_member_differs"] = copes_member != base
    result["copes_restored_equals_base"] = greedy_tokens(views, prompts, args.new_tokens) == base

    strategy = EGGROLL(views, population=args.members, sigma=args.sigma, rank=1, seed=1,
                       exclude=tied_embeddings(views, "eggroll", notice=False) or None)

    def fitness(model: torch.nn.Module, row_members: Callable) -> list[float]:
        members = torch.arange(args.members).repeat_interleave(args.prompts)

        def rows(keys: list[int]):  # every member on every prompt, one generate call
            return row_members(members)

        tokens = greedy_tokens(views, prompts * args.members, args.new_tokens, rows)
        result["eggroll_members_differ"] = [tokens[m * args.prompts:(m + 1) * args.prompts] != base
                                            for m in range(args.members)]
        with row_members(torch.arange(args.members)) as routing:
            result["eggroll_canary"] = engine_for(views).lora_canary(routing)
        return [0.0] * args.members

    strategy.evaluate(fitness)
    result["total_s"] = round(time.perf_counter() - started, 1)
    print(json.dumps(result))


if __name__ == "__main__":
    main()

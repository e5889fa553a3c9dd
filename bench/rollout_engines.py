"""Rollout engines side by side: Hugging Face `generate` (the baseline: what copes ran before it had an HF engine
of its own), copes' HF engine (copes.rollout.hf_engine: per-row prefill, finished rows leave the batch), the same
engine's static decode (hf-engine-static: what it runs on CUDA, there replayed as CUDA graphs; on a CPU every row
stays in every forward, the whole store attended to, the host reading tokens every 16 steps) and vLLM
(weights perturbed in place inside the engine), vLLM with plain linear weights (F.linear, as HF) and with packed ones
(vLLM's oneDNN copies, repacked after each weight change).

Same model on every engine: a random ~100M-parameter Qwen3 (built locally, saved once), or with --model a real
one (a folder, a GGUF file or a downloadable model's name, e.g. smollm2-135m-instruct: its dense folder, converted
once per machine); same prompts, same lengths (every row generates exactly its number of greedy tokens: EOS is
ignored on every engine, and the prompts' tokens are random ids, as speed does not depend on them), same torch
threads. Three workloads (--workloads):

  uniform      --prompts prompts of --prompt-tokens random tokens, each row generating --new-tokens: vLLM's
               least favourable case, as no row ends before another
  gsm8k        the shape of a real step's batch: the first --prompts GSM8K test problems, row i's prompt as long
               as its question and its generation as long as its reference solution (at 4 characters per token,
               the usual BPE rate; the tokens themselves are random, the model being random). Rows end at
               different lengths, as greedy rows end at EOS: HF `generate` keeps computing a finished row until
               the batch's longest ends; copes' HF engine and vLLM drop it and batch the rest
  gsm8k-2turn  gsm8k, then a second turn as after a tool call: each row's context is its prompt, its first turn's
               tokens and a 32-token observation, and it generates its length again. HF `generate` re-sends
               (and prefills) the whole context; copes' HF engine ends the first turn as on a stop string, keeps
               the rows' caches and prefills only the observation

Per dtype and workload it reports, best of --repeats rounds after a warm-up, the engines alternating each round:

  tokens/s     the batch's generated tokens (the rows' own lengths summed, over every turn) / seconds of one
               batched greedy generation (weights unchanged since the last one: no repack); vs_hf_tokens and
               vs_hf_engine_tokens: the engine's speed over hf's and hf-engine's (eager decode)
  floor        the memory-bandwidth floor: the tokens/s of an engine that only reads the weights, once per decode
               step for every row still generating (the longest row's steps, per turn), at this machine's
               memory-copy bandwidth; vs_floor: the engine's tokens/s over it (KV-cache reads and compute not
               counted, so a real engine stays below 1)
  step s       one CoPES step (--population members, each: perturb, roll out the batch, restore; then the
               update), and inside it the seconds of perturb + restore, which vLLM pays on its own storage, and
               of the packed engine's repacks (one per member: its weights changed since the last rollout)

The reward of a member is the mean id of its generated tokens: continuous, so every step really updates.

    python bench/rollout_engines.py                  # fp32 and bf16, both workloads, 1 thread
    python bench/rollout_engines.py --threads 2 --dtypes float32 --workloads uniform
    python bench/rollout_engines.py --engines        # no vLLM: HF generate vs copes' HF engine only
    python bench/rollout_engines.py --model smollm2-135m-instruct --dtypes float32   # a real model (cached)

Needs vLLM for the vllm engines (pip install -e ".[vllm]", see the README) and GSM8K in ../shared/data (or
$COPES_DATA_DIR) for the gsm8k workload. Writes results/rollout_engines_<device>.csv.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import AutoConfig, GenerationConfig, Qwen3Config, Qwen3ForCausalLM

import copes
from copes.modeling import EMBEDDED_MODEL_DIR, load_model, model_folder
from copes.rollout.engine import HFEngine, engine_for, load_rollout_model
from copes.tasks import get_task

from common.harness import (
    GiB,
    add_engine_timing_arguments,
    alternating_best_seconds,
    machine_note,
    memcpy_gib_per_s,
    report,
)

ModelShape = dict[str, int]
# ~100M parameters in the decoder; the vocabulary is the embedded tiny tokenizer's (vLLM detokenizes with it).
MODEL_SHAPE: ModelShape = dict(hidden_size=768, intermediate_size=3072, num_hidden_layers=12, num_attention_heads=12,
                               num_key_value_heads=2, head_dim=64)
VLLM_ENGINES = ("vllm-plain", "vllm-packed")
WORKLOADS = ("uniform", "gsm8k", "gsm8k-2turn")
OBSERVATION_TOKENS = 32  # a tool result and its markup, between the two turns of gsm8k-2turn


def build_model_folder(folder: Path, shape: ModelShape) -> int:
    """A random Qwen3 with the embedded tokenizer, saved as a checkpoint folder; returns its parameter count."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(EMBEDDED_MODEL_DIR)
    config = Qwen3Config(vocab_size=len(tokenizer), max_position_embeddings=4096, tie_word_embeddings=True,
                         pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id, **shape)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = Qwen3ForCausalLM(config)
    model.generation_config = GenerationConfig(eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return sum(p.numel() for p in model.parameters())


@dataclass(frozen=True)
class Workload:
    """A batch of prompts (token ids) and the number of tokens each row generates, on every engine."""

    name: str
    prompts: list[list[int]]
    new_tokens: list[int]  # per row, in each turn
    observations: list[list[int]] | None = None  # a second turn: prompt + first turn's tokens + observation

    @property
    def turns(self) -> int:
        return 1 if self.observations is None else 2

    def second_prompts(self, first: list[torch.Tensor]) -> list[list[int]]:
        return [prompt + generated.tolist() + observation
                for prompt, generated, observation in zip(self.prompts, first, self.observations)]


def random_tokens(lengths: list[int], vocab_size: int) -> list[list[int]]:
    generator = torch.Generator().manual_seed(0)
    return [torch.randint(2, vocab_size, (length,), generator=generator).tolist() for length in lengths]


# ~4 characters per token: the usual rate of a BPE tokenizer on English text (the bench model's own vocabulary
# is the 17-symbol tiny tokenizer's, so lengths are taken from the text, not from tokenizing it).
CHARACTERS_PER_TOKEN = 4


def build_workload(name: str, args: argparse.Namespace, vocab_size: int) -> Workload:
    if name == "uniform":
        return Workload(name, random_tokens([args.prompt_tokens] * args.prompts, vocab_size),
                        [args.new_tokens] * args.prompts)
    problems = get_task("gsm8k").examples("test")[: args.prompts]
    prompt_lengths = [max(1, len(problem.question) // CHARACTERS_PER_TOKEN) for problem in problems]
    solution_lengths = [max(1, len(problem.meta["answer"]) // CHARACTERS_PER_TOKEN) for problem in problems]
    observations = None
    if name == "gsm8k-2turn":
        observations = random_tokens([OBSERVATION_TOKENS] * len(problems), vocab_size)[::-1]  # not the prompts
    return Workload(name, random_tokens(prompt_lengths, vocab_size), solution_lengths, observations)


def both_turns(generate: Callable[[list[list[int]], list[int]], list[torch.Tensor]],
               workload: Workload) -> list[torch.Tensor]:
    """Each row's tokens of every turn, one after the other (`generate`: prompts, lengths -> new tokens)."""
    first = generate(workload.prompts, workload.new_tokens)
    if workload.observations is None:
        return first
    second = generate(workload.second_prompts(first), workload.new_tokens)
    return [torch.cat(pair) for pair in zip(first, second)]


def hf_generate(model: torch.nn.Module, prompts: list[list[int]], lengths: list[int]) -> list[torch.Tensor]:
    # Left padding and a mask, as copes' HF engine batches prompts of different lengths. Every row runs to the
    # longest row's length (what `generate` computes for rows that ended at EOS too) and is cut to its own. A
    # second turn re-sends each row's whole context.
    width = max(len(prompt) for prompt in prompts)
    ids = torch.tensor([[0] * (width - len(prompt)) + prompt for prompt in prompts])
    mask = torch.tensor([[0] * (width - len(prompt)) + [1] * len(prompt) for prompt in prompts])
    longest = max(lengths)
    config = GenerationConfig(max_new_tokens=longest, min_new_tokens=longest, do_sample=False, pad_token_id=0,
                              eos_token_id=model.generation_config.eos_token_id)
    with torch.inference_mode():
        sequences = model.generate(input_ids=ids, attention_mask=mask, generation_config=config)
    return [row[width:width + length] for row, length in zip(sequences, lengths)]


def hf_rollout(model: torch.nn.Module, workload: Workload) -> list[torch.Tensor]:
    return both_turns(lambda prompts, lengths: hf_generate(model, prompts, lengths), workload)


def hf_engine_rollout(model: torch.nn.Module, workload: Workload, decode: str = "eager") -> list[torch.Tensor]:
    # No EOS: every row generates exactly its length, as on the other engines. Before a second turn a row ends as
    # on a tool call (a stop string: the engine keeps its cache), so that turn prefills only the observation.
    engine = HFEngine(model, decode=decode)
    engine.start_rollout()
    two_turns = workload.observations is not None

    def generate(prompts: list[list[int]], lengths: list[int]) -> list[torch.Tensor]:
        targets = {tuple(prompt): length for prompt, length in zip(prompts, lengths)}
        rule = (lambda ids, new: len(new) >= targets[tuple(ids)]) if two_turns else None
        new_ids = engine.generate_ids(prompts, lengths, eos=set(), ends_on_stop=rule, keys=list(range(len(prompts))),
                                      remember=two_turns)
        return [torch.tensor(ids) for ids in new_ids]

    return both_turns(generate, workload)


def vllm_rollout(model: torch.nn.Module, workload: Workload) -> list[torch.Tensor]:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    engine = engine_for(model)
    engine.start_rollout()
    engine.repack_changed_weights()

    def generate(prompts: list[list[int]], lengths: list[int]) -> list[torch.Tensor]:
        params = [SamplingParams(max_tokens=length, min_tokens=length, ignore_eos=True, temperature=0.0,
                                 detokenize=False) for length in lengths]
        outputs = engine.llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
        return [torch.tensor(output.outputs[0].token_ids) for output in outputs]

    return both_turns(generate, workload)


Rollout = Callable[[torch.nn.Module, Workload], list[torch.Tensor]]


def repack_seconds(model: torch.nn.Module) -> float:
    """The packed vLLM engine's repack seconds so far (0 for the engines that keep no packed copies)."""
    packed = getattr(engine_for(model), "packed_weights", None)
    return packed.repack_seconds if packed is not None else 0.0


def copes_step(model: torch.nn.Module, rollout: Rollout, workload: Workload, population: int,
               phases: dict[str, float]) -> None:
    """One CoPES step on `model`; keeps in `phases` the fewest perturb + restore and repack seconds of a step."""
    es = copes.CoPES(model, population=population, num_subspaces=2, sigma=1e-3, lr=5e-4, seed=0)
    repacked_before = repack_seconds(model)
    stats = es.step(lambda m: torch.cat(rollout(m, workload)).float().mean().item())
    step_phases = {"perturb_restore": stats.perturb_seconds + stats.restore_seconds,
                   "repack": repack_seconds(model) - repacked_before}
    for phase, seconds in step_phases.items():
        phases[phase] = min(phases.get(phase, float("inf")), seconds)


def floor_tokens_per_s(model: torch.nn.Module, workload: Workload, bandwidth: float) -> float:
    """The workload's tokens/s if generating cost only the weights' reads: one read of every weight (tied ones
    once) per decode step serves every row still generating, and a turn takes its longest row's steps."""
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    decode_steps = max(workload.new_tokens) * workload.turns
    return sum(workload.new_tokens) * workload.turns / (decode_steps * weight_bytes / bandwidth)


def measure(folder: Path, dtype: str, args: argparse.Namespace, vocab_size: int,
            bandwidth: float) -> list[dict[str, object]]:
    hf_model, _, _ = load_model(str(folder), device="cpu", dtype=dtype)
    engines: dict[str, tuple[torch.nn.Module, Rollout]] = {
        "hf": (hf_model, hf_rollout), "hf-engine": (hf_model, hf_engine_rollout),
        "hf-engine-static": (hf_model, lambda model, workload: hf_engine_rollout(model, workload, decode="static"))}
    for weights in [engine.removeprefix("vllm-") for engine in args.engines]:
        views, _, _ = load_rollout_model(str(folder), engine="vllm", device="cpu", dtype=dtype,
                                         cpu_threads=args.threads, kv_cache_gib=args.kv_cache_gib,
                                         vllm_cpu_weights=weights)
        engines[f"vllm-{weights}"] = (views, vllm_rollout)
    torch.set_num_threads(args.threads)
    rows = []
    for workload in [build_workload(name, args, vocab_size) for name in args.workloads]:
        baseline = hf_rollout(hf_model, workload)  # the rows each engine must reproduce (greedy, EOS ignored)
        same_rows = {name: sum(torch.equal(a, b) for a, b in zip(baseline, rollout(model, workload)))
                     for name, (model, rollout) in engines.items()}
        generate = alternating_best_seconds(
            {name: (lambda m=m, r=r, w=workload: r(m, w)) for name, (m, r) in engines.items()}, args.repeats,
            clock=time.thread_time if args.cpu_clock else time.perf_counter)
        phases: dict[str, dict[str, float]] = {name: {"perturb_restore": None, "repack": None} for name in engines}
        step = dict.fromkeys(engines) if args.no_step else alternating_best_seconds(
            {name: (lambda m=m, r=r, w=workload, p=phases[name]: copes_step(m, r, w, args.population, p))
             for name, (m, r) in engines.items()}, args.repeats)
        floor = floor_tokens_per_s(hf_model, workload, bandwidth)
        for name in engines:
            tokens_per_s = sum(workload.new_tokens) * workload.turns / generate[name]
            rows.append({
                "dtype": dtype, "workload": workload.name, "engine": name, "threads": args.threads,
                "prompts": len(workload.prompts), "turns": workload.turns,
                "generated_tokens": sum(workload.new_tokens) * workload.turns, "longest": max(workload.new_tokens),
                "tokens_per_s": tokens_per_s,
                "vs_hf_tokens": generate["hf"] / generate[name],
                "vs_hf_engine_tokens": generate["hf-engine"] / generate[name],
                "floor_tokens_per_s": floor, "vs_floor": tokens_per_s / floor, "step_s": step[name],
                "vs_hf_step": None if args.no_step else step["hf"] / step[name],
                "perturb_restore_s": phases[name]["perturb_restore"],
                "repack_s": phases[name]["repack"], "rows_equal_to_hf": same_rows[name],
            })
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", help="a real model (folder, GGUF file or downloadable name) instead of the "
                        "random ~100M-parameter Qwen3")
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"], choices=["float32", "bfloat16"])
    parser.add_argument("--engines", nargs="*", default=list(VLLM_ENGINES), choices=VLLM_ENGINES,
                        help="the vLLM engines measured beside hf and hf-engine (none: HF only)")
    parser.add_argument("--workloads", nargs="+", default=list(WORKLOADS), choices=WORKLOADS,
                        help="uniform: every row the same lengths; gsm8k: GSM8K's ragged lengths")
    parser.add_argument("--prompts", type=int, default=64, help="prompts per batch")
    parser.add_argument("--prompt-tokens", type=int, default=32, help="tokens per prompt (uniform workload)")
    # A real step is generation-bound (GSM8K answers run to hundreds of tokens after a ~100-token prompt): at 32
    # new tokens half of the timed work would be the prompts' prefill.
    parser.add_argument("--new-tokens", type=int, default=128,
                        help="greedy tokens generated per prompt (uniform workload)")
    parser.add_argument("--population", type=int, default=2, help="members of the timed CoPES step (K=2)")
    parser.add_argument("--no-step", action="store_true", help="time generation only, not the CoPES step")
    parser.add_argument("--cpu-clock", action="store_true",
                        help="time generation by this thread's CPU time (a crowded machine, --threads 1, no vLLM)")
    add_engine_timing_arguments(parser, kv_cache_help="the vLLM engine's KV cache")
    args = parser.parse_args(argv)
    started = time.perf_counter()
    with tempfile.TemporaryDirectory() as scratch:
        if args.model:
            folder = Path(model_folder(args.model))
            config = AutoConfig.from_pretrained(folder)
            what = f"{args.model} ({config.model_type})"
        else:
            folder = Path(scratch)
            parameters = build_model_folder(folder, MODEL_SHAPE)
            config, what = Qwen3Config.from_pretrained(folder), f"random Qwen3 of {parameters / 1e6:.1f}M parameters"
        bandwidth = memcpy_gib_per_s() * GiB  # once: the same floor for every dtype's weights
        rows = [row for dtype in args.dtypes for row in measure(folder, dtype, args, config.vocab_size, bandwidth)]
    name = "rollout_engines" + (f"_{Path(args.model).stem.lower()}" if args.model else "")
    report(name, rows, f"hf vs {', '.join(['hf-engine', 'hf-engine-static', *args.engines])} rollouts, {what}; "
                       f"{machine_note()}; {time.perf_counter() - started:.0f}s")


if __name__ == "__main__":  # vLLM may start worker processes: keep module import side-effect free
    main()

"""The prepared GPU check's phases (bench/gpu_check.sh runs each in its own process, under its own timeout).

    python bench/device/gpu_check.py PHASE --work DIR [--cpu-dry-run]

Each phase writes DIR/PHASE.json (what it measured) and prints its one summary line last; a check that fails
makes the exit status 1 (measurements are printed, never asserted). Phases:
  kernels     kernels_tests without the CPU-only suites (compiled CPU backend, numba cache, lowering), through
              kernels_tests/count_compiles.py, its output streamed to the log as it runs; torch / triton / GPU
              versions and each compiled kernel's registers and spills, read from the cubins the tests compiled
              (compiled once: nothing is lowered again)
  shapes      a random-init Qwen3.5-4B-shaped bf16 model: perturb + restore bitwise in every restore mode
              (subtract: the drift, reported), multi-tensor == per-tensor launches for a member and an update,
              member and update times, peak memory, and the weights checksum's peak
  generation  Hugging Face `generate` on 64 ragged left-padded rows at L = 1K/2K/4K, 2 turns (turn 2 re-sends
              the whole context, as the agent does): peak memory and tokens/s per (L, turn); an OOM fails it
  rollout     the HF engine at Qwen3.5-4B's shape, the plan's rows on long synthetic contexts (a kept turn, then
              a last turn that keeps nothing), the card capped at 24 GiB less the CUDA context: allocated,
              reserved and mem_get_info peaks beside the plan (no checkpoint, no sandbox: no model code runs)
  speed       bf16 at the 4B shape: ms per decode step and tokens/s at 1 row and at the planned rows for each
              engine here (copes' HF engine: "hf eager", finished rows leaving the batch, and "hf graphs", its
              static decode replayed as CUDA graphs, what auto runs on CUDA; vLLM when carried), each beside the
              memory-bandwidth floor (weight bytes / peak bandwidth), and the wall time of one headline step
              (40 x 64 x 600 tokens) they imply
  trainer     copes.train on the device: 2 steps twice (same weights?) and 1 step + resume to 2 (bitwise?)
`--cpu-dry-run` runs the same code on the CPU at small shapes (tiny configs, short L), so CI keeps it working.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import platform
import re
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "bench"))  # bench/common/, when this file runs as a script

from common.models import parameter_count, weight_bytes  # noqa: E402

GiB = 2**30
NOT_RUN = 3  # the exit status of a phase that had nothing to run here (gpu_check.sh reports "not run")

# Qwen3.5-4B's text model, read from the config fixture the memory plan is tested on (tests/fixtures/qwen3.5-4b,
# shapes from the public model card): 32 layers (every 4th full attention, 4 KV heads of 256; the others gated
# delta-net), hidden 2560, MLP 9216, a 248,320-token vocabulary, tied embeddings.
_QWEN35_4B_CONFIG = json.loads((REPO / "tests" / "fixtures" / "qwen3.5-4b"
                                / "config.json").read_text())
QWEN35_4B = {key: _QWEN35_4B_CONFIG["text_config"][key] for key in (
    "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
    "linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim", "linear_value_head_dim", "vocab_size",
)} | {"tie_word_embeddings": _QWEN35_4B_CONFIG["tie_word_embeddings"]}
# The same architecture at a width the CPU runs in seconds: one full-attention layer after three delta-net ones.
QWEN35_TINY = dict(
    hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
    head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
    vocab_size=512, tie_word_embeddings=True,
)


@dataclass(frozen=True)
class Sizes:
    """What a phase runs at: the real shapes on a GPU, small ones in the CPU dry run."""

    device: str
    model: dict[str, int | bool]
    population: int
    subspaces: int
    timed_members: int
    rows: int
    lengths: tuple[int, ...]
    new_tokens: int
    observation_tokens: int
    kernel_tests: tuple[str, ...]
    long_observation: int  # the rollout phase's tool result: long enough to reach the plan's kept-copy peak
    decode_context: int  # the speed phase's prompt tokens per row
    decode_steps: int


GPU = Sizes("cuda", QWEN35_4B, population=40, subspaces=4, timed_members=5, rows=64, lengths=(1024, 2048, 4096),
            new_tokens=32, observation_tokens=128,
            kernel_tests=("kernels_tests", "--ignore=kernels_tests/test_cpu_backend.py",
                          "--ignore=kernels_tests/test_numba_cache.py", "--ignore=kernels_tests/test_lowering.py"),
            long_observation=15_400, decode_context=1024, decode_steps=64)
CPU_DRY_RUN = Sizes("cpu", QWEN35_TINY, population=8, subspaces=2, timed_members=2, rows=4, lengths=(32, 64),
                    new_tokens=4, observation_tokens=8,
                    kernel_tests=("kernels_tests/test_partition.py", "kernels_tests/test_errors.py",
                                  "-k", "partition or triton"),
                    long_observation=200, decode_context=32, decode_steps=6)
HEADLINE_STEP_TOKENS = 40 * 64 * 600  # one GSM8K step of the paper's shape: members x prompts x ~600 tokens
# Peak DRAM bandwidth by card name (the vendors' data sheets), for the decode floor; other cards: a measured copy.
PEAK_BANDWIDTH_GBS = {"H200": 4800, "H100 SXM": 3350, "H100 80GB HBM3": 3350, "H100 PCIe": 2000, "H100 NVL": 3900,
                      "A100-SXM4-80GB": 2039, "A100 80GB PCIe": 1935, "A100-SXM4-40GB": 1555, "L40S": 864,
                      "RTX 4090": 1008, "RTX 3090": 936, "A10": 600, "L4": 300}


# ---------------------------------------------------------------- measuring


def synchronize(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def reset_peak(device: str) -> int:
    """Starts a peak window; returns the bytes allocated now (the window's baseline). CPU: 0 (not tracked)."""
    if device != "cuda":
        return 0
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    return torch.cuda.memory_allocated()


def peak_gib(device: str, baseline: int = 0) -> float | None:
    """The window's peak above `baseline`, in GiB (None on the CPU, where torch tracks no peak)."""
    if device != "cuda":
        return None
    torch.cuda.synchronize()
    return round((torch.cuda.max_memory_allocated() - baseline) / GiB, 3)


def shown_gib(value: float | None) -> str:
    return "n/a (CPU)" if value is None else f"{value} GiB"


def seconds(device: str, work: Callable[[], Any]) -> float:
    synchronize(device)
    start = time.perf_counter()
    work()
    synchronize(device)
    return time.perf_counter() - start


# ---------------------------------------------------------------- phase: kernels


def versions(device: str) -> dict[str, str]:
    import transformers
    import triton

    found = {"python": platform.python_version(), "torch": torch.__version__, "triton": triton.__version__,
             "transformers": transformers.__version__,
             **linear_attention_kernels()}
    if device == "cuda":
        major, minor = torch.cuda.get_device_capability()
        found.update(gpu=torch.cuda.get_device_name(), arch=f"sm_{major}{minor}", cuda=str(torch.version.cuda))
    return found


def linear_attention_kernels() -> dict[str, str]:
    """Whether flash-linear-attention and causal-conv1d are importable, and so which path Qwen3.5's gated delta-net
    layers run here: the fused CUDA kernels, or transformers' pure-torch fallback (a bare image may lack both)."""
    fla, conv = (importlib.util.find_spec(name) is not None for name in ("fla", "causal_conv1d"))
    return {"fla": "present" if fla else "absent", "causal_conv1d": "present" if conv else "absent",
            "delta_rule_path": "fla kernels" if fla else "torch fallback (chunk_gated_delta_rule in torch)",
            "conv1d_path": "causal-conv1d kernels" if conv else "torch fallback (F.conv1d)"}


def streamed(command: list[str], env: dict[str, str]) -> tuple[int, str]:
    """Run `command`, printing its output line by line as it comes (a timeout still leaves the log); returns its
    exit status and last non-empty line."""
    last = "no output"
    with subprocess.Popen(command, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          text=True, bufsize=1) as process:
        for line in process.stdout:
            print(line, end="", flush=True)
            last = line.strip() or last
    return process.returncode, last


def compiled_resources(cache: Path) -> list[str]:
    """Registers, stack and spills of every cubin the tests compiled into `cache` (kernels_tests/lower_kernels.py's
    cuobjdump reading), so nothing is compiled a second time."""
    from kernels_tests.lower_kernels import resource_usage

    return [f"{cubin.stem}: {resource_usage(cubin.read_bytes()) or 'no cuobjdump'}"
            for cubin in sorted(cache.rglob("*.cubin"))]


def kernels(sizes: Sizes) -> dict[str, Any]:
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="gpu-check-triton-") as cache:
        env = {**os.environ, "TRITON_CACHE_DIR": cache}
        command = [sys.executable, "-m", "kernels_tests.count_compiles", "-q", "-p", "no:cacheprovider", "-m", "",
                   "-rs", *sizes.kernel_tests]
        returncode, tail = streamed(command, env)
        resources = compiled_resources(Path(cache))
    print("\n".join(resources) or "no cubin compiled (a CPU dry run interprets the kernels)")
    spills = [line for line in resources if re.search(r"LOCAL:[1-9]", line)]
    found = versions(sizes.device)
    return {"ok": returncode == 0, "versions": found, "pytest": tail,
            "pytest_seconds": round(time.perf_counter() - started, 1), "resources": resources, "spilling": spills,
            "summary": f"{tail} | {len(resources)} cubins, {len(spills)} spilling | "
                       + " ".join(f"{k}={v}" for k, v in found.items())}


# ---------------------------------------------------------------- phase: shapes


def qwen35_model(sizes: Sizes) -> torch.nn.Module:
    """A random-init bf16 Qwen3.5-shaped causal LM built straight on the device from a config (no download; at
    4B, bench/common/models.py's CPU build in fp32 and move would take 16 GB of host memory and a minute)."""
    from transformers import AutoModelForCausalLM, Qwen3_5TextConfig

    config = Qwen3_5TextConfig(**sizes.model)
    torch.manual_seed(0)
    with torch.device(sizes.device):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    return model.eval()


def weights(model: torch.nn.Module) -> list[torch.Tensor]:
    return [p.detach() for p in model.parameters()]


def snapshot(model: torch.nn.Module) -> list[torch.Tensor]:
    return [w.clone() for w in weights(model)]


def differing_elements(model: torch.nn.Module, reference: list[torch.Tensor]) -> int:
    return sum(int((w != r).sum()) for w, r in zip(weights(model), reference))


def load(model: torch.nn.Module, values: list[torch.Tensor]) -> None:
    with torch.no_grad():
        for w, v in zip(weights(model), values):
            w.copy_(v)


def update_members(sizes: Sizes) -> dict[str, Any]:
    """One step's update arguments: every member, antithetic-looking coefficients, members spread over subspaces."""
    members = list(range(sizes.population))
    return {"members": members, "coeffs": [(-1.0) ** m * 1e-4 for m in members],
            "member_subspaces": [m % sizes.subspaces for m in members]}


def restore_modes(model: torch.nn.Module, sizes: Sizes, reference: list[torch.Tensor]) -> dict[str, Any]:
    """Per restore mode: ms per member (perturb + restore), the member's peak above the weights, and whether the
    weights come back bit for bit (subtract: how many elements drifted)."""
    import warnings

    from copes.choices import RESTORE_MODES
    from copes.es.params import ParameterSpace

    found = {}
    for mode in RESTORE_MODES:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # subtract's inexactness is what this measures
            space = ParameterSpace(model, restore=mode)
        partition = space.partition(seed=1, num_subspaces=sizes.subspaces)

        def member(index: int, space=space, partition=partition) -> None:
            space.perturb(partition, seed=1, member=index, subspace=index % sizes.subspaces, sigma=2e-3)
            space.restore()

        member(0)  # warm-up: compiles, run tables, host buffers
        load(model, reference)
        baseline = reset_peak(sizes.device)
        took = seconds(sizes.device, lambda: [member(m) for m in range(1, sizes.timed_members + 1)])
        drift = differing_elements(model, reference)
        found[mode] = {"ms_per_member": round(1000 * took / sizes.timed_members, 2),
                       "peak_gib_above_weights": peak_gib(sizes.device, baseline), "differing_elements": drift,
                       "bitwise": drift == 0}
        load(model, reference)
    return found


def multi_vs_per_tensor(model: torch.nn.Module, sizes: Sizes, reference: list[torch.Tensor]) -> dict[str, Any]:
    """A member's perturbation and a step's update through the multi-tensor launches and the per-tensor loop, from
    the same weights: equal bit for bit? With each path's update time."""
    from copes.es.params import ParameterSpace

    results: dict[str, list[torch.Tensor]] = {}
    found: dict[str, Any] = {}
    for multi in (True, False):
        name = "multi" if multi else "per_tensor"
        space = ParameterSpace(model, multi_tensor=multi)
        partition = space.partition(seed=2, num_subspaces=sizes.subspaces)
        space.perturb(partition, seed=2, member=3, subspace=1, sigma=2e-3)
        results[f"perturbed_{name}"] = snapshot(model)
        space.restore()
        space.apply_update(partition, seed=2, members=[0], coeffs=[0.0], member_subspaces=[0])  # warm-up, no change
        baseline = reset_peak(sizes.device)
        took = seconds(sizes.device, lambda space=space, partition=partition:
                       space.apply_update(partition, seed=2, **update_members(sizes)))
        found[f"update_ms_{name}"] = round(1000 * took, 1)
        found[f"update_peak_gib_{name}"] = peak_gib(sizes.device, baseline)
        results[f"updated_{name}"] = snapshot(model)
        load(model, reference)
    for what in ("perturbed", "updated"):
        pairs = zip(results[f"{what}_multi"], results[f"{what}_per_tensor"])
        found[f"{what}_equal"] = all(torch.equal(a, b) for a, b in pairs)
    return found


def checksum_peak(model: torch.nn.Module, sizes: Sizes) -> dict[str, Any]:
    from copes.run.distributed import weights_checksum

    baseline = reset_peak(sizes.device)
    took = seconds(sizes.device, lambda: weights_checksum(model))
    return {"checksum_seconds": round(took, 3), "checksum_peak_gib": peak_gib(sizes.device, baseline)}


def shapes(sizes: Sizes) -> dict[str, Any]:
    model = qwen35_model(sizes)
    reference = snapshot(model)
    modes = restore_modes(model, sizes, reference)
    launches = multi_vs_per_tensor(model, sizes, reference)
    found = {"parameters": parameter_count(model), "weights_gib": round(weight_bytes(model) / GiB, 3),
             "restore": modes, **launches, **checksum_peak(model, sizes),
             "peak_gib_total": peak_gib(sizes.device)}
    exact = all(modes[m]["bitwise"] for m in ("device", "host"))
    found["ok"] = exact and launches["perturbed_equal"] and launches["updated_equal"]
    times = " ".join(f"{m}:{v['ms_per_member']}ms" for m, v in modes.items())
    found["summary"] = (f"{found['parameters'] / 1e6:.1f}M params {found['weights_gib']} GiB; restore bitwise "
                        f"device={modes['device']['bitwise']} host={modes['host']['bitwise']} subtract drift="
                        f"{modes['subtract']['differing_elements']}; "
                        f"multi==per-tensor perturb={launches['perturbed_equal']} "
                        f"update={launches['updated_equal']}; member {times}; update {launches['update_ms_multi']}ms; "
                        f"checksum peak {shown_gib(found['checksum_peak_gib'])}")
    return found


# ---------------------------------------------------------------- phase: generation


def ragged_left_padded(rows: int, length: int, vocab: int,
                       generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Token rows of lengths drawn from [length/2, length], left-padded to `length` (pad id 0, mask 0)."""
    lengths = torch.randint(length // 2, length + 1, (rows,), generator=generator)
    ids = torch.randint(1, vocab, (rows, length), generator=generator)
    mask = (torch.arange(length) >= (length - lengths)[:, None]).long()
    return ids * mask, mask


def generate_turn(model: torch.nn.Module, ids: torch.Tensor, mask: torch.Tensor, sizes: Sizes) -> dict[str, Any]:
    baseline = reset_peak(sizes.device)
    ids, mask = ids.to(sizes.device), mask.to(sizes.device)
    started = time.perf_counter()
    try:
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=sizes.new_tokens,
                             min_new_tokens=sizes.new_tokens, do_sample=False, pad_token_id=0)
    except torch.OutOfMemoryError as error:
        return {"oom": str(error).splitlines()[0], "peak_gib_above_weights": peak_gib(sizes.device, baseline)}
    synchronize(sizes.device)
    took = time.perf_counter() - started
    generated = out.shape[1] - ids.shape[1]
    return {"sequences": out.cpu(), "seconds": round(took, 2), "context": int(mask.sum()),
            "tokens_per_s": round(ids.shape[0] * generated / took, 1),
            "peak_gib_above_weights": peak_gib(sizes.device, baseline)}


def generation(sizes: Sizes) -> dict[str, Any]:
    model = qwen35_model(sizes)
    vocab = int(sizes.model["vocab_size"])
    generator = torch.Generator().manual_seed(0)
    runs: dict[str, Any] = {}
    for length in sizes.lengths:
        ids, mask = ragged_left_padded(sizes.rows, length, vocab, generator)
        for turn in (1, 2):
            result = generate_turn(model, ids, mask, sizes)
            runs[f"L{length}_turn{turn}"] = {k: v for k, v in result.items() if k != "sequences"}
            print(f"L={length} turn {turn}: {runs[f'L{length}_turn{turn}']}", flush=True)
            if "oom" in result:
                break
            # The next turn: the whole context again plus an observation, as the agent sends it today.
            observation = torch.randint(1, vocab, (sizes.rows, sizes.observation_tokens), generator=generator)
            ids = torch.cat([result["sequences"], observation], dim=1)
            mask = torch.cat([mask, torch.ones(sizes.rows, ids.shape[1] - mask.shape[1], dtype=mask.dtype)], dim=1)
    line = " ".join(f"{key}:{run.get('tokens_per_s', 'OOM')}tok/s,{shown_gib(run.get('peak_gib_above_weights'))}"
                    for key, run in runs.items())
    fla = "fla present" if importlib.util.find_spec("fla") else "fla absent (torch delta-net path)"
    oom = [key for key, run in runs.items() if "oom" in run]
    return {"ok": not oom, "rows": sizes.rows, "new_tokens": sizes.new_tokens, "runs": runs, "fla": fla,
            "summary": f"{sizes.rows} rows, {sizes.new_tokens} new tokens/turn, {fla}: {line}"}


# ---------------------------------------------------------------- phase: trainer


def final_weights(run_dir: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    latest = (run_dir / "checkpoints" / "latest").read_text().strip()
    return load_file(str(run_dir / "checkpoints" / latest / "model.safetensors"))


def same_weights(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[name], b[name]) for name in a)


def trainer(sizes: Sizes) -> dict[str, Any]:
    import copes

    settings = {"model": "tiny", "device": sizes.device, "population": 4, "subspaces": 2, "prompt_batch": 2,
                "eval_size": 2, "max_new_tokens": 4, "checkpoint_every": 1, "cpu_threads": 1}
    with tempfile.TemporaryDirectory(prefix="gpu-check-trainer-") as folder:
        runs = {name: Path(folder) / name for name in ("first", "second", "resumed")}

        def run(name: str, steps: int, resume: bool = False) -> float:
            config = {**settings, "steps": steps, "output_dir": str(runs[name])}
            return seconds(sizes.device, lambda: copes.train(config, resume=str(runs[name]) if resume else None))

        took = {"first": run("first", 2), "second": run("second", 2)}
        run("resumed", 1)
        took["resume"] = run("resumed", 2, resume=True)
        repeatable = same_weights(final_weights(runs["first"]), final_weights(runs["second"]))
        resumed = same_weights(final_weights(runs["first"]), final_weights(runs["resumed"]))
    return {"ok": resumed, "two_runs_same_weights": repeatable, "resume_bitwise": resumed,
            "seconds": {k: round(v, 1) for k, v in took.items()},
            "summary": f"2 steps twice: same weights {repeatable}; 1 step + resume to 2 bitwise {resumed}; "
                       f"run {took['first']:.1f}s"}


# ---------------------------------------------------------------- phase: rollout


def process_peak_gib() -> float:
    """This process's peak RSS (Linux reports KiB)."""
    import resource

    return round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, 3)


def config_folder(sizes: Sizes, folder: Path) -> Path:
    """The model's config.json alone (what the memory plan reads): the model itself is drawn on the device."""
    from transformers import Qwen3_5TextConfig

    Qwen3_5TextConfig(**sizes.model).save_pretrained(folder)
    return folder


def long_rollout_plan(sizes: Sizes, folder: Path) -> Any:
    """The memory plan of a two-turn tool rollout whose tool result is long: one kept turn, then a last turn, at the
    context the headline reaches (~16K tokens on the GPU). --restore host: no backup, the engine alone is measured."""
    from copes.config.options import build_config
    from copes.plan.memory import plan_for

    settings = {"model": str(folder), "task": "tool-arithmetic", "device": sizes.device, "dtype": "bfloat16",
                "rollout_engine": "hf", "restore": "host", "population": 4, "subspaces": 4, "prompt_batch": sizes.rows,
                "max_turns": 2, "max_new_tokens": sizes.new_tokens, "max_observation_tokens": sizes.long_observation,
                "max_context_tokens": 1 << 20, "device_memory_gib": 24}
    return plan_for(build_config(settings), uses_tools=True)


def cap_at_24_gib_less_context() -> dict[str, int]:
    """Cap this process's allocator where a 24 GiB card would leave it: 24 GiB less the CUDA context this process
    already holds (the card's used memory that the allocator did not reserve)."""
    free, total = torch.cuda.mem_get_info()
    context = total - free - torch.cuda.memory_reserved()
    torch.cuda.set_per_process_memory_fraction(min(1.0, (24 * GiB - context) / total))
    return {"card_bytes": total, "context_bytes": context}


def rollout(sizes: Sizes) -> dict[str, Any]:
    """The HF engine at the plan's rows on synthetic contexts long enough to reach the plan's peaks: every row ends
    its first turn as on a tool call (its cache kept), takes a tool result of `long_observation` tokens, and its last
    turn keeps nothing (keep=False), as the agent runs it. No task, no tools, no checkpoint: the random model's
    text never runs and nothing is exported. On the GPU: allocated, reserved and the card's used memory
    (mem_get_info) at their peaks beside the plan's peak; the dry run: RSS."""
    from copes.plan.memory import PROMPT_TOKENS, TOOL_WRAPPER_TOKENS, plan_json
    from copes.rollout.hf_engine import HFEngine

    capped = sizes.device == "cuda"
    card = cap_at_24_gib_less_context() if capped else {}
    with tempfile.TemporaryDirectory(prefix="gpu-check-rollout-") as scratch:
        plan = long_rollout_plan(sizes, config_folder(sizes, Path(scratch)))
    model = qwen35_model(sizes)
    rows, new = plan.rows, sizes.new_tokens
    generator = torch.Generator().manual_seed(0)
    vocab = int(sizes.model["vocab_size"])
    prompts = torch.randint(1, vocab, (rows, PROMPT_TOKENS), generator=generator).tolist()
    observation = torch.randint(1, vocab, (TOOL_WRAPPER_TOKENS + sizes.long_observation,),
                                generator=generator).tolist()
    engine, keys = HFEngine(model), list(range(rows))
    used_peak, error = 0, None

    def turns() -> None:
        nonlocal used_peak
        engine.start_rollout()
        first = engine.generate_ids(prompts, [new + 1] * rows, eos=set(), keys=keys, remember=True,
                                    ends_on_stop=lambda ids, tokens: len(tokens) >= new)
        if capped:
            used_peak = max(used_peak, card["card_bytes"] - torch.cuda.mem_get_info()[0])
        context = [prompt + tokens + observation for prompt, tokens in zip(prompts, first)]
        engine.generate_ids(context, [new] * rows, eos=set(), keys=keys, remember=False)  # the last turn

    reset_peak(sizes.device)
    try:
        took = seconds(sizes.device, turns)
    except torch.OutOfMemoryError as failure:  # an OOM at the plan's rows is the finding
        took, error = math.nan, f"OutOfMemoryError: {str(failure).splitlines()[0][:300]}"
    planned = round(plan.peak_bytes() / GiB, 3)
    if capped:
        measured = round(torch.cuda.max_memory_allocated() / GiB, 3)
        reserved = round(torch.cuda.max_memory_reserved() / GiB, 3)
        used = round(max(used_peak, card["card_bytes"] - torch.cuda.mem_get_info()[0]) / GiB, 3)
        seen = (f"allocated {measured}, reserved {reserved}, card used {used} GiB "
                f"(context {card['context_bytes'] / GiB:.2f})")
    else:
        measured, reserved, used = process_peak_gib(), None, None
        seen = f"peak RSS {measured} GiB"
    ratio = round(measured / planned, 3)
    over = capped and ratio > 1.0
    summary = (f"{rows} rows (the plan's) x {plan.rollout.context_tokens} tokens, 2 turns: {seen}; planned "
               f"{planned} GiB ({'allocated' if capped else 'RSS'}/planned {ratio}"
               f"{', OVER THE PLAN' if over else ''}); {took:.0f} s"
               + (f"; FAILED: {error}" if error else ""))
    return {"ok": error is None and not over, "rows": rows, "context_tokens": plan.rollout.context_tokens,
            "measured_gib": measured, "reserved_gib": reserved, "card_used_gib": used, **card,
            "planned_gib": planned, "measured_over_planned": ratio, "plan": json.loads(plan_json(plan)),
            "error": error, **linear_attention_kernels(), "summary": summary}


# ---------------------------------------------------------------- phase: speed


def peak_bandwidth_gbs(device: str) -> tuple[float, str]:
    """The memory's peak bandwidth in GB/s and where it came from: the data sheet of a known card, else a measured
    copy of 1 GiB (what the CPU dry run uses)."""
    if device == "cuda":
        name = torch.cuda.get_device_name()
        for card, bandwidth in PEAK_BANDWIDTH_GBS.items():
            if card in name:
                return bandwidth, f"{name} data sheet"
    source = torch.empty(GiB // 4 if device == "cuda" else GiB // 16, dtype=torch.uint8, device=device)
    target = torch.empty_like(source)
    target.copy_(source)  # warm-up
    took = seconds(device, lambda: [target.copy_(source) for _ in range(5)])
    return round(5 * 2 * source.numel() / took / 1e9, 1), "a measured copy"


def hf_engine(model: torch.nn.Module, graphs: bool) -> Any:
    """copes' HF engine as the speed phase times it: "hf eager", or "hf graphs" (the static decode replayed as CUDA
    graphs; on the CPU dry run, which has no graphs, the same static decode)."""
    from copes.rollout.hf_engine import HFEngine

    decode = ("graphs" if model.device.type == "cuda" else "static") if graphs else "eager"
    return HFEngine(model, decode=decode)


def hf_decode(model: torch.nn.Module, sizes: Sizes, rows: int, graphs: bool = False) -> dict[str, Any]:
    """ms per decode step of the HF engine at `rows` rows: two generations from the same prompts that differ only
    in their decode steps, so the prefill (and a graph's capture, once per call) cancels."""
    engine = hf_engine(model, graphs)
    generator = torch.Generator().manual_seed(rows)
    prompts = torch.randint(1, int(sizes.model["vocab_size"]), (rows, sizes.decode_context),
                            generator=generator).tolist()

    def generate(steps: int) -> float:
        engine.start_rollout()
        return seconds(sizes.device, lambda: engine.generate_ids(prompts, [steps] * rows, eos=set()))

    generate(2)  # warm-up
    short, long = generate(2), generate(2 + sizes.decode_steps)
    ms = 1000 * (long - short) / sizes.decode_steps
    return {"ms_per_step": round(ms, 2), "tokens_per_s": round(rows * 1000 / ms, 1)}


def vllm_decode(sizes: Sizes, folder: Path, row_counts: list[int]) -> dict[str, Any]:
    """The same measure on vLLM (CUDA graphs) with dummy weights of the model's shape: no checkpoint is written."""
    import vllm

    llm = vllm.LLM(str(folder), load_format="dummy", skip_tokenizer_init=True, dtype="bfloat16",
                   max_model_len=sizes.decode_context + sizes.decode_steps + 8, gpu_memory_utilization=0.85, seed=0)

    def decode(rows: int) -> dict[str, Any]:
        prompts = [vllm.inputs.TokensPrompt(prompt_token_ids=list(range(1 + row, 1 + row + sizes.decode_context)))
                   for row in range(rows)]

        def generate(steps: int) -> float:
            params = vllm.SamplingParams(max_tokens=steps, temperature=0.0, ignore_eos=True)
            return seconds(sizes.device, lambda: llm.generate(prompts, params, use_tqdm=False))

        generate(2)
        short, long = generate(2), generate(2 + sizes.decode_steps)
        ms = 1000 * (long - short) / sizes.decode_steps
        return {"ms_per_step": round(ms, 2), "tokens_per_s": round(rows * 1000 / ms, 1)}

    return timed_rows("vllm", row_counts, decode)


def timed_rows(engine: str, row_counts: list[int], decode: Callable[[int], dict[str, Any]]) -> dict[str, Any]:
    """`decode(rows)` per row count, each printed as it is measured (a timeout still leaves the figures so far)."""
    found = {}
    for rows in row_counts:
        found[f"{rows} rows"] = decode(rows)
        print(f"{engine}, {rows} rows: {found[f'{rows} rows']}", flush=True)
    return found


def speed(sizes: Sizes) -> dict[str, Any]:
    """Decode speed at the 4B shape in bf16, per engine, at 1 row and at the rows the headline's plan gives (the
    dry run: its tiny model), each beside the floor a decode step cannot beat: reading every weight once (weight
    bytes / peak bandwidth). From the planned rows' tokens/s, one headline step's wall time (decode only)."""
    from copes.config.options import build_config
    from copes.plan.memory import plan_for

    with tempfile.TemporaryDirectory(prefix="gpu-check-speed-") as scratch:
        folder = config_folder(sizes, Path(scratch))
        headline = plan_for(build_config({"model": str(folder), "task": "gsm8k", "device": sizes.device,
                                          "dtype": "bfloat16", "rollout_engine": "hf", "population": 40,
                                          "subspaces": 4, "prompt_batch": sizes.rows, "device_memory_gib": 24}),
                            uses_tools=True)
        row_counts = sorted({1, max(headline.rows, 1)})
        model = qwen35_model(sizes)
        bandwidth, source = peak_bandwidth_gbs(sizes.device)
        weights_bytes = weight_bytes(model)
        floor_ms = weights_bytes / (bandwidth * 1e9) * 1000
        print(f"floor {floor_ms:.3f} ms per decode step ({weights_bytes / GiB:.2f} GiB / {bandwidth} GB/s, {source})",
              flush=True)
        engines: dict[str, Any] = {"hf eager": timed_rows("hf eager", row_counts,
                                                          lambda rows: hf_decode(model, sizes, rows))}
        try:  # after the eager figures are in the log: a capture that fails is reported, not fatal
            engines["hf graphs"] = timed_rows("hf graphs", row_counts,
                                              lambda rows: hf_decode(model, sizes, rows, graphs=True))
        except Exception as failure:
            engines["hf graphs"] = f"failed: {type(failure).__name__}: {str(failure).splitlines()[0][:200]}"
        if sizes.device == "cuda" and importlib.util.find_spec("vllm") is not None:
            del model
            torch.cuda.empty_cache()
            try:
                engines["vllm"] = vllm_decode(sizes, folder, row_counts)
            except Exception as failure:  # reported, not fatal: the HF figures stand alone
                engines["vllm"] = f"failed: {type(failure).__name__}: {str(failure).splitlines()[0][:200]}"
        else:
            engines["vllm"] = "not installed here (its wheels are not carried)"
    for measured in engines.values():
        for run in measured.values() if isinstance(measured, dict) else ():
            run["over_floor"] = round(run["ms_per_step"] / floor_ms, 1)
    planned = f"{row_counts[-1]} rows"
    step_hours = {name: round(HEADLINE_STEP_TOKENS / measured[planned]["tokens_per_s"] / 3600, 2)
                  for name, measured in engines.items() if isinstance(measured, dict)}
    shown = "; ".join(f"{name}: " + ", ".join(f"{rows} {run['ms_per_step']} ms/step {run['tokens_per_s']} tok/s "
                                              f"{run['over_floor']}x floor" for rows, run in measured.items())
                      for name, measured in engines.items() if isinstance(measured, dict))
    estimate = ", ".join(f"{name} {hours} h" for name, hours in step_hours.items())
    return {"ok": True, "floor_ms": round(floor_ms, 3), "bandwidth_gbs": bandwidth, "bandwidth_source": source,
            "weight_gib": round(weights_bytes / GiB, 3), "rows": row_counts, "engines": engines,
            "headline_step_hours": step_hours,
            "summary": f"floor {floor_ms:.2f} ms/step (weights / {bandwidth} GB/s, {source}); {shown}; one headline "
                       f"step ({HEADLINE_STEP_TOKENS:,} tokens, decode only): {estimate}"}


# ---------------------------------------------------------------- entry point

def vllm(sizes: Sizes) -> dict[str, Any]:
    """bench/device/vllm_gpu_check.py on the device: bitwise perturb -> generate -> restore -> generate inside vLLM,
    decode tokens/s with CUDA graphs on and off, and the LoRA canaries of EGGROLL's members on a reduced Qwen3.5.
    Reported "not run" (never "passed") where vLLM is not installed:
    a bare device image has none, so this phase needs vLLM's wheels carried. Not part of the CPU dry run (CI's main
    suite has no vLLM; the vLLM suite runs the same check on CPU)."""
    if sizes.device != "cuda" or importlib.util.find_spec("vllm") is None:
        return {"ok": True, "not_run": True, "summary": "vllm is not installed here (or a CPU dry run)"}
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    sys.path.insert(0, str(REPO / "tests"))  # tiny_models, for its random model
    import vllm_gpu_check

    from common.rehearsal_model import REDUCED_TEXT, build_rehearsal_model

    with tempfile.TemporaryDirectory() as scratch:
        found = vllm_gpu_check.run(str(vllm_gpu_check.tiny_model(Path(scratch) / "qwen3")), device="cuda",
                                   dtype="auto", kv_cache_gib=1.0, new_tokens=64)
        qwen35 = build_rehearsal_model(Path(scratch) / "qwen3.5", text_overrides=REDUCED_TEXT)
        found["lora_canary"] = vllm_gpu_check.lora_canaries(str(qwen35), device="cuda", dtype="bfloat16",
                                                            kv_cache_gib=1.0)
    found["ok"] = found["perturb_restore_bitwise"]  # a mismatch or a dead adapter raises inside: the phase fails
    found["summary"] = ", ".join(f"{k} {v}" for k, v in found.items() if k not in ("ok",))
    return found


PHASES: dict[str, Callable[[Sizes], dict[str, Any]]] = {
    "kernels": kernels, "shapes": shapes, "rollout": rollout, "speed": speed, "generation": generation,
    "trainer": trainer, "vllm": vllm,
}


def without_tensors(found: Any) -> Any:
    if isinstance(found, dict):
        return {k: without_tensors(v) for k, v in found.items() if not isinstance(v, torch.Tensor)}
    return found


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("phase", choices=sorted(PHASES))
    parser.add_argument("--work", type=Path, required=True, help="folder for PHASE.json")
    parser.add_argument("--cpu-dry-run", action="store_true", help="the same logic on the CPU at small shapes")
    args = parser.parse_args(argv)
    sizes = CPU_DRY_RUN if args.cpu_dry_run else GPU
    if sizes.device == "cuda" and not torch.cuda.is_available():
        print("FAILED: no CUDA device visible to torch (use --cpu-dry-run on a CPU machine)")
        return 1
    if args.cpu_dry_run:
        torch.set_num_threads(1)  # tiny shapes on a shared CPU: threads cost more than they give
    found = PHASES[args.phase](sizes)
    args.work.mkdir(parents=True, exist_ok=True)
    (args.work / f"{args.phase}.json").write_text(json.dumps(without_tensors(found), indent=1, default=str))
    print(("" if found["ok"] else "FAILED: ") + found["summary"])
    if found.get("not_run"):
        return NOT_RUN
    return 0 if found["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())

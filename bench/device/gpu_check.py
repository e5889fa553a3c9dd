"""The prepared GPU check's phases (bench/gpu_check.sh runs each in its own process, under its own timeout).

    python bench/device/gpu_check.py PHASE --work DIR [--cpu-dry-run]

Each phase writes DIR/PHASE.json (what it measured) and prints its one summary line last; a check that fails
makes the exit status 1 (measurements are printed, never asserted). Phases:
  kernels     kernels_tests without the CPU-backend and lowering suites; torch / triton / GPU versions and the
              kernels' SASS counts for this GPU (kernels_tests/lower_kernels.py), printed
  shapes      a random-init Qwen3.5-4B-shaped bf16 model: perturb + restore bitwise in every restore mode
              (subtract: the drift, reported), multi-tensor == per-tensor launches for a member and an update,
              member and update times, peak memory, and the weights checksum's peak
  generation  Hugging Face `generate` on 64 ragged left-padded rows at L = 1K/2K/4K, 2 turns (turn 2 re-sends
              the whole context, as the agent does): peak memory and tokens/s per (L, turn)
  rollout     copes.train's HF engine on a tool rollout at Qwen3.5-4B's shape, the card capped at 24 GiB: the
              measured peak beside the memory plan's for the same run (and which delta-net path ran)
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


GPU = Sizes("cuda", QWEN35_4B, population=40, subspaces=4, timed_members=5, rows=64, lengths=(1024, 2048, 4096),
            new_tokens=32, observation_tokens=128,
            kernel_tests=("kernels_tests", "--ignore=kernels_tests/test_cpu_backend.py",
                          "--ignore=kernels_tests/test_lowering.py"))
CPU_DRY_RUN = Sizes("cpu", QWEN35_TINY, population=8, subspaces=2, timed_members=2, rows=4, lengths=(32, 64),
                    new_tokens=4, observation_tokens=8,
                    kernel_tests=("kernels_tests/test_partition.py", "kernels_tests/test_errors.py",
                                  "-k", "partition or triton"))


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


def sass_counts(device: str, timeout_s: float) -> list[str]:
    """kernels_tests/lower_kernels.py's line per kernel for this GPU (registers, spills, SASS counts)."""
    if device != "cuda":
        return ["no CUDA device: nothing compiled, no SASS to count"]
    major, minor = torch.cuda.get_device_capability()
    command = [sys.executable, "-m", "kernels_tests.lower_kernels", "--arch", f"{major}{minor}"]
    try:
        lowered = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired as expired:
        printed = expired.stdout or b""  # bytes, even with text=True
        printed = printed.decode() if isinstance(printed, bytes) else printed
        return [*printed.splitlines(), f"SASS counts: timed out after {timeout_s:.0f}s"]
    return (lowered.stdout + lowered.stderr).strip().splitlines()


def kernels(sizes: Sizes) -> dict[str, Any]:
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "", "-rs", *sizes.kernel_tests]
    started = time.perf_counter()
    tests = subprocess.run(command, cwd=REPO, capture_output=True, text=True)
    print(tests.stdout[-6000:], tests.stderr[-2000:], sep="\n")
    # The SASS counts get what is left of the phase's limit (gpu_check.sh passes it), less 10 s for the summary.
    left = float(os.environ.get("GPU_CHECK_PHASE_LIMIT_S", "190")) - (time.perf_counter() - started) - 10
    counts = (sass_counts(sizes.device, timeout_s=left) if left > 20
              else ["SASS counts skipped: the tests used the phase's time"])
    print("\n".join(counts))
    tail = tests.stdout.strip().splitlines()[-1] if tests.stdout.strip() else "no pytest output"
    return {"ok": tests.returncode == 0, "versions": versions(sizes.device), "pytest": tail,
            "pytest_seconds": round(time.perf_counter() - started, 1), "sass": counts,
            "summary": f"{tail} | " + " ".join(f"{k}={v}" for k, v in versions(sizes.device).items())}


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
    return {"ok": True, "rows": sizes.rows, "new_tokens": sizes.new_tokens, "runs": runs, "fla": fla,
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


def rollout(sizes: Sizes) -> dict[str, Any]:
    """The HF engine on a tool rollout at Qwen3.5-4B's shape with the card capped at 24 GiB: one CoPES step of
    `copes.train` (tool-arithmetic, the Python tool, two turns) on a random model in the released wrapper layout
    (bench/common/rehearsal_model.py, drawn on the device), its measured peak beside `plan_for`'s for the same config,
    so the 24 GB claim is measured the first time a device is lent. The dry run: the reduced width, RSS beside the
    plan."""
    import copes
    from copes.config.options import build_config
    from copes.plan.memory import plan_for, plan_json

    from common.rehearsal_model import REDUCED_TEXT, build_rehearsal_model

    capped = sizes.device == "cuda"
    if capped:  # what a 24 GB card leaves this process (the plan's own reserve is inside the 24 GiB)
        card = torch.cuda.get_device_properties(0).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, 24 * GiB / card))
    with tempfile.TemporaryDirectory(prefix="gpu-check-rollout-") as scratch:
        folder = build_rehearsal_model(Path(scratch) / "model", device=sizes.device,
                                       text_overrides=None if capped else REDUCED_TEXT)
        settings = {"model": str(folder), "task": "tool-arithmetic", "tools": True, "device": sizes.device,
                    "dtype": "bfloat16", "algorithm": "copes", "population": sizes.subspaces,
                    "subspaces": sizes.subspaces, "prompt_batch": sizes.rows, "max_new_tokens": sizes.new_tokens,
                    "max_turns": 2, "steps": 1, "eval_size": 0, "sample_every": 0, "seed": 0, "cpu_threads": 0,
                    "device_memory_gib": 24, "output_dir": str(Path(scratch) / "run")}
        plan = plan_for(build_config(settings))
        baseline = reset_peak(sizes.device)
        error = None
        try:
            took = seconds(sizes.device, lambda: copes.train(settings))
        except Exception as failure:  # an OOM under the cap is the finding, reported
            took, error = math.nan, f"{type(failure).__name__}: {str(failure).splitlines()[0][:300]}"
        metrics = (Path(settings["output_dir"]) / "metrics.jsonl").read_text().splitlines() if error is None else []
    measured = round(torch.cuda.max_memory_allocated() / GiB, 3) if capped else process_peak_gib()
    planned = round(plan.peak_bytes() / GiB, 3)
    ratio = round(measured / planned, 3)
    step = json.loads(metrics[-1]) if metrics else {}
    over = ratio > 1.0
    summary = (f"{plan.rows} rows per call of {settings['prompt_batch']}, {sizes.new_tokens} tokens x 2 turns: "
               f"{'peak allocated' if capped else 'peak RSS'} {measured} GiB, planned {planned} GiB "
               f"(ratio {ratio}{', OVER THE PLAN' if over else ''}); tools {step.get('time', {}).get('tools')} s, "
               f"{took:.0f} s" + (f"; FAILED: {error}" if error else ""))
    return {"ok": error is None and not (capped and over), "capped_gib": 24 if capped else None,
            "measured_gib": measured, "above_weights_at_start_gib": round(baseline / GiB, 3),
            "planned_gib": planned, "measured_over_planned": ratio, "plan": json.loads(plan_json(plan)),
            "step": step, "error": error, **linear_attention_kernels(), "summary": summary}


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
    "kernels": kernels, "shapes": shapes, "rollout": rollout, "generation": generation, "trainer": trainer,
    "vllm": vllm,
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

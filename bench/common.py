"""Shared pieces of the end-to-end benchmarks: the two models, the token workloads, timing, peak-memory
measurement and the table + CSV writer. The kernel microbenchmark's helpers (device, results folder, naive
seeded noise) come from bench_kernels.py.

Models:
  tiny   the embedded default model (`copes.modeling.load_model("tiny")`, Qwen3 architecture, ~640K parameters),
         or any model folder given with --tiny-model.
  large  a random ~100M-parameter Qwen3.5-architecture model (transformers' Qwen3_5ForCausalLM: three gated
         delta-net linear-attention layers per full-attention layer), built locally from a config, never
         downloaded. On CPU transformers runs its pure-torch fallbacks for the linear-attention kernels.
"""

from __future__ import annotations

import argparse
import csv
import ctypes
import re
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from bench_kernels import DEVICE, RESULTS_DIR, device_label
from transformers import GenerationConfig, PreTrainedModel, Qwen3_5ForCausalLM, Qwen3_5TextConfig

from copes.config import TrainConfig, build_config, read_yaml
from copes.modeling import read_preset
from copes.params import ParameterSpace

# Qwen3.5's attention and linear-attention heads are 64 wide; the head counts follow the hidden size.
HEAD_DIM = 64
# glibc's mallopt parameter number for the mmap threshold (malloc.h: M_MMAP_THRESHOLD).
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD_BYTES = 64 * 1024


def pin_one_thread() -> None:
    """One torch thread: on a shared 2-core machine a second thread mostly waits for the other's core, and the
    hand-offs stall small ops (every benchmark here reports ratios measured under this same setting)."""
    torch.set_num_threads(1)


# ---------------------------------------------------------------------------------------------- models


@dataclass(frozen=True)
class LargeModelShape:
    """The random Qwen3.5-architecture model; the defaults give 102M parameters (embeddings tied)."""

    vocab_size: int = 32768
    hidden_size: int = 640
    intermediate_size: int = 2048
    num_layers: int = 12

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")


def large_model_config(shape: LargeModelShape) -> Qwen3_5TextConfig:
    heads = max(1, shape.hidden_size // HEAD_DIM)
    return Qwen3_5TextConfig(
        vocab_size=shape.vocab_size,
        hidden_size=shape.hidden_size,
        intermediate_size=shape.intermediate_size,
        num_hidden_layers=shape.num_layers,
        num_attention_heads=heads,
        num_key_value_heads=2 if heads % 2 == 0 else 1,
        head_dim=HEAD_DIM,
        linear_num_key_heads=heads,
        linear_num_value_heads=2 * heads,
        linear_key_head_dim=HEAD_DIM,
        linear_value_head_dim=HEAD_DIM,
        tie_word_embeddings=True,
        max_position_embeddings=4096,
        pad_token_id=0,
    )


def build_large_model(shape: LargeModelShape, *, seed: int = 0) -> PreTrainedModel:
    """The random Qwen3.5-architecture causal LM on DEVICE (fp32 on CPU, bf16 on CUDA), eval mode, no grads."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Qwen3_5ForCausalLM(large_model_config(shape))
    dtype = torch.bfloat16 if DEVICE.type == "cuda" else torch.float32
    return model.to(DEVICE, dtype).eval().requires_grad_(False)


def parameter_count(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def weight_bytes(model: torch.nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


def add_large_model_arguments(parser: argparse.ArgumentParser) -> None:
    defaults = LargeModelShape()
    group = parser.add_argument_group("large model (random Qwen3.5 architecture)")
    group.add_argument("--vocab-size", type=int, default=defaults.vocab_size, help="vocabulary (embeddings tied)")
    group.add_argument("--hidden-size", type=int, default=defaults.hidden_size, help="model width")
    group.add_argument("--intermediate-size", type=int, default=defaults.intermediate_size, help="MLP width")
    group.add_argument("--layers", type=int, default=defaults.num_layers,
                       help="decoder layers (every 4th attends fully)")


def large_model_shape(args: argparse.Namespace) -> LargeModelShape:
    return LargeModelShape(args.vocab_size, args.hidden_size, args.intermediate_size, args.layers)


PRESET_OPTIONS = ("sigma", "lr", "max_new_tokens")


def add_preset_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags that override the tiny model's preset (copes.yaml in its folder)."""
    group = parser.add_argument_group("tiny model settings (default: the model's own preset)")
    group.add_argument("--sigma", type=float, help="noise scale sigma")
    group.add_argument("--lr", type=float, help="learning rate")
    group.add_argument("--max-new-tokens", type=int, help="tokens generated per answer")


def preset_overrides(args: argparse.Namespace) -> dict[str, Any]:
    return {name: getattr(args, name) for name in PRESET_OPTIONS if getattr(args, name) is not None}


def train_config(model: str, flags: dict[str, Any]) -> TrainConfig:
    """A validated TrainConfig: the model's preset (if it ships one) under `flags`, as copes-run layers them."""
    preset = read_preset(model)
    return build_config(read_yaml(preset) if preset else {}, {"model": model, **flags})


# ---------------------------------------------------------------------------------------------- workloads


def random_prompts(batch: int, length: int, *, vocab_size: int, seed: int = 0) -> torch.Tensor:
    """[batch, length] token ids drawn uniformly from the vocabulary (ids 0 and 1 are left out: pad / EOS in the
    tiny tokenizer), on DEVICE."""
    if batch < 1 or length < 1:
        raise ValueError(f"batch and length must be >= 1, got batch={batch}, length={length}")
    if vocab_size < 3:
        raise ValueError(f"vocab_size must be >= 3, got {vocab_size}")
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(2, vocab_size, (batch, length), generator=generator).to(DEVICE)


def greedy_generate(model: PreTrainedModel, prompts: torch.Tensor, new_tokens: int, **outputs: Any) -> Any:
    """Exactly `new_tokens` greedy tokens for every row (EOS is suppressed until then), so plain and perturbed
    runs always process the same number of tokens. `outputs` are GenerationConfig flags (e.g. output_logits=True)."""
    config = GenerationConfig(
        max_new_tokens=new_tokens,
        min_new_tokens=new_tokens,
        do_sample=False,
        pad_token_id=0,
        eos_token_id=model.generation_config.eos_token_id,
        **outputs,
    )
    with torch.inference_mode():
        return model.generate(input_ids=prompts, attention_mask=torch.ones_like(prompts), generation_config=config)


def greedy_log_likelihood(model: PreTrainedModel, prompts: torch.Tensor, new_tokens: int) -> list[float]:
    """Per prompt: the mean log-probability the model gives its own greedy continuation.

    The reward of the random large model: a random model solves no task, so a task reward would be the same for
    every member and the step would skip its update; this one is continuous, so every step really updates.
    """
    result = greedy_generate(model, prompts, new_tokens, output_logits=True, return_dict_in_generate=True)
    chosen = result.sequences[:, prompts.shape[1] :]
    logits = torch.stack(result.logits, dim=1).float()  # [batch, new_tokens, vocab]
    log_probs = torch.log_softmax(logits, dim=-1).gather(-1, chosen[..., None]).squeeze(-1)
    return log_probs.mean(dim=1).tolist()


# ---------------------------------------------------------------------------------------------- measuring


def synchronize() -> None:
    if DEVICE.type == "cuda":
        torch.cuda.synchronize(DEVICE)


def alternating_best_seconds(runs: dict[str, Callable[[], object]], repeats: int) -> dict[str, float]:
    """Each run's fastest time over `repeats` rounds, after one untimed warm-up round.

    Every round runs all contenders in turn, so a load spike on a shared machine hits them alike, and the
    fastest round is kept because a shared machine only ever adds time.
    """
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    best = dict.fromkeys(runs, float("inf"))
    for round_index in range(repeats + 1):
        for name, run in runs.items():
            synchronize()
            start = time.perf_counter()
            run()
            synchronize()
            if round_index:
                best[name] = min(best[name], time.perf_counter() - start)
    return best


def _proc_status_bytes(field: str) -> int:
    status = Path("/proc/self/status").read_text()
    match = re.search(rf"^{field}:\s+(\d+) kB", status, flags=re.MULTILINE)
    if match is None:
        raise RuntimeError(f"/proc/self/status has no {field} line")
    return int(match.group(1)) * 1024


class PeakMemory:
    """Peak extra memory of a block over what was in use when it began; `held()` is the extra right now.

    CUDA: `torch.cuda.max_memory_allocated` (live tensor bytes, the allocator's own count).
    CPU (Linux): the resident-set high-water mark (VmHWM, reset through /proc/self/clear_refs) over the resident
    size at the start. Two glibc settings make the resident set follow the live tensors: `malloc_trim(0)` first
    returns the free heap pages earlier work left resident (reusing them would not show), and the mmap threshold
    is pinned to 64 KiB, so every tensor buffer is its own mapping and a freed one leaves the resident set at
    once. Pinning is process-wide and makes allocations a little slower: measure time before memory.

        with PeakMemory() as memory:
            work()
        memory.peak_bytes
    """

    _mmap_pinned = False

    def __init__(self) -> None:
        self.peak_bytes = 0
        self._start = 0

    @classmethod
    def _settle_host_allocator(cls) -> None:
        if not sys.platform.startswith("linux"):
            raise RuntimeError("CPU peak-memory measurement needs Linux (/proc/self/clear_refs and glibc)")
        libc = ctypes.CDLL("libc.so.6")
        if not cls._mmap_pinned:
            if libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES) != 1:
                raise RuntimeError("glibc refused mallopt(M_MMAP_THRESHOLD); CPU peak memory cannot be measured")
            cls._mmap_pinned = True
        libc.malloc_trim(0)

    def _current(self) -> int:
        if DEVICE.type == "cuda":
            return torch.cuda.memory_allocated(DEVICE)
        return _proc_status_bytes("VmRSS")

    def __enter__(self) -> PeakMemory:  # noqa: PYI034  (typing.Self needs Python 3.11; setup.py allows 3.10)
        synchronize()
        if DEVICE.type == "cuda":
            torch.cuda.reset_peak_memory_stats(DEVICE)
        else:
            self._settle_host_allocator()
            Path("/proc/self/clear_refs").write_text("5")  # 5: reset the peak resident set size to the current one
        self._start = self._current()
        return self

    def held(self) -> int:
        synchronize()
        if DEVICE.type != "cuda":
            ctypes.CDLL("libc.so.6").malloc_trim(0)  # freed small blocks would otherwise still count as resident
        return self._current() - self._start

    def __exit__(self, *exc_info: object) -> None:
        synchronize()
        peak = torch.cuda.max_memory_allocated(DEVICE) if DEVICE.type == "cuda" else _proc_status_bytes("VmHWM")
        self.peak_bytes = max(peak - self._start, 0)


@dataclass
class RestoreCheck:
    """How far the weights are from their saved copy after a perturb + restore."""

    mismatched: int  # elements that differ
    max_abs_error: float

    @property
    def exact(self) -> bool:
        return self.mismatched == 0


def snapshot(space: ParameterSpace) -> list[torch.Tensor]:
    """A copy of every trainable tensor (to check restores against)."""
    return [param.data.clone() for param in space.parameters]


def compare_weights(space: ParameterSpace, original: Sequence[torch.Tensor]) -> RestoreCheck:
    mismatched, max_error = 0, 0.0
    for param, before in zip(space.parameters, original):
        differs = param.data != before
        if differs.any():
            mismatched += int(differs.sum())
            max_error = max(max_error, float((param.data.float() - before.float()).abs().max()))
    return RestoreCheck(mismatched, max_error)


def reset_weights(space: ParameterSpace, original: Sequence[torch.Tensor]) -> None:
    for param, before in zip(space.parameters, original):
        param.data.copy_(before)


# ---------------------------------------------------------------------------------------------- reporting


def _cell(value: object) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


def report(name: str, rows: Sequence[dict[str, object]], title: str) -> Path:
    """Print `rows` as an aligned table under `title` and write them to bench/results/<name>_<device>.csv."""
    if not rows:
        raise ValueError("rows is empty: nothing to report")
    columns = list(rows[0])
    cells = [[_cell(row[column]) for column in columns] for row in rows]
    widths = [max(len(column), *(len(line[i]) for line in cells)) for i, column in enumerate(columns)]
    print(f"\n{title}")
    print("  ".join(column.rjust(width) for column, width in zip(columns, widths)))
    for line in cells:
        print("  ".join(cell.rjust(width) for cell, width in zip(line, widths)))
    path = write_csv(name, columns, cells)
    print(f"wrote {path}")
    return path


def write_csv(name: str, columns: Sequence[str], lines: Sequence[Sequence[object]]) -> Path:
    """bench/results/<name>_<device>.csv with a header row."""
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    path = RESULTS_DIR / f"{name}_{device_label()}.csv"
    with path.open("w", newline="") as file:
        writer = csv.writer(file)
        writer.writerow(columns)
        writer.writerows(lines)
    return path


def machine_note() -> str:
    """One line naming what the numbers were measured on."""
    if DEVICE.type == "cuda":
        return f"{torch.cuda.get_device_name(DEVICE)}, torch {torch.__version__}"
    load = Path("/proc/loadavg").read_text().split()[0] if Path("/proc/loadavg").exists() else "?"
    return f"CPU, torch {torch.__version__}, {torch.get_num_threads()} torch thread(s), load average {load}"

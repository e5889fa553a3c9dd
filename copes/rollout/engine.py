"""Rollout engines: what generates a batch of chat turns (stop strings, per-row token limits) into `Generation`s.

    auto  vllm on CUDA where vLLM is installed, hf elsewhere (the default)
    hf    the model the trainer holds, on its own forward: each row's cache kept across turns, chunked prefill,
          finished rows dropped (copes.rollout.hf_engine; `generate_batch` is its reference)
    vllm  a vLLM engine that owns the weights; the trainer holds HF-named views of them (copes.rollout.vllm.engine)

Everything above (the agent loop, tools, rewards, evaluation, the strategies) is unchanged: it passes `model`
around as before, and `engine_for(model)` finds the engine that generates for it. A rollout runs under one set of
weights; `start_rollout()` says the weights may have changed since the previous one.
"""

from __future__ import annotations

import os
import sys
from typing import Any, Protocol

import torch

from copes.choices import ROLLOUT_ENGINES
from copes.extras import engine_fallback_hint, rollout_engine_for
from copes.modeling import load_model
from copes.rollout.generate import Generation
from copes.rollout.hf_engine import HFEngine, RowContext
from copes.rollout.vllm.lora import LoRASlots


class RolloutEngine(Protocol):
    def start_rollout(self) -> None:
        """A new rollout begins: the weights may differ from the previous rollout's."""

    def generate(self, tokenizer: Any, prompts: list[str], *, rows: list[int] | None = None, keep: bool = True,
                 row_context: RowContext | None = None, **options: Any) -> list[Generation]:
        """Continue every prompt, results in prompt order: the contract and keyword options of `generate_batch`
        (max_new_tokens, one or per row; greedy, temperature, top_p; stop_strings; seed). `rows` names each
        prompt's row of the rollout (an engine may keep a row's state for its next turn; `keep=False`: the rows have
        no next turn, so nothing is kept); `row_context(rows)`
        wraps the forwards that compute those rows (an engine that batches differently calls it per forward)."""


# The attribute naming a model's engine: the model and its engine are one object graph, collected together.
_ENGINE_ATTRIBUTE = "_copes_rollout_engine"


def attach_engine(model: Any, engine: RolloutEngine) -> None:
    setattr(model, _ENGINE_ATTRIBUTE, engine)


def engine_for(model: Any) -> RolloutEngine:
    """The engine attached to `model`; a model without one generates through Hugging Face `generate`."""
    return getattr(model, _ENGINE_ATTRIBUTE, None) or HFEngine(model)


def use_expandable_segments() -> None:
    """The CUDA caching allocator grows segments in place instead of caching fixed blocks: the HF engine's per-call
    stores and kept caches come in many sizes, and without it the freed blocks fragment the 24 GB the plan fills.
    A setting the user gave in PYTORCH_CUDA_ALLOC_CONF wins. (vLLM runs its own memory pool: not there.)"""
    if "expandable_segments" not in os.environ.get("PYTORCH_CUDA_ALLOC_CONF", ""):
        torch.cuda.memory._set_allocator_settings("expandable_segments:True")


def load_rollout_model(
    model: str, *, engine: str = "auto", device: str = "auto", dtype: str = "auto", cpu_threads: int = 0,
    kv_cache_gib: float | None = None, max_context_tokens: int | None = None, vllm_cpu_weights: str = "packed",
    lora: LoRASlots | None = None,
) -> tuple[torch.nn.Module, Any, torch.device]:
    """(model, tokenizer, device) as `load_model` gives them; with engine="vllm" the model's parameters are views
    of the vLLM engine's weights and its rollouts run in that engine (on CPU, with `vllm_cpu_weights` linear
    weights: "plain" or "packed", see copes.rollout.vllm.engine). On CPU, `cpu_threads` (0: torch's default) sets
    torch's intra-op threads. `lora` (vLLM only) starts the engine with LoRA adapters enabled, for a batched
    low-rank population (copes.rollout.vllm.lora); the hf engine routes rows without it. engine="auto": vllm on
    CUDA where vLLM is installed, else hf (with a one-line hint on CUDA)."""
    if hint := engine_fallback_hint(engine, device):
        print(hint, file=sys.stderr)
    engine = rollout_engine_for(engine, device)
    if engine == "hf":
        if str(device).startswith("cuda") or (device == "auto" and torch.cuda.is_available()):
            use_expandable_segments()
        loaded = load_model(model, device=device, dtype=dtype)
    elif engine == "vllm":
        from copes.rollout.vllm.engine import VLLMEngine  # imports vllm: only when asked for

        vllm_engine = VLLMEngine(model, device=device, dtype=dtype, cpu_threads=cpu_threads, kv_cache_gib=kv_cache_gib,
                                 max_context_tokens=max_context_tokens, cpu_weights=vllm_cpu_weights, lora=lora)
        attach_engine(vllm_engine.model, vllm_engine)
        loaded = vllm_engine.model, vllm_engine.tokenizer, vllm_engine.device
    else:
        raise ValueError(f"engine must be one of {ROLLOUT_ENGINES}, got {engine!r}")
    if loaded[2].type == "cpu" and cpu_threads:
        torch.set_num_threads(cpu_threads)
    return loaded

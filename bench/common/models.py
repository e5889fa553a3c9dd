"""The benchmarks' models and token workloads.

Models:
  tiny   the embedded default model (`copes.modeling.load_model("tiny")`, Qwen3 architecture, 66.6K parameters),
         or any model folder given with --tiny-model.
  large  a random ~100M-parameter Qwen3.5-architecture model (transformers' Qwen3_5ForCausalLM: three gated
         delta-net linear-attention layers per full-attention layer), built locally from a config, never
         downloaded. On CPU transformers runs its pure-torch fallbacks for the linear-attention kernels.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Any

import torch
from transformers import GenerationConfig, PreTrainedModel, Qwen3_5ForCausalLM, Qwen3_5TextConfig

from copes.config.options import TrainConfig, build_config, read_yaml
from copes.modeling import read_preset

from .harness import DEVICE

# Qwen3.5's attention and linear-attention heads are 64 wide; the head counts follow the hidden size.
HEAD_DIM = 64


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
    """A validated TrainConfig: the model's preset for the flags' algorithm (if it ships one) under `flags`, as
    copes-run layers them."""
    preset = read_preset(model, flags.get("algorithm"))
    return build_config(read_yaml(preset) if preset else {}, {"model": model, **flags})


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



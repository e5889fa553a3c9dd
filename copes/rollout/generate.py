"""Batched generation on Hugging Face `generate`: left padding, stop strings, per-row token limits, seeded sampling.

Rows never influence each other: a batch gives every prompt the same greedy output it gets alone (left
padding plus the attention mask), and a row that stops early is padded while the others continue. The batch
order is the prompt order, which is what lets EGGROLL map batch rows to population members.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from transformers import GenerationConfig, StoppingCriteria, StoppingCriteriaList, StopStringCriteria

# StopStringCriteria preprocesses the whole vocabulary on construction (about a second for a 150k vocab, even on
# HF's cache hits); it keeps no per-call state, so one instance per tokenizer and stop-string set is reused.
# None marks a tokenizer it cannot preprocess, which gets `_DecodedStopStrings` instead.
_STOP_CRITERIA: weakref.WeakKeyDictionary[Any, dict[tuple[int, tuple[str, ...]], StopStringCriteria | None]] = (
    weakref.WeakKeyDictionary()
)


@dataclass(frozen=True)
class Generation:
    """One row's output: `text` ends at (and includes) the first stop string; EOS and padding are dropped.

    `num_tokens` counts generated tokens including the EOS or the token that completed the stop string.
    `finished_by` is "eos", "stop" (a stop string) or "length" (the row's token limit).
    """

    text: str
    num_tokens: int
    finished_by: str


class _RowTokenLimit(StoppingCriteria):
    """Stops each row at its own new-token limit (HF's max_new_tokens is one number for the whole batch)."""

    def __init__(self, prompt_width: int, limits: torch.Tensor) -> None:
        self.prompt_width = prompt_width
        self.limits = limits

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor | None, **kwargs: Any) -> torch.Tensor:
        return (input_ids.shape[1] - self.prompt_width) >= self.limits


class _DecodedStopStrings(StoppingCriteria):
    """Stop strings for any tokenizer: decode each row's new tokens and look for the strings. StopStringCriteria
    is faster but cannot preprocess some vocabularies (a character-level one without the byte-level prefix it
    probes for raises "substring not found"); this costs one decode of the new tokens per row and step."""

    def __init__(self, tokenizer: Any, stop_strings: Sequence[str], prompt_width: int) -> None:
        self.tokenizer, self.stop_strings, self.prompt_width = tokenizer, list(stop_strings), prompt_width

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor | None, **kwargs: Any) -> torch.Tensor:
        texts = self.tokenizer.batch_decode(input_ids[:, self.prompt_width :], skip_special_tokens=True)
        stopped = [any(stop in text for stop in self.stop_strings) for text in texts]
        return torch.tensor(stopped, dtype=torch.bool, device=input_ids.device)


def stop_criterion(tokenizer: Any, stop_strings: Sequence[str], prompt_width: int) -> StoppingCriteria:
    by_strings = _STOP_CRITERIA.setdefault(tokenizer, {})
    key = (len(tokenizer), tuple(stop_strings))  # the vocabulary size changes when tokens are added
    if key not in by_strings:
        try:
            by_strings[key] = StopStringCriteria(tokenizer, list(stop_strings))
        except ValueError:
            by_strings[key] = None
    return by_strings[key] or _DecodedStopStrings(tokenizer, stop_strings, prompt_width)


def _adds_special_tokens(tokenizer: Any, prompts: Sequence[str]) -> bool:
    # Chat-rendered prompts already start with the BOS token where the model wants one; adding it again would
    # double it. Raw prompts get whatever the tokenizer adds by default.
    bos = getattr(tokenizer, "bos_token", None)
    return not (bos and any(prompt.startswith(bos) for prompt in prompts))


def prompt_token_ids(tokenizer: Any, prompts: Sequence[str]) -> list[list[int]]:
    """Each prompt's tokens in the model's context, tokenized exactly as `generate_batch` does (no padding)."""
    if not prompts:
        return []
    return tokenizer(list(prompts), add_special_tokens=_adds_special_tokens(tokenizer, prompts))["input_ids"]


def prompt_token_counts(tokenizer: Any, prompts: Sequence[str]) -> list[int]:
    """How many tokens each prompt occupies in the model's context, tokenized exactly as `generate_batch` does."""
    return [len(ids) for ids in prompt_token_ids(tokenizer, prompts)]


def eos_token_ids(model: Any, tokenizer: Any) -> list[int]:
    """The model's own end tokens (e.g. Qwen's <|im_end|> and <|endoftext|>) plus the tokenizer's."""
    configured = getattr(model.generation_config, "eos_token_id", None)
    ids = configured if isinstance(configured, list) else [configured]
    ids = [token for token in [*ids, tokenizer.eos_token_id] if token is not None]
    if not ids:
        raise ValueError("neither the model's generation_config nor the tokenizer defines an EOS token")
    return list(dict.fromkeys(ids))


def _generation_config(
    max_new_tokens: int, greedy: bool, temperature: float, top_p: float, pad: int, eos: list[int]
) -> GenerationConfig:
    # The sampling knobs are always set here, so none is inherited from a checkpoint's generation_config (Qwen
    # ships temperature 0.6, top_p 0.95, top_k 20). Greedy decoding gets HF's neutral values, which also keeps
    # `generate` from warning about unused flags; sampling uses top_k=0, i.e. no top-k filter.
    return GenerationConfig(
        max_new_tokens=max_new_tokens,
        do_sample=not greedy,
        temperature=1.0 if greedy else temperature,
        top_p=1.0 if greedy else top_p,
        top_k=50 if greedy else 0,
        pad_token_id=pad,
        eos_token_id=eos,
    )


def finish_row(
    tokenizer: Any, new_ids: list[int], limit: int, eos: set[int], pad: int, stop_strings: Sequence[str]
) -> Generation:
    new_ids = new_ids[:limit]
    end = next((position for position, token in enumerate(new_ids) if token in eos or token == pad), len(new_ids))
    text = tokenizer.decode(new_ids[:end], skip_special_tokens=True)
    stops = [text.find(stop) + len(stop) for stop in stop_strings if stop in text]
    if stops:
        # The token that completed a stop string can carry text past it ("</python>\n"); cut after the string.
        return Generation(text[: min(stops)], end, "stop")
    if end < len(new_ids) and new_ids[end] in eos:
        return Generation(text, end + 1, "eos")
    return Generation(text, end, "length")


def _generate_chunk(
    model: Any,
    tokenizer: Any,
    prompts: Sequence[str],
    limits: Sequence[int],
    config: GenerationConfig,
    stop_strings: Sequence[str],
) -> list[Generation]:
    encoded = tokenizer(
        list(prompts),
        return_tensors="pt",
        padding=True,
        padding_side="left",
        add_special_tokens=_adds_special_tokens(tokenizer, prompts),
    ).to(model.device)
    width = encoded["input_ids"].shape[1]
    config.max_new_tokens = max(limits)  # the longest row's limit; shorter limits stop through _RowTokenLimit
    criteria = StoppingCriteriaList()
    if min(limits) < max(limits):
        criteria.append(_RowTokenLimit(width, torch.tensor(limits, device=model.device)))
    if stop_strings:
        criteria.append(stop_criterion(tokenizer, stop_strings, width))
    with torch.inference_mode():
        sequences = model.generate(
            input_ids=encoded["input_ids"],
            attention_mask=encoded["attention_mask"],
            generation_config=config,
            stopping_criteria=criteria,
        )
    eos = set(config.eos_token_id)
    return [
        finish_row(tokenizer, row[width:].tolist(), limit, eos, config.pad_token_id, stop_strings)
        for row, limit in zip(sequences.cpu(), limits)
    ]


def row_limits(rows: int, max_new_tokens: int | Sequence[int], *, greedy: bool, temperature: float,
               top_p: float) -> list[int]:
    """Each row's new-token limit, after the checks every engine makes of the decoding options."""
    limits = [max_new_tokens] * rows if isinstance(max_new_tokens, int) else list(max_new_tokens)
    if len(limits) != rows:
        raise ValueError(f"max_new_tokens has {len(limits)} limits for {rows} prompts")
    if any(limit < 1 for limit in limits):
        raise ValueError(f"max_new_tokens must be >= 1, got {min(limits)}")
    if not greedy and temperature <= 0:
        raise ValueError(f"temperature must be > 0 when sampling, got {temperature}")
    if not 0 < top_p <= 1:
        raise ValueError(f"top_p must be in (0, 1], got {top_p}")
    return limits


def generate_batch(
    model: Any,
    tokenizer: Any,
    prompts: list[str],
    *,
    max_new_tokens: int | Sequence[int],
    greedy: bool = True,
    temperature: float = 1.0,
    top_p: float = 1.0,
    stop_strings: Sequence[str] = (),
    batch_size: int | None = None,
    seed: int | None = None,
) -> list[Generation]:
    """Continue every prompt; results come back in prompt order.

    `max_new_tokens` is one limit for all rows or one per prompt. `batch_size` caps the rows per `generate`
    call (None: all at once). `seed` makes sampling reproducible without disturbing the global RNG state.
    """
    limits = row_limits(len(prompts), max_new_tokens, greedy=greedy, temperature=temperature, top_p=top_p)
    if batch_size is not None and batch_size < 1:
        raise ValueError(f"batch_size must be >= 1 or None, got {batch_size}")
    if not prompts:
        return []
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    eos = eos_token_ids(model, tokenizer)
    size = batch_size or len(prompts)
    device = torch.device(model.device)
    accelerators = [device] if device.type != "cpu" else []  # the CPU generator is always forked
    with torch.random.fork_rng(devices=accelerators, device_type=device.type if accelerators else None):
        if seed is not None:
            torch.manual_seed(seed)
        config = _generation_config(max(limits), greedy, temperature, top_p, pad, eos)
        generations: list[Generation] = []
        for start in range(0, len(prompts), size):
            generations += _generate_chunk(
                model, tokenizer, prompts[start : start + size], limits[start : start + size], config, stop_strings
            )
    return generations

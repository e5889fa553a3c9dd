"""The Hugging Face rollout engine: a decode loop on the model's own forward that keeps each row's cache across
the turns of a rollout, prefills in chunks and stops computing a row the moment it ends.

The contract is `generate_batch`'s (copes.rollout.generate): the same prompt tokens, the same stop, EOS and
per-row limit rules (every row is finished by `finish_row`), results in prompt order; greedy tokens are the same
up to float rounding (a cached prefix was computed in earlier forwards, not in one prefill: tests compare the
tokens on fp32 CPU). How it computes them:

- Row state. Rows passed with `rows=` keys keep (tokens, cache) between calls until `start_rollout()`. A prompt
  that extends a row's cached tokens prefills only the new ones (the tool observation and the next prompt). An
  attention-only cache is cropped to the longest common prefix when the context was re-tokenized differently; a
  recurrent state (Qwen3.5's gated delta-net) cannot be cropped, so such a row is prefilled afresh. Only a row
  that ended on a stop string (a tool call, what the agent continues) keeps its cache.
- Prefill: one row at a time, so no pad token ever enters a recurrent state, in chunks of at most
  `prefill_chunk_tokens` positions (the activation peak of a long context is one chunk's).
- Decode: the active rows in one batch, their caches left-padded to the longest and masked; a row leaves the
  batch when it ends, and pad columns no remaining row needs are dropped.
- `row_context(keys)` wraps every forward with that forward's rows in batch order (EGGROLL routes each row to
  its member's perturbation).

Models this loop cannot drive (anything but a transformers model whose cache layers are plain attention or linear
attention, e.g. the tests' scripted policies or sliding-window models) run through `generate_batch`.
"""

from __future__ import annotations

import contextlib
import copy
import inspect
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from transformers import DynamicCache, PreTrainedModel, TemperatureLogitsWarper, TopPLogitsWarper
from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer, LinearAttentionLayer

from copes.rollout.generate import (
    Generation,
    eos_token_ids,
    finish_row,
    generate_batch,
    prompt_token_ids,
    row_limits,
    stop_criterion,
)

RowContext = Callable[[list[int]], contextlib.AbstractContextManager[Any]]
# Tokens of the prompt's tail shown to the stop-string check with the new tokens: a stop string may begin in the
# prompt, and a character can take up to 4 byte-level tokens.
_TOKENS_PER_STOP_CHARACTER = 4


def _attention(layer: Any) -> bool:
    return isinstance(layer, DynamicLayer)


def _recurrent(layer: Any) -> bool:
    return isinstance(layer, LinearAttentionLayer)


def drives(model: Any) -> bool:
    """Whether this engine's loop can run `model`: a transformers model whose cache layers are all plain
    attention (`DynamicLayer`) or linear attention (`LinearAttentionLayer`), not both in one layer."""
    if not isinstance(model, PreTrainedModel) or not getattr(model, "can_generate", lambda: False)():
        return False
    layers = DynamicCache(config=model.config).layers
    return all(_attention(layer) != _recurrent(layer) and not isinstance(layer, DynamicSlidingWindowLayer)
               for layer in layers)


def _rebuild(caches: Sequence[DynamicCache], keys_values: Callable[[list[torch.Tensor]], torch.Tensor],
             states: Callable[[list[torch.Tensor]], torch.Tensor]) -> DynamicCache:
    """A new cache whose every layer combines the same layer of `caches`: attention keys and values through
    `keys_values`, linear-attention conv and recurrent states through `states`."""
    combined = copy.copy(caches[0])
    combined.layers = []
    for layers in zip(*(cache.layers for cache in caches)):
        layer = copy.copy(layers[0])
        if _attention(layer):
            layer.keys = keys_values([each.keys for each in layers])
            layer.values = keys_values([each.values for each in layers])
        else:
            for name in ("conv_states", "recurrent_states"):
                setattr(layer, name, {index: None if tensor is None else states([getattr(each, name)[index]
                                                                                  for each in layers])
                                      for index, tensor in getattr(layer, name).items()})
            for name in ("is_conv_states_initialized", "is_recurrent_states_initialized", "has_previous_state",
                         "conv_kernel_size"):
                setattr(layer, name, dict(getattr(layer, name)))
        combined.layers.append(layer)
    return combined


def _stack(caches: Sequence[DynamicCache], lengths: Sequence[int]) -> DynamicCache:
    """One batch cache of single-row caches, attention left-padded to the longest of `lengths`."""
    width = max(lengths)

    def pad_left(tensors: list[torch.Tensor]) -> torch.Tensor:
        return torch.cat([F.pad(tensor, (0, 0, width - length, 0)) for tensor, length in zip(tensors, lengths)])

    return _rebuild(caches, pad_left, torch.cat)


def _take(cache: DynamicCache, rows: torch.Tensor, first_column: int) -> DynamicCache:
    """A copy of `rows` of a batch cache, attention from `first_column` on (indexing copies: the batch is freed)."""
    return _rebuild([cache], lambda tensors: tensors[0][rows, :, first_column:], lambda tensors: tensors[0][rows])


def _common_prefix(cached: Sequence[int], ids: Sequence[int]) -> int:
    length = 0
    for ours, theirs in zip(cached, ids):
        if ours != theirs:
            break
        length += 1
    return length


@dataclass
class _Row:
    key: int
    ids: list[int]  # the whole context the model continues
    limit: int
    cache: DynamicCache | None = None
    cached: int = 0  # leading tokens of `ids` the cache holds
    new: list[int] = field(default_factory=list)
    ended_by: str | None = None


@dataclass
class Picker:
    """Next tokens from last-position logits: the argmax (greedy) or a draw after temperature and top-p, as
    `generate` samples (top-k off)."""

    greedy: bool = True
    temperature: float = 1.0
    top_p: float = 1.0

    def __call__(self, logits: torch.Tensor) -> torch.Tensor:
        scores = logits.float()
        if self.greedy:
            return scores.argmax(-1)
        if self.temperature != 1.0:
            scores = TemperatureLogitsWarper(self.temperature)(None, scores)
        if self.top_p < 1.0:
            scores = TopPLogitsWarper(self.top_p)(None, scores)
        return torch.multinomial(scores.softmax(-1), 1).squeeze(1)


EndRule = Callable[[list[int], list[int]], bool]  # (context ids, new ids) -> a stop string ended the row


class HFEngine:
    """Rollouts on `model`'s forward (see the module docstring); `prefill_chunk_tokens` bounds the positions of
    one prefill forward."""

    def __init__(self, model: Any, *, prefill_chunk_tokens: int = 512, row_caches: bool = True) -> None:
        if prefill_chunk_tokens < 1:
            raise ValueError(f"prefill_chunk_tokens must be >= 1, got {prefill_chunk_tokens}")
        # row_caches=False: one batched generate_batch call per generate (a rollout with no next turn to keep the
        # rows' caches for; on a small model per-row prefill is mostly per-call overhead).
        self.model, self.prefill_chunk_tokens, self.row_caches = model, prefill_chunk_tokens, row_caches
        self._states: dict[int, tuple[list[int], DynamicCache]] = {}
        # transformers 5.x renamed forward's past_key_values to cache (the old name warns, later it goes).
        forward = getattr(model, "forward", None)
        renamed = forward is not None and "cache" in inspect.signature(forward).parameters
        self._cache_argument = "cache" if renamed else "past_key_values"

    def start_rollout(self) -> None:
        """The weights may have changed: every row's cache was computed under the old ones."""
        self._states.clear()

    def generate(self, tokenizer: Any, prompts: list[str], *, max_new_tokens: int | Sequence[int],
                 greedy: bool = True, temperature: float = 1.0, top_p: float = 1.0, stop_strings: Sequence[str] = (),
                 seed: int | None = None, rows: Sequence[int] | None = None,
                 row_context: RowContext | None = None) -> list[Generation]:
        """`generate_batch`'s contract. `rows` names each prompt's row of the rollout (its cache is kept for the
        row's next call); `row_context(keys)` wraps every forward (keys: `rows`, or prompt positions)."""
        limits = row_limits(len(prompts), max_new_tokens, greedy=greedy, temperature=temperature, top_p=top_p)
        keys = list(range(len(prompts))) if rows is None else list(rows)
        if len(keys) != len(prompts):
            raise ValueError(f"rows has {len(keys)} keys for {len(prompts)} prompts")
        if not prompts:
            return []
        if not (self.row_caches and drives(self.model)):
            with row_context(keys) if row_context else contextlib.nullcontext():
                return generate_batch(self.model, tokenizer, prompts, max_new_tokens=limits, greedy=greedy,
                                      temperature=temperature, top_p=top_p, stop_strings=stop_strings, seed=seed)
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        eos = eos_token_ids(self.model, tokenizer)
        ends_on_stop = _stop_rule(tokenizer, stop_strings)
        device = torch.device(self.model.device)
        accelerators = [device] if device.type != "cpu" else []  # the CPU generator is always forked
        with torch.random.fork_rng(devices=accelerators, device_type=device.type if accelerators else None):
            if seed is not None:
                torch.manual_seed(seed)
            new_ids = self.generate_ids(prompt_token_ids(tokenizer, prompts), limits, eos=set(eos),
                                        ends_on_stop=ends_on_stop, picker=Picker(greedy, temperature, top_p),
                                        keys=keys, remember=rows is not None, row_context=row_context)
        return [finish_row(tokenizer, ids, limit, set(eos), pad, stop_strings) for ids, limit in zip(new_ids, limits)]

    def generate_ids(self, prompts: list[list[int]], limits: list[int], *, eos: set[int],
                     ends_on_stop: EndRule | None = None, picker: Picker | None = None, keys: list[int] | None = None,
                     remember: bool = False, row_context: RowContext | None = None) -> list[list[int]]:
        """The new token ids of each prompt (token ids): a row ends at a token of `eos`, when `ends_on_stop`
        says so, or at its limit. With `remember`, rows keyed `keys` reuse and keep their caches."""
        if not all(prompts):
            raise ValueError("every prompt needs at least one token: its last position's logits start the row")
        picker = picker or Picker()
        keys = keys if keys is not None else list(range(len(prompts)))
        context = row_context or (lambda indices: contextlib.nullcontext())
        batch = [self._open_row(key, ids, limit) for key, ids, limit in zip(keys, prompts, limits)]
        with torch.inference_mode():
            first = torch.stack([self._prefill(row, context) for row in batch])
            for row, token in zip(batch, picker(first).tolist()):
                self._append(row, token, eos, ends_on_stop)
            self._decode([row for row in batch if row.ended_by is None], picker, eos, ends_on_stop, context)
        if remember:
            for row in batch:
                if row.ended_by == "stop":
                    self._states[row.key] = (row.ids + row.new[:-1], row.cache)
        return [row.new for row in batch]

    # ---- the pieces --------------------------------------------------------------------------------------------
    def _open_row(self, key: int, ids: list[int], limit: int) -> _Row:
        """The row with its kept cache where that cache holds a prefix of `ids` (cropped where it must be)."""
        row = _Row(key, list(ids), limit)
        tokens, cache = self._states.pop(key, (None, None))
        if cache is None:
            return row
        # At least the last token is prefilled again: its logits are the first new token's.
        reusable = min(_common_prefix(tokens, ids), len(ids) - 1)
        if reusable < len(tokens):
            if not all(_attention(layer) for layer in cache.layers):  # a recurrent state cannot be rolled back
                return row
            cache.crop(reusable - len(tokens))
        row.cache, row.cached = cache, reusable
        return row

    def _forward(self, input_ids: torch.Tensor, cache: DynamicCache, positions: torch.Tensor,
                 mask: torch.Tensor | None = None) -> torch.Tensor:
        output = self.model(input_ids=input_ids, attention_mask=mask, position_ids=positions, use_cache=True,
                            logits_to_keep=1, **{self._cache_argument: cache})
        return output.logits[:, -1]

    def _prefill(self, row: _Row, context: RowContext) -> torch.Tensor:
        """Feed the row's uncached tokens, a chunk per forward; returns the last position's logits."""
        device = self.model.device
        row.cache = row.cache if row.cache is not None else DynamicCache(config=self.model.config)
        pending = torch.tensor(row.ids[row.cached :], device=device)
        with context([row.key]):
            for start in range(0, len(pending), self.prefill_chunk_tokens):
                chunk = pending[start : start + self.prefill_chunk_tokens]
                positions = torch.arange(row.cached, row.cached + len(chunk), device=device)
                logits = self._forward(chunk[None], row.cache, positions[None])
                row.cached += len(chunk)
        return logits[0]

    @staticmethod
    def _append(row: _Row, token: int, eos: set[int], ends_on_stop: EndRule | None) -> None:
        row.new.append(token)
        if token in eos:
            row.ended_by = "eos"
        elif ends_on_stop is not None and ends_on_stop(row.ids, row.new):
            row.ended_by = "stop"
        elif len(row.new) >= row.limit:
            row.ended_by = "length"

    def _decode(self, active: list[_Row], picker: Picker, eos: set[int], ends_on_stop: EndRule | None,
                context: RowContext) -> None:
        """One token per active row per forward, the rows batched; a row leaves the batch when it ends."""
        if not active:
            return
        device = self.model.device
        lengths = [row.cached for row in active]  # positions each row's cache holds
        cache = _stack([row.cache for row in active], lengths)
        for row in active:
            row.cache = None  # the batch cache holds it now
        width = max(lengths)
        mask = torch.tensor([[0] * (width - length) + [1] * length for length in lengths], device=device)
        while active:
            with context([row.key for row in active]):
                while all(row.ended_by is None for row in active):
                    tokens = torch.tensor([[row.new[-1]] for row in active], device=device)
                    positions = torch.tensor([[row.cached] for row in active], device=device)
                    mask = torch.cat([mask, mask.new_ones(len(active), 1)], dim=1)
                    logits = self._forward(tokens, cache, positions, mask)
                    for row, token in zip(active, picker(logits).tolist()):
                        row.cached += 1
                        self._append(row, token, eos, ends_on_stop)
            pads = (mask == 0).sum(dim=1).tolist()
            for index, row in enumerate(active):
                if row.ended_by == "stop":  # its cache may serve the row's next turn
                    row.cache = _take(cache, torch.tensor([index], device=device), pads[index])
            keep = [index for index, row in enumerate(active) if row.ended_by is None]
            if keep:
                trim = min(pads[index] for index in keep)
                selected = torch.tensor(keep, device=device)
                cache, mask = _take(cache, selected, trim), mask[selected, trim:]
            active = [active[index] for index in keep]


def _stop_rule(tokenizer: Any, stop_strings: Sequence[str]) -> EndRule | None:
    """Whether a row's new tokens completed a stop string: the check `generate_batch` makes, on the row's new
    tokens after its prompt's last few."""
    if not stop_strings:
        return None
    tail = _TOKENS_PER_STOP_CHARACTER * max(len(stop) for stop in stop_strings) + 1

    def ends(ids: list[int], new: list[int]) -> bool:
        shown = ids[-tail:]
        criterion = stop_criterion(tokenizer, stop_strings, len(shown))
        return bool(criterion(torch.tensor([shown + new]), None)[0])

    return ends

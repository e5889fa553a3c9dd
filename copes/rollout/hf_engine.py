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
- Storage: each attention layer's keys and values for all the call's rows live in one preallocated tensor
  (rows x heads x columns x head dim, room for the longest context plus the longest generation), written in
  place; rows are left-padded to a common end and every forward attends to views of it (no per-token torch.cat).
- Prefill, in chunks of at most `prefill_chunk_tokens` positions (the activation peak of a long context is one
  chunk's). A row with a cached prefix or any row of a recurrent model (a pad token must never enter a delta-net
  state) runs alone; fresh rows of an attention-only model are packed several to a forward, each attending only
  to itself (a block-diagonal mask: no padding), when no `row_context` asks for per-row weights.
- Decode: the active rows in one batch, masked; a row leaves the batch when it ends, the batch's last row moving
  into its place (one row's copy), and pad columns no remaining row needs are not attended to.
- Static decode (`decode="static"`/`"graphs"`, what `auto` picks on CUDA, see `decode_mode`): every row stays
  in the batch until the call ends (a finished row's tokens are dropped), each forward attends to the whole
  store under a fixed (rows x columns) mask and writes its keys at a column held in a device tensor, and the
  picked tokens stay on the device: the host reads them every `SYNC_EVERY` steps (stop strings, EOS, limits are
  checked there, on the same tokens), not after every token. Every shape and address is fixed, so `"graphs"`
  captures the decode forward once per call as a CUDA graph and replays it (one launch per step instead of one
  per kernel). A recurrent state cannot be cut back to a stop string's token, so a hybrid model's rows that keep
  their cache for a next turn are read every step.
- `row_context(keys)` wraps every forward with that forward's rows in batch order (EGGROLL routes each row to
  its member's perturbation).

Models this loop cannot drive (anything but a transformers model whose cache layers are plain attention or linear
attention, e.g. the tests' scripted policies or sliding-window models) run through `generate_batch`.
"""

from __future__ import annotations

import contextlib
import copy
import inspect
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers import DynamicCache, PreTrainedModel, TemperatureLogitsWarper, TopPLogitsWarper
from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer, LinearAttentionLayer

from copes.modeling import prepare_for_cpu
from copes.rollout.generate import (
    Generation,
    eos_token_ids,
    finish_row,
    generate_batch,
    prompt_token_ids,
    row_limits,
    stop_criterion,
)

PREFILL_CHUNK_TOKENS = 512  # the default bound on one prefill forward's positions (the memory plan takes it too)
RowContext = Callable[[list[int]], contextlib.AbstractContextManager[Any]]
# Tokens of the prompt's tail shown to the stop-string check with the new tokens: a stop string may begin in the
# prompt, and a character can take up to 4 byte-level tokens.
_TOKENS_PER_STOP_CHARACTER = 4
DECODE_MODES = ("auto", "eager", "static", "graphs")
# Static decode steps between two host reads of the picked tokens: a read waits for the device (a sync), and the
# rows that ended meanwhile cost at most this many wasted steps.
SYNC_EVERY = 16


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


def decode_mode(device: torch.device | str, attention: str | None, *, row_context: bool,
                mode: str = "auto") -> str:
    """The decode loop a call runs for a model on `device` with `attention` (its config's _attn_implementation),
    see the module docstring. auto: "eager" off CUDA (finished rows leave the batch: on a CPU the compute is the
    cost) and for attention other than sdpa (the static decode's boolean mask is sdpa's form); on CUDA "graphs"
    (launches and host syncs are the cost), or "static" under a `row_context` (its routing is entered per call in
    Python, which a replayed graph would not see)."""
    if mode not in DECODE_MODES:
        raise ValueError(f"decode must be one of {DECODE_MODES}, got {mode!r}")
    device = torch.device(device)
    if mode in ("static", "graphs") and attention != "sdpa":
        raise ValueError(f"decode={mode!r} needs sdpa attention, the model uses {attention}")
    if mode == "graphs" and device.type != "cuda":
        raise ValueError(f"decode='graphs' needs a CUDA device, the model is on {device}")
    if mode != "auto":
        return mode
    if device.type != "cuda" or attention != "sdpa":
        return "eager"
    return "static" if row_context else "graphs"


def _combined(layers: Sequence[Any], states: Callable[[list[torch.Tensor]], torch.Tensor]) -> Any:
    """A new linear-attention layer combining `layers` (the same layer of several caches): each conv and
    recurrent state through `states`."""
    layer = copy.copy(layers[0])
    for name in ("conv_states", "recurrent_states"):
        setattr(layer, name, {index: None if tensor is None else states([getattr(each, name)[index] for each in layers])
                              for index, tensor in getattr(layer, name).items()})
    for name in ("is_conv_states_initialized", "is_recurrent_states_initialized", "has_previous_state",
                 "conv_kernel_size"):
        setattr(layer, name, dict(getattr(layer, name)))
    return layer


class _Store:
    """One attention layer's keys and values for every row of a generate call, preallocated (rows x heads x
    columns x head dim) on the first write and written in place: no per-token torch.cat of the whole cache. Row
    r's context occupies columns [start_r, end): the rows are left-padded to a common end."""

    def __init__(self, rows: int, columns: int) -> None:
        self.rows, self.columns = rows, columns
        self.keys: torch.Tensor | None = None
        self.values: torch.Tensor | None = None

    def write(self, rows: slice, column: int, keys: torch.Tensor, values: torch.Tensor) -> None:
        if self.keys is None:
            shape = (self.rows, keys.shape[1], self.columns, keys.shape[3])
            self.keys = keys.new_zeros(shape)
            self.values = values.new_zeros((*shape[:3], values.shape[3]))
        self.keys[rows, :, column : column + keys.shape[2]] = keys
        self.values[rows, :, column : column + values.shape[2]] = values

    def move(self, source: int, target: int, start: int, end: int) -> None:
        if self.keys is not None:
            self.keys[target, :, start:end] = self.keys[source, :, start:end]
            self.values[target, :, start:end] = self.values[source, :, start:end]


class _StoreLayer(DynamicLayer):
    """An attention cache layer on `rows` x columns [start, end) of a `_Store`: `update` writes the new columns in
    place and returns views (what the model attends to is exactly the layer's columns)."""

    def __init__(self, store: _Store, rows: slice, start: int, end: int) -> None:
        super().__init__()
        self.store, self.rows, self.start, self.end = store, rows, start, end
        self.is_initialized = True
        self._views()

    def _views(self) -> None:
        if self.store.keys is None:
            self.keys = self.values = torch.empty(0)
        else:
            self.keys = self.store.keys[self.rows, :, self.start : self.end]
            self.values = self.store.values[self.rows, :, self.start : self.end]

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any,
               **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        self.store.write(self.rows, self.end, key_states, value_states)
        self.end += key_states.shape[2]
        self._views()
        return self.keys, self.values


class _ColumnLayer(DynamicLayer):
    """An attention cache layer on the whole of a `_Store` for the static decode: `update` writes the step's keys
    and values at the column held in the device tensor `column` (the same for every row: the rows end together)
    and returns the whole store, whose shape and address never change."""

    def __init__(self, store: _Store, column: torch.Tensor) -> None:
        super().__init__()
        self.column, self.is_initialized, self.keys, self.values = column, True, store.keys, store.values

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any,
               **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        self.keys.index_copy_(2, self.column, key_states)
        self.values.index_copy_(2, self.column, value_states)
        return self.keys, self.values


class _GraphStep:
    """`forward` (no arguments: it reads and writes fixed tensors) as a CUDA graph. The first call runs it eagerly
    on a side stream (the warm-up capture needs, and a real step: a second run would advance the recurrent states
    twice), then records it, which runs nothing; every later call replays the recording. A forward that cannot be
    captured (an op that syncs with the host) runs eagerly from then on, with a one-line warning: recording ran
    nothing, so no state moved."""

    def __init__(self, forward: Callable[[], torch.Tensor]) -> None:
        self.forward, self.graph, self.logits, self.eager = forward, None, None, False

    def __call__(self) -> torch.Tensor:
        if self.graph is not None:
            self.graph.replay()
            return self.logits
        if self.eager:
            return self.forward()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            logits = self.forward()
        torch.cuda.current_stream().wait_stream(stream)
        logits.record_stream(torch.cuda.current_stream())  # read there: not free for the side stream until then
        graph = torch.cuda.CUDAGraph()
        try:  # thread_local: a sandbox or journal thread's CUDA call elsewhere must not invalidate the capture
            with torch.cuda.graph(graph, stream=stream, capture_error_mode="thread_local"):
                self.logits = self.forward()
            self.graph = graph
        except RuntimeError as failure:
            warnings.warn(f"the HF engine decodes without CUDA graphs: {str(failure).splitlines()[0]}", stacklevel=2)
            self.eager = True
        return logits


class _PackedLayer(DynamicLayer):
    """An attention cache layer for one forward over several fresh rows packed into one sequence (each row's
    segment attends to itself through a block-diagonal mask): `update` scatters each segment into its row's
    columns of the `_Store` and returns the packed keys and values themselves."""

    def __init__(self, store: _Store, segments: list[tuple[int, int, int, int]]) -> None:
        super().__init__()
        self.store, self.segments = store, segments  # (row, first column, first packed position, length)
        self.is_initialized, self.keys, self.values = True, torch.empty(0), torch.empty(0)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any,
               **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        for row, column, first, length in self.segments:
            self.store.write(slice(row, row + 1), column, key_states[:, :, first : first + length],
                             value_states[:, :, first : first + length])
        return key_states, value_states


def _with_layers(template: DynamicCache, layers: list[Any]) -> DynamicCache:
    cache = copy.copy(template)
    cache.layers = layers
    return cache


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
    slot: int = 0  # the row's index in the call's stores (and, while decoding, in the batch)
    start: int = 0  # the stores' first column of the row's context
    logits: torch.Tensor | None = None  # the first new token's, from the prefill


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

    def __init__(self, model: Any, *, prefill_chunk_tokens: int = PREFILL_CHUNK_TOKENS,
                 row_caches: bool = True, decode: str = "auto") -> None:
        if prefill_chunk_tokens < 1:
            raise ValueError(f"prefill_chunk_tokens must be >= 1, got {prefill_chunk_tokens}")
        if decode not in DECODE_MODES:
            raise ValueError(f"decode must be one of {DECODE_MODES}, got {decode!r}")
        self.decode = decode  # the decode loop: see decode_mode
        # row_caches=False: one batched generate_batch call per generate (a rollout with no next turn to keep the
        # rows' caches for; on a small model per-row prefill is mostly per-call overhead).
        self.model, self.prefill_chunk_tokens, self.row_caches = model, prefill_chunk_tokens, row_caches
        if isinstance(model, torch.nn.Module):
            prepare_for_cpu(model)  # a model built by the caller, not by load_model
        self._states: dict[int, tuple[list[int], DynamicCache]] = {}
        # transformers 5.x renamed forward's past_key_values to cache (the old name warns, later it goes).
        forward = getattr(model, "forward", None)
        renamed = forward is not None and "cache" in inspect.signature(forward).parameters
        self._cache_argument = "cache" if renamed else "past_key_values"

    @property
    def max_model_len(self) -> int | None:
        """The longest context (prompt + generated tokens) the model takes: its max_position_embeddings."""
        config = getattr(self.model, "config", None)
        text = config.get_text_config() if config is not None else None
        return getattr(text, "max_position_embeddings", None)

    @property
    def keeps_row_caches(self) -> bool:
        """Whether a row that ends on a stop string keeps its cache until its next call (see `generate`)."""
        return self.row_caches and drives(self.model)

    def start_rollout(self) -> None:
        """The weights may have changed: every row's cache was computed under the old ones."""
        self._states.clear()

    def generate(self, tokenizer: Any, prompts: list[str], *, max_new_tokens: int | Sequence[int],
                 greedy: bool = True, temperature: float = 1.0, top_p: float = 1.0, stop_strings: Sequence[str] = (),
                 seed: int | None = None, rows: Sequence[int] | None = None, keep: bool = True,
                 row_context: RowContext | None = None) -> list[Generation]:
        """`generate_batch`'s contract. `rows` names each prompt's row of the rollout (its cache is kept for the
        row's next call, unless `keep` is False: the agent's last turn, whose caches no call would read);
        `row_context(keys)` wraps every forward (keys: `rows`, or prompt positions)."""
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
                                        keys=keys, remember=rows is not None and keep, row_context=row_context)
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
        batch = [self._open_row(key, ids, limit) for key, ids, limit in zip(keys, prompts, limits)]
        template = DynamicCache(config=self.model.config)
        width = max(len(row.ids) for row in batch)
        # Room for every row's context and its longest possible generation; each row ends at column `width`.
        columns = width + max(row.limit for row in batch)
        stores = [_Store(len(batch), columns) if _attention(layer) else None for layer in template.layers]
        for slot, row in enumerate(batch):
            row.slot, row.start = slot, width - len(row.ids)
        mode = decode_mode(self.model.device, getattr(self.model.config, "_attn_implementation", None),
                           row_context=row_context is not None, mode=self.decode)
        context = row_context or (lambda indices: contextlib.nullcontext())
        with torch.inference_mode():
            self._prefill(batch, stores, row_context)
            if mode == "eager":
                self._decode(batch, template, stores, width, picker, eos, ends_on_stop, context, remember)
            else:
                self._decode_static(batch, template, stores, width, picker, eos, ends_on_stop, context, remember,
                                    graphs=mode == "graphs")
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
                 mask: torch.Tensor | None = None, logits_to_keep: int | torch.Tensor = 1) -> torch.Tensor:
        output = self.model(input_ids=input_ids, attention_mask=mask, position_ids=positions, use_cache=True,
                            logits_to_keep=logits_to_keep, **{self._cache_argument: cache})
        return output.logits

    def _prefill(self, batch: list[_Row], stores: list[_Store | None], row_context: RowContext | None) -> None:
        """Feed every row's uncached tokens and set its first new token's logits (`row.logits`). Fresh rows of an
        attention-only model are packed, several to a forward of at most `prefill_chunk_tokens` positions, each
        attending only to itself (no padding); every other row runs alone, a chunk per forward. Packing needs
        one perturbation for the whole forward: not under `row_context`."""
        packable = (row_context is None and all(stores)
                    and getattr(self.model.config, "_attn_implementation", None) == "sdpa")
        singles, bins, current, used = [], [], [], 0
        for row in batch:
            size = len(row.ids)
            if not packable or row.cached or row.cache is not None or size > self.prefill_chunk_tokens:
                singles.append(row)
                continue
            if used + size > self.prefill_chunk_tokens:
                bins.append(current)
                current, used = [], 0
            current.append(row)
            used += size
        bins.append(current)
        for rows in bins:
            if len(rows) == 1:
                singles += rows
            elif rows:
                self._prefill_packed(rows, stores)
        context = row_context or (lambda indices: contextlib.nullcontext())
        for row in singles:
            with context([row.key]):
                self._prefill_row(row, stores)

    def _prefill_row(self, row: _Row, stores: list[_Store | None]) -> None:
        device = self.model.device
        row.cache = row.cache if row.cache is not None else DynamicCache(config=self.model.config)
        rows = slice(row.slot, row.slot + 1)
        layers = []
        for store, layer in zip(stores, row.cache.layers):
            if store is None:
                layers.append(layer)
                continue
            if row.cached:  # the kept cache's columns move into the call's store
                store.write(rows, row.start, layer.keys, layer.values)
            layers.append(_StoreLayer(store, rows, row.start, row.start + row.cached))
        cache = _with_layers(row.cache, layers)
        # The kept keys and values are in the store now; the row keeps only its recurrent layers.
        row.cache.layers = [layer if store is None else None for store, layer in zip(stores, row.cache.layers)]
        pending = torch.tensor(row.ids[row.cached :], device=device)
        for start in range(0, len(pending), self.prefill_chunk_tokens):
            chunk = pending[start : start + self.prefill_chunk_tokens]
            positions = torch.arange(row.cached, row.cached + len(chunk), device=device)
            logits = self._forward(chunk[None], cache, positions[None])
            row.cached += len(chunk)
        row.logits = logits[0, -1]

    def _prefill_packed(self, rows: list[_Row], stores: list[_Store | None]) -> None:
        device = self.model.device
        lengths = [len(row.ids) for row in rows]
        firsts = [sum(lengths[:index]) for index in range(len(rows))]
        total = sum(lengths)
        segment = torch.repeat_interleave(torch.arange(len(rows)), torch.tensor(lengths)).to(device)
        causal = torch.ones(total, total, dtype=torch.bool, device=device).tril()
        mask = (causal & (segment[:, None] == segment[None, :]))[None, None]
        positions = torch.cat([torch.arange(length) for length in lengths]).to(device)
        segments = [(row.slot, row.start, first, length) for row, first, length in zip(rows, firsts, lengths)]
        cache = DynamicCache(config=self.model.config)
        cache.layers = [_PackedLayer(store, segments) for store in stores]
        ids = torch.tensor([token for row in rows for token in row.ids], device=device)
        last = torch.tensor([first + length - 1 for first, length in zip(firsts, lengths)], device=device)
        logits = self._forward(ids[None], cache, positions[None], mask, logits_to_keep=last)
        for row, row_logits in zip(rows, logits[0]):
            row.cached, row.cache, row.logits = len(row.ids), None, row_logits

    @staticmethod
    def _append(row: _Row, token: int, eos: set[int], ends_on_stop: EndRule | None) -> None:
        row.new.append(token)
        if token in eos:
            row.ended_by = "eos"
        elif ends_on_stop is not None and ends_on_stop(row.ids, row.new):
            row.ended_by = "stop"
        elif len(row.new) >= row.limit:
            row.ended_by = "length"

    def _decode(self, batch: list[_Row], template: DynamicCache, stores: list[_Store | None], width: int,
                picker: Picker, eos: set[int], ends_on_stop: EndRule | None, context: RowContext,
                remember: bool) -> None:
        """One token per active row per forward, the rows batched (rows 0..n-1 of the stores); a row that ends
        leaves the batch at once, the last row moving into its place (one row's copy, not the batch's)."""
        device = self.model.device
        first = picker(torch.stack([row.logits for row in batch])).tolist()
        for row, token in zip(batch, first):
            row.logits = None
            self._append(row, token, eos, ends_on_stop)
        recurrent = _batch_states(batch, stores)
        columns = width + max(row.limit for row in batch)
        mask = torch.zeros(len(batch), columns, dtype=torch.bool, device=device)
        for row in batch:
            mask[row.slot, row.start : width] = True
        active, end = list(batch), width
        while active:
            for row in sorted((row for row in active if row.ended_by is not None), key=lambda row: -row.slot):
                self._leave(row, active, stores, recurrent, mask, template, end, remember)
            if not active:
                break
            count, start = len(active), min(row.start for row in active)
            cache = _with_layers(template, [recurrent[index] if store is None else
                                            _StoreLayer(store, slice(0, count), start, end)
                                            for index, store in enumerate(stores)])
            with context([row.key for row in active]):
                while all(row.ended_by is None for row in active):
                    tokens = torch.tensor([[row.new[-1]] for row in active], device=device)
                    positions = torch.tensor([[row.cached] for row in active], device=device)
                    mask[:count, end] = True
                    logits = self._forward(tokens, cache, positions, mask[:count, start : end + 1])
                    end += 1
                    for row, token in zip(active, picker(logits[:, -1]).tolist()):
                        row.cached += 1
                        self._append(row, token, eos, ends_on_stop)

    def _decode_static(self, batch: list[_Row], template: DynamicCache, stores: list[_Store | None], width: int,
                       picker: Picker, eos: set[int], ends_on_stop: EndRule | None, context: RowContext,
                       remember: bool, graphs: bool) -> None:
        """The static decode (module docstring): every row in every forward, the whole store attended to under a
        fixed mask, the picked tokens kept on the device in `picked` and read every `SYNC_EVERY` steps."""
        device, count, steps = self.model.device, len(batch), max(row.limit for row in batch)
        recurrent = _batch_states(batch, stores)
        column = torch.tensor([width], device=device)  # where this step's keys go: every context ends at width
        positions = torch.tensor([[len(row.ids)] for row in batch], device=device)
        mask = torch.zeros(count, 1, 1, width + steps, dtype=torch.bool, device=device)
        for row in batch:
            mask[row.slot, :, :, row.start : width] = True
        tokens = torch.empty(count, 1, dtype=torch.long, device=device)
        picked = torch.empty(count, steps, dtype=torch.long, device=device)
        picked[:, 0] = picker(torch.stack([row.logits for row in batch]))
        for row in batch:
            row.logits = None
        cache = _with_layers(template, [recurrent[index] if store is None else _ColumnLayer(store, column)
                                        for index, store in enumerate(stores)])

        def forward() -> torch.Tensor:
            mask.index_fill_(3, column, True)
            return self._forward(tokens, cache, positions, mask)[:, -1]

        step = _GraphStep(forward) if graphs else forward
        # A kept recurrent state must be cloned on the step its row ends: it cannot be cut back to that token.
        every = 1 if remember and ends_on_stop is not None and recurrent else SYNC_EVERY
        read = 0
        with context([row.key for row in batch]):
            for index in range(steps):
                if index:  # feed each row's last token, pick its next
                    tokens.copy_(picked[:, index - 1 : index])
                    picked[:, index] = picker(step())
                    positions.add_(1)
                    column.add_(1)
                if (index + 1) % every and index + 1 < steps:
                    continue
                for row, new in zip(batch, picked[:, read : index + 1].tolist()):  # the host sync
                    for token in new if row.ended_by is None else ():
                        self._append(row, token, eos, ends_on_stop)
                        if row.ended_by is not None:
                            if remember and row.ended_by == "stop":  # its columns up to its last fed token
                                row.cache = _kept(row.slot, row.start, width + len(row.new) - 1, stores, recurrent,
                                                  template)
                            break
                read = index + 1
                if all(row.ended_by is not None for row in batch):
                    break

    @staticmethod
    def _leave(row: _Row, active: list[_Row], stores: list[_Store | None], recurrent: dict[int, Any],
               mask: torch.Tensor, template: DynamicCache, end: int, remember: bool) -> None:
        """Take `row` out of the decode batch (keeping its cache where it may serve the row's next turn)."""
        slot, last = row.slot, len(active) - 1
        row.cache = _kept(slot, row.start, end, stores, recurrent, template) if remember and row.ended_by == "stop" \
            else None
        moved = active[last]
        if slot != last:
            for store in stores:
                if store is not None:
                    store.move(last, slot, moved.start, end)
            mask[slot] = mask[last]
            active[slot], moved.slot = moved, slot
        active.pop()
        for layer in recurrent.values():
            _each_state(layer, lambda tensor: _drop_last(tensor, slot))


def _batch_states(batch: list[_Row], stores: list[_Store | None]) -> dict[int, Any]:
    """The recurrent layers of the decode batch: the rows' states side by side (per row until now, each row's
    cache released: the batch holds every row's state now)."""
    recurrent = {index: _combined([row.cache.layers[index] for row in batch], torch.cat)
                 for index, store in enumerate(stores) if store is None}
    for row in batch:
        row.cache = None
    return recurrent


def _kept(slot: int, start: int, end: int, stores: list[_Store | None], recurrent: dict[int, Any],
          template: DynamicCache) -> DynamicCache:
    """A copy of batch row `slot`'s cache for its next turn: its attention columns [start, end), its recurrent
    states as they are now."""
    layers = [_combined([recurrent[index]], lambda states: states[0][slot : slot + 1].clone())
              if store is None else _kv_layer(store.keys[slot : slot + 1, :, start:end].clone(),
                                              store.values[slot : slot + 1, :, start:end].clone())
              for index, store in enumerate(stores)]
    return _with_layers(template, layers)


def _drop_last(tensor: torch.Tensor, slot: int) -> torch.Tensor:
    """The batch state without row `slot`: the last row moves into its place."""
    if slot != tensor.shape[0] - 1:
        tensor[slot] = tensor[-1]
    return tensor[:-1]


def _kv_layer(keys: torch.Tensor, values: torch.Tensor) -> DynamicLayer:
    layer = DynamicLayer()
    layer.keys, layer.values, layer.is_initialized, layer.device = keys, values, True, keys.device
    return layer


def _each_state(layer: Any, change: Callable[[torch.Tensor], torch.Tensor]) -> None:
    for name in ("conv_states", "recurrent_states"):
        states = getattr(layer, name)
        for index, tensor in states.items():
            if tensor is not None:
                states[index] = change(tensor)


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

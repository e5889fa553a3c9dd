"""The memory plan's GRPO column: what full-parameter GRPO (Adam, optionally a KL reference model) holds for the
same model and context as a CoPES plan, and how many cards of a given size it needs. `copes-run --plan` prints it
under the CoPES table (docs/memory-plan.md, "The GRPO column").

One GRPO update, as a careful user runs it (TRL's GRPOTrainer, one sequence per micro-batch):
- state: the weights, their gradients (model dtype), fp32 masters of 16-bit weights, fp32 Adam moments, and the
  reference model's weights when the KL term is on;
- sampling: the group's rows generated with a KV cache (KV and delta-net state per row, no gradients);
- update: forward + backward over prompt + completion. Without gradient checkpointing every layer's saved
  activations are live at the start of the backward; with it, each layer's input plus one layer's saved
  activations (recomputed in the backward). The completion's logits (`logits_to_keep`), their log-softmax and
  their gradient, and the embedding's gradient (the backward's first) come on top. Gradients grow as activations
  are freed: the backward ends with every gradient beside the layer inputs and the last recomputed layer.
The per-token saved activations are the tensors autograd keeps in transformers' Qwen3 / Qwen3.5 layers, listed
with saved_tensors_hooks on CPU (model dtype s, fp32 4 bytes; the gated delta rule's torch fallback);
tests/plan/test_plan_grpo.py checks the whole update against peaks measured at reduced width.

Cards: fully sharded (ZeRO-3 / FSDP) state and sequence-parallel activations divide by the cards; one layer's
gathered weights and gradients do not. The count is therefore a lower bound on what a real deployment needs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from copes.config.options import TrainConfig
from copes.plan.memory import (
    GIB,
    PROMPT_TOKENS,
    RESERVE_BYTES,
    RESERVE_FRACTION,
    MemoryPlan,
    ModelShape,
    PlanLine,
    kv_bytes_per_token,
    plan_for,
    recurrent_bytes_per_row,
)

GROUP_SIZE = 8  # completions per prompt (TRL's num_generations default)
GRPO_CARD_GIB = 48.0  # the card the GRPO count is for (the paper's 8 x 48 GB)
COPES_CARD_GIB = 24.0  # the card the CoPES side is for (the paper's one 24 GB card)
FP32 = 4
DELTA_RULE_CHUNK = 64  # the gated delta rule's chunk (transformers' torch fallback)


def _norm_bytes(shape: ModelShape, s: int) -> int:
    """One RMSNorm, per token: its fp32 input and normed copy, the rsqrt, the output in the model dtype (Qwen3.5's
    (1 + w) norm multiplies in fp32, so its normed copy is fp32)."""
    normed = FP32 if shape.attn_output_gate else s
    return FP32 * shape.hidden + FP32 + normed * shape.hidden + s * shape.hidden


def saved_bytes_per_token(shape: ModelShape, s: int) -> dict[str, int]:
    """Bytes autograd saves for the backward, per token, in one decoder layer of each kind (both norms and the
    MLP's act(gate), gate, up and their product included)."""
    common = 2 * _norm_bytes(shape, s) + 4 * shape.intermediate * s
    kinds = {}
    if shape.full_attention_layers:
        q, kv = shape.heads * shape.head_dim, shape.kv_heads * shape.head_dim
        normed = FP32 if shape.attn_output_gate else s  # q and k norms
        rotary = shape.head_dim // 4 if shape.attn_output_gate else shape.head_dim  # Qwen3.5: partial rotary 0.25
        attention = (FP32 * (q + kv) + FP32 * (shape.heads + shape.kv_heads) + normed * (q + kv)
                     + 2 * rotary * s + s * (q + 2 * kv) + FP32 * shape.heads + s * q)
        if shape.attn_output_gate:  # the gate's sigmoid, the gated product's input, o_proj's input
            attention += 3 * s * q
        kinds["attention"] = common + attention
    if shape.linear_layers:
        heads, value = shape.linear_value_heads, shape.linear_value_dim
        repeated = heads * shape.linear_key_head_dim  # q and k repeated to the value heads
        state = heads * shape.linear_key_head_dim * shape.linear_value_head_dim // DELTA_RULE_CHUNK
        # Model dtype: the conv's input and output, beta's logits, the gated norm's input and output, out_proj's input.
        model_dtype = s * (2 * shape.conv_dim + heads + 3 * value)
        # fp32: q, k, v and their l2-normed, padded and chunked copies, the intra-chunk matrices (chunk x chunk per
        # head), one recurrent state per chunk, the gated norm's fp32 terms, per-head decay and beta terms.
        fp32 = FP32 * (11 * repeated + 3 * value + 5 * heads * DELTA_RULE_CHUNK + state + 9 * heads)
        kinds["gated delta-net"] = common + model_dtype + fp32
    return kinds


def _layers_saved_bytes(shape: ModelShape, s: int) -> int:
    """Per token, all layers together."""
    kinds = saved_bytes_per_token(shape, s)
    return (kinds.get("attention", 0) * shape.full_attention_layers
            + kinds.get("gated delta-net", 0) * shape.linear_layers)


@dataclass
class GRPOPlan:
    shape: ModelShape
    dtype: str
    context_tokens: int
    completion_tokens: int
    kl: bool
    checkpointing: bool
    state: list[PlanLine]
    sampling: int
    activations_full: int  # every layer's saved activations
    activations_checkpointed: int  # each layer's input and one layer's saved activations
    logits: int
    embedding_gradient: int  # the (tied) embedding's, the backward's first
    backward_transients: int  # an MLP's backward: the gradients of its product and of one branch, beside the saved
    gradients: int
    gathered: int  # one layer's weights and gradients, unsharded (FSDP)
    copes: MemoryPlan | None  # the CoPES plan for one COPES_CARD_GIB card

    @property
    def state_bytes(self) -> int:
        return sum(line.bytes for line in self.state)

    def activations(self, checkpointing: bool | None = None) -> int:
        checkpointing = self.checkpointing if checkpointing is None else checkpointing
        return self.activations_checkpointed if checkpointing else self.activations_full

    def update_bytes(self, checkpointing: bool | None = None) -> int:
        """The backward's start (every saved activation, the logits' terms and the embedding's gradient, the first
        computed) or its end (every gradient, with each layer's input and the layer recomputed last)."""
        start = self.activations(checkpointing) + self.logits + self.embedding_gradient + self.backward_transients
        return max(start, self.gradients + self.activations_checkpointed)

    def peak_bytes(self, checkpointing: bool | None = None) -> int:
        """One card, no sharding: state + the larger of sampling and the update's peak."""
        return self.state_bytes + max(self.sampling, self.update_bytes(checkpointing))

    def cards(self, checkpointing: bool | None = None, card_gib: float = GRPO_CARD_GIB) -> int | None:
        """The fewest cards of `card_gib` that hold the update with the state and activations split evenly over
        them (None: one layer's gathered weights do not fit a card)."""
        usable = int(card_gib * GIB * (1 - RESERVE_FRACTION)) - RESERVE_BYTES - self.gathered
        if usable <= 0:
            return None
        total = self.state_bytes + max(self.sampling,
                                       self.activations(checkpointing) + self.logits + self.backward_transients)
        return max(1, math.ceil(total / usable))

    def line(self) -> str:
        """The one line `copes-run --plan` prints (binding: it names GRPO)."""
        if self.copes is None:
            copes = "no CoPES plan beside it"
        else:
            copes = (f"CoPES holds {self.copes.rows} rows per generate call on one {COPES_CARD_GIB:.0f} GB card "
                     f"(peak {_gib(self.copes.peak_bytes())})" if self.copes.fits
                     else f"CoPES does not fit one {COPES_CARD_GIB:.0f} GB card ({self.copes.advice})")
        return (f"GRPO at {self.context_tokens} tokens: {_cards(self.cards(True))} x {GRPO_CARD_GIB:.0f} GB cards "
                f"with gradient checkpointing, {_cards(self.cards(False))} without (state {_gib(self.state_bytes)}, "
                f"update {_gib(self.update_bytes())}); {copes}")

    def table(self) -> str:
        out = [f"GRPO beside it (full-parameter, Adam{', KL reference model' if self.kl else ''}, "
               f"{self.context_tokens} tokens per sequence of which {self.completion_tokens} completion, "
               f"{GROUP_SIZE} completions per prompt, one sequence per micro-batch)"]
        out += [f"  {line.what:<40}{_gib(line.bytes):>11}  {line.note}".rstrip() for line in self.state]
        rows = [("sampling (the group's KV and state)", self.sampling),
                ("saved activations, checkpointing", self.activations_checkpointed),
                ("saved activations, no checkpointing", self.activations_full),
                ("completion logits, log-softmax, gradient", self.logits),
                ("one MLP's backward (2 x intermediate)", self.backward_transients),
                ("gradients (the update's end)", self.gradients),
                ("one layer gathered (FSDP)", self.gathered)]
        out += [f"  {what:<40}{_gib(size):>11}" for what, size in rows]
        out.append(self.line())
        return "\n".join(out)


def _cards(count: int | None) -> str:
    return "no number of" if count is None else str(count)


def _gib(size: int) -> str:
    return f"{size / GIB:.2f} GiB"


def activation_bytes(shape: ModelShape, s: int, tokens: int, checkpointing: bool) -> int:
    """Saved activations of one sequence of `tokens` at the backward's start (the embedding's output and the final
    norm's included)."""
    edges = s * shape.hidden + _norm_bytes(shape, s)
    if checkpointing:  # each layer's input, and one layer's activations recomputed at a time
        per_token = shape.hidden * s * (shape.full_attention_layers + shape.linear_layers)
        per_token += max(saved_bytes_per_token(shape, s).values())
    else:
        per_token = _layers_saved_bytes(shape, s)
    return (per_token + edges) * tokens


def logits_bytes(shape: ModelShape, s: int, completion: int) -> int:
    """The completion's logits, their log-softmax (TRL's selective_log_softmax, row by row in 16-bit, or fp32
    logsumexp terms) and the logits' gradient."""
    return 3 * shape.vocab * s * completion


def grpo_columns(shape: ModelShape, dtype: str, context: int, completion: int, *, kl: bool, checkpointing: bool,
                 copes: MemoryPlan | None) -> GRPOPlan:
    """GRPO for `shape` in `dtype`, one sequence of `context` tokens of which `completion` are generated."""
    s, parameters = {"float32": 4, "bfloat16": 2, "float16": 2}[dtype], shape.parameters
    state = [PlanLine("weights", parameters * s, f"{parameters:,} x {s} B"),
             PlanLine("gradients", parameters * s, "model dtype"),
             PlanLine("fp32 masters", parameters * FP32 if s < FP32 else 0,
                      "of 16-bit weights" if s < FP32 else "none"),
             PlanLine("Adam moments", 2 * parameters * FP32, "2 x fp32"),
             PlanLine("reference model", parameters * s if kl else 0, "KL on" if kl else "KL off")]
    # Sampling: the group's rows, KV and delta-net state over the whole context, and their prompts' prefill.
    sampling = GROUP_SIZE * (kv_bytes_per_token(shape, s) * context + recurrent_bytes_per_row(shape, s))
    sampling += GROUP_SIZE * (context - completion) * max(saved_bytes_per_token(shape, s).values())
    layers = shape.full_attention_layers + shape.linear_layers
    largest_layer = (parameters - shape.vocab * shape.hidden) // max(layers, 1)
    return GRPOPlan(shape, dtype, context, completion, kl, checkpointing, state, sampling,
                    activation_bytes(shape, s, context, False), activation_bytes(shape, s, context, True),
                    logits_bytes(shape, s, completion), shape.vocab * shape.hidden * s,
                    # measured at the backward's peak (reduced Qwen3, 8K): two [tokens, intermediate] gradients
                    # beside the recomputed layer's saved tensors
                    backward_transients=2 * shape.intermediate * s * context, gradients=parameters * s,
                    gathered=2 * largest_layer * s, copes=copes)


def grpo_plan(cfg: TrainConfig, plan: MemoryPlan, *, kl: bool = True, checkpointing: bool = True) -> GRPOPlan:
    """GRPO for `plan`'s model, dtype and context (a PROMPT_TOKENS prompt, the rest generated), beside the CoPES
    plan of the same run on one COPES_CARD_GIB card."""
    context = plan.rollout.context_tokens
    same_card = plan.card_bytes == COPES_CARD_GIB * GIB and plan.device == "cuda"
    copes = plan if same_card else plan_for(replace(cfg, device="cuda", device_memory_gib=COPES_CARD_GIB,
                                                    rollout_batch=None))
    return grpo_columns(plan.shape, plan.dtype, context, max(context - PROMPT_TOKENS, 1), kl=kl,
                        checkpointing=checkpointing, copes=copes)

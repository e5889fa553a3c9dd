"""Measured memory of one GRPO update and one ES member, every allocation counted (tests/helpers/live_bytes.py's
dispatch mode, independent of the allocator), on the Qwen3.5-4B (hybrid) and Qwen3-4B (full attention) fixtures'
architectures at reduced width. tests/plan/test_plan_grpo.py checks the plan's GRPO column against these peaks and
bench/memory_context.py sweeps them over context.

One GRPO update, as a careful user runs it (TRL's GRPOTrainer, one micro-batch):
  1. sampling: the group's completions from the prompt, no gradients (`generate`, KV cache on);
  2. the reference model's log-probabilities of the completion tokens, no gradients (when KL is on);
  3. forward + backward over prompt + completion with only the completion's logits kept (`logits_to_keep`),
     TRL's `selective_log_softmax`, the clipped-ratio loss with the KL term; gradient checkpointing optional
     (non-reentrant, transformers' `gradient_checkpointing_enable`);
  4. a fused AdamW step (fp32 moments), gradients set to None.
The Adam moments of an earlier update are live throughout (a second update is measured: the steady state).
"""

from __future__ import annotations

import contextlib
import copy
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import AutoModelForCausalLM

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tests"))

from helpers.live_bytes import LiveBytes  # noqa: E402
from helpers.reduced_models import REDUCED, reduced  # noqa: E402

VOCAB = REDUCED["qwen3"][1]["vocab_size"]

aten = torch.ops.aten
# The ops whose bfloat16 CPU kernels are slow without AVX512-BF16: on an AVX2 CI core a 2048x1024 @ 1024x1024
# product took 9.2 s in bfloat16 against 0.11 s in float32, and a 16K-token update ran 14 minutes.
_SLOW_IN_BF16 = {aten.mm.default, aten.addmm.default, aten.bmm.default, aten.baddbmm.default,
                 aten._scaled_dot_product_flash_attention_for_cpu.default,
                 aten._scaled_dot_product_flash_attention_for_cpu_backward.default}


class _Float32Arithmetic(TorchDispatchMode):
    """Runs the slow bfloat16 ops in float32 and returns what the bfloat16 op returns (each output's dtype read from
    its meta kernel). What is measured here is bytes, not values: every tensor an op hands back has the shape, dtype
    and size of the real op's, and the float32 temporaries live inside the op, unseen by LiveBytes above it."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func not in _SLOW_IN_BF16 or not any(isinstance(a, torch.Tensor) and a.dtype == torch.bfloat16
                                                for a in args):
            return func(*args, **kwargs)
        like = func(*[a.to("meta") if isinstance(a, torch.Tensor) else a for a in args], **kwargs)
        out = func(*[a.float() if isinstance(a, torch.Tensor) and a.dtype == torch.bfloat16 else a for a in args],
                   **kwargs)
        if isinstance(out, torch.Tensor):
            return out.to(like.dtype)
        return tuple(o.to(m.dtype) if isinstance(o, torch.Tensor) else o for o, m in zip(out, like))


@contextlib.contextmanager
def _fast_on_cpu(model: torch.nn.Module) -> Iterator[None]:
    """`_Float32Arithmetic` for a model on the CPU; on a GPU the bfloat16 kernels are the fast ones."""
    if next(model.parameters()).device.type != "cpu":
        yield
        return
    with _Float32Arithmetic():
        yield


def reduced_config(name: str):
    """The fixture's config at reduced width (tests/helpers/reduced_models.py), with room for long contexts."""
    path, widths = REDUCED[name]
    config = reduced(path, **widths)
    text = config.get_text_config()
    text.max_position_embeddings = max(text.max_position_embeddings, 1 << 17)
    return config


def reduced_model(name: str, dtype: torch.dtype = torch.float32, seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(reduced_config(name), dtype=dtype).eval()


@dataclass(frozen=True)
class GRPOPeaks:
    """Bytes allocated beyond the weights and the Adam moments of an earlier update, at each phase's peak."""

    sampling: int
    update: int  # reference log-probs, forward + backward, the Adam step
    moments: int  # the fp32 Adam moments (live throughout, counted here, not in the peaks)

    @property
    def peak(self) -> int:
        return max(self.sampling, self.update) + self.moments


def _completion_logprobs(model: torch.nn.Module, sequences: torch.Tensor, completion: int) -> torch.Tensor:
    from trl.trainer.utils import selective_log_softmax

    logits = model(input_ids=sequences, logits_to_keep=completion + 1, use_cache=False).logits[:, :-1]
    return selective_log_softmax(logits, sequences[:, -completion:])


def _update(model, reference, optimizer, sequences: torch.Tensor, completion: int, beta: float) -> None:
    advantages = torch.linspace(-1.0, 1.0, sequences.shape[0])[:, None]  # the group's normalised rewards
    if reference is not None:
        with torch.no_grad():
            reference_logprobs = _completion_logprobs(reference, sequences, completion)
    logprobs = _completion_logprobs(model, sequences, completion)
    ratio = torch.exp(logprobs - logprobs.detach())
    loss = -(ratio * advantages)
    if reference is not None:
        delta = reference_logprobs - logprobs
        loss = loss + beta * (torch.exp(delta) - delta - 1)
    loss.mean().backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def grpo_update_peaks(model: torch.nn.Module, prompts: torch.Tensor, new_tokens: int, *, checkpointing: bool,
                      beta: float = 0.0) -> GRPOPeaks:
    """One GRPO update of `model` on the group `prompts` [rows, tokens] (the steady state: the optimizer's moments
    exist from a first update, run before the measured one)."""
    with _fast_on_cpu(model):
        return _grpo_update_peaks(model, prompts, new_tokens, checkpointing=checkpointing, beta=beta)


def _grpo_update_peaks(model: torch.nn.Module, prompts: torch.Tensor, new_tokens: int, *, checkpointing: bool,
                       beta: float) -> GRPOPeaks:
    reference = copy.deepcopy(model).eval() if beta else None
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.config.use_cache = True
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6, fused=True)
    sample = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=True, pad_token_id=0)
    existing = [*model.parameters(), *model.buffers(), prompts]
    if reference is not None:
        existing += [*reference.parameters(), *reference.buffers()]
    with torch.no_grad():
        sequences = model.generate(prompts, **sample)
    model.train()
    _update(model, reference, optimizer, sequences, new_tokens, beta)  # creates the moments
    moments = [value for state in optimizer.state.values() for value in state.values() if value.dim()]
    model.eval()
    with torch.no_grad(), LiveBytes([*existing, *moments]) as sampling:
        sequences = model.generate(prompts, **sample)
    model.train()
    with LiveBytes([*existing, *moments, sequences]) as update:
        _update(model, reference, optimizer, sequences, new_tokens, beta)
    model.eval()
    if checkpointing:
        model.gradient_checkpointing_disable()
    return GRPOPeaks(sampling.peak, update.peak, sum(m.untyped_storage().nbytes() for m in moments))


def es_member_peak(model: torch.nn.Module, prompts: torch.Tensor, new_tokens: int, chunk: int = 512) -> int:
    """One ES member's rollout through copes' HF engine (chunked prefill, no full-prompt logits): the bytes it
    allocates beyond the weights (the member's perturbation is in place: nothing more on the device)."""
    from copes.rollout.hf_engine import HFEngine

    engine = HFEngine(model, prefill_chunk_tokens=chunk)
    rows = prompts.tolist()
    with _fast_on_cpu(model), torch.no_grad(), LiveBytes([*model.parameters(), *model.buffers(), prompts]) as live:
        engine.start_rollout()
        engine.generate_ids(rows, [new_tokens] * len(rows), eos=set(), keys=list(range(len(rows))))
    return live.peak

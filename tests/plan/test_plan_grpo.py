"""The memory plan's GRPO column (copes.plan.grpo): `copes-run --plan` prints a GRPO line for the same model
and context, and the column's update lines (saved activations with and without gradient checkpointing, the
completion's logits, the embedding's gradient, the gradients) are validated against the peak of one real GRPO
update (sampling, the reference-free clipped loss over prompt + completion with TRL's selective_log_softmax,
backward, a fused AdamW step in its steady state) measured at reduced width, every allocation counted."""

from __future__ import annotations

import sys

import pytest
import torch

from copes.config.options import build_config
from copes.plan.grpo import grpo_columns, grpo_plan
from copes.plan.memory import GIB, model_shape, plan_for

from helpers.cli_runs import copes_run
from helpers.paths import FIXTURES, REPO

pytest.importorskip("trl", reason="the GRPO update uses TRL's selective_log_softmax")
sys.path.insert(0, str(REPO / "bench"))

from common import grpo_memory  # noqa: E402

QWEN35 = FIXTURES / "qwen3.5-4b"


@pytest.mark.slow
@pytest.mark.parametrize("checkpointing", [False, True])
@pytest.mark.parametrize("name", ["qwen3.5", "qwen3"])
def test_the_grpo_update_peak_matches_the_plan(name, checkpointing):
    """Measured / planned update bytes within the 0.8-1.05 band the ES column meets (bf16, one sequence of 320
    tokens of which 32 generated)."""
    torch.set_num_threads(1)
    context, completion = 320, 32
    model = grpo_memory.reduced_model(name, torch.bfloat16)
    prompts = torch.randint(1, grpo_memory.VOCAB - 1, (1, context - completion),
                            generator=torch.Generator().manual_seed(0))
    peaks = grpo_memory.grpo_update_peaks(model, prompts, completion, checkpointing=checkpointing)
    columns = grpo_columns(model_shape(grpo_memory.reduced_config(name)), "bfloat16", context, completion, kl=False,
                           checkpointing=checkpointing, copes=None)
    ratio = peaks.update / columns.update_bytes()
    assert 0.8 <= ratio <= 1.05, (ratio, peaks, columns.update_bytes())


@pytest.mark.slow
def test_a_long_context_grpo_update_counts_the_mlps_backward():
    """Guards #39: at 16K tokens on the full-attention Qwen3 with checkpointing the update measured 1.07 of the
    plan (1.08 at 32K), the excess growing with context: the backward of the recomputed layer's MLP holds two
    [tokens, intermediate] gradients beside its saved tensors, which the plan did not count. At 8K (a third of the
    16K run's CPU time) the update measures 0.91 of the plan, and 1.09 of a plan without those gradients."""
    torch.set_num_threads(1)
    context, completion = 8192, 32
    model = grpo_memory.reduced_model("qwen3", torch.bfloat16)
    prompts = torch.randint(1, grpo_memory.VOCAB - 1, (1, context - completion),
                            generator=torch.Generator().manual_seed(0))
    peaks = grpo_memory.grpo_update_peaks(model, prompts, completion, checkpointing=True)
    columns = grpo_columns(model_shape(grpo_memory.reduced_config("qwen3")), "bfloat16", context, completion,
                           kl=False, checkpointing=True, copes=None)
    assert 0.8 <= peaks.update / columns.update_bytes() <= 1.05, (peaks.update, columns.update_bytes())


def test_grpo_on_qwen35_4b_needs_more_cards_as_context_grows_while_copes_holds_one():
    """The paper's comparison, planned: at 8K / 32K / 128K the GRPO state is the same (16 B per parameter and a
    bf16 reference model) and its activations grow; CoPES keeps at least one row on one 24 GB card."""
    cards = []
    for context in (8192, 32768, 131072):
        cfg = build_config({"model": str(QWEN35), "task": "gsm8k", "device": "cuda", "device_memory_gib": 24,
                            "tools": False, "max_new_tokens": context - 512, "max_context_tokens": context})
        plan = plan_for(cfg)
        grpo = grpo_plan(cfg, plan)
        assert grpo.state_bytes == 4_205_751_296 * (2 + 2 + 4 + 8 + 2)
        assert grpo.copes.fits and grpo.copes.rows >= 1
        assert grpo.activations(False) > 10 * grpo.activations(True)
        cards.append(grpo.cards(True))
        assert "GRPO" in grpo.line() and f"{context} tokens" in grpo.line()
    assert cards == sorted(cards) and cards[0] >= 2 and cards[-1] > cards[0], cards
    assert grpo.peak_bytes() > 48 * GIB


@pytest.mark.integration
def test_cli_plan_prints_the_grpo_line_for_the_same_model_and_context():
    result = copes_run("--plan", "--model", str(QWEN35), "--task", "gsm8k", "--device", "cuda", "--no-tools",
                       "--max-new-tokens", "32256", "--max-context-tokens", "32768")
    assert result.returncode == 0, result.stderr
    line = result.stdout.splitlines()[-1]
    assert line.startswith("GRPO at 32768 tokens:") and "48 GB cards" in line and "24 GB card" in line, line

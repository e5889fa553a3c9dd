"""The options the engine hands vllm.LLM (copes.rollout.vllm.engine.engine_options), checked on CPU for both
devices without starting an engine: what is said here about CUDA is the arguments, not GPU behaviour.

- a Qwen3.5 wrapper config loads as the text-only class: its text config, tied as the wrapper says;
- hybrid (gated delta-net) models cache prefixes in mamba_cache_mode "align";
- one scheduler step's token budget is the plan's (STEP_TOKENS);
- on CUDA the start-up check asks for the card's free share (at most vLLM's 0.9), not 90% of the card, and
  --device cuda:N puts the one in-process worker on N;
- vLLM's compile cache is disabled on CPU only.
"""

from __future__ import annotations

import os
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch
from transformers import AutoConfig

pytest.importorskip("vllm", reason="vLLM is not installed (pip install -e '.[vllm]'; see the README)")

from copes.rollout.vllm import STEP_TOKENS  # noqa: E402
from copes.rollout.vllm.engine import GIB, engine_options  # noqa: E402

from helpers.paths import FIXTURES, REPO  # noqa: E402

pytestmark = pytest.mark.vllm

WRAPPER = AutoConfig.from_pretrained(FIXTURES / "qwen3.5-4b")  # Qwen3_5ForConditionalGeneration, tied
DENSE = AutoConfig.from_pretrained(FIXTURES / "qwen3-4b")


def test_cpu_options_load_a_qwen35_wrapper_as_the_text_only_class() -> None:
    options = engine_options(WRAPPER, device=torch.device("cpu"), dtype=torch.bfloat16, kv_cache_gib=2)
    assert options["kv_cache_memory_bytes"] == 2 * GIB and options["enforce_eager"]
    assert options["max_num_batched_tokens"] == STEP_TOKENS and options["mamba_cache_mode"] == "align"
    assert "language_model_only" not in options and "gpu_memory_utilization" not in options
    text = options["hf_overrides"](AutoConfig.from_pretrained(FIXTURES / "qwen3.5-4b"))
    assert text.model_type == "qwen3_5_text" and text.architectures == ["Qwen3_5ForCausalLM"]
    assert text.tie_word_embeddings and text.num_hidden_layers == 32


def test_cuda_options_honour_the_device_and_the_free_share() -> None:
    """Guards `--device cuda:N` being ignored by vLLM in one process (its worker went to cuda:0) and the start-up
    check refusing a card less than 90% free although the KV size is given."""
    options = engine_options(DENSE, device=torch.device("cuda:1"), dtype=torch.bfloat16, kv_cache_gib=6,
                             free_share=0.55)
    assert options["gpu_memory_utilization"] == 0.55 and not options["enforce_eager"]
    assert "mamba_cache_mode" not in options and "hf_overrides" not in options
    executor = object.__new__(options["distributed_executor_backend"])  # its device: vLLM's platform type alone
    executor.vllm_config = SimpleNamespace(device_config=SimpleNamespace(device=torch.device("cuda")))
    assert executor._distributed_args()[2] == 1  # the in-process worker's local rank: cuda:1
    on_zero = engine_options(DENSE, device=torch.device("cuda:0"), dtype=torch.bfloat16, kv_cache_gib=6,
                             free_share=0.97)
    assert on_zero["gpu_memory_utilization"] == 0.9 and "distributed_executor_backend" not in on_zero


def test_compile_cache_is_kept_unless_on_cpu() -> None:
    """Guards VLLM_DISABLE_COMPILE_CACHE=1 being set at import, CUDA included (a full recompile every start)."""
    env = {key: value for key, value in os.environ.items() if key != "VLLM_DISABLE_COMPILE_CACHE"}
    code = "import os, copes.rollout.vllm.engine; print(os.environ.get('VLLM_DISABLE_COMPILE_CACHE'))"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=REPO,
                            timeout=300)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "None"

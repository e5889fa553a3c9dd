"""The memory plan of a vLLM run (copes.plan.memory's vLLM section): vLLM's own footprint (weights, one scheduler step,
a paged KV pool that holds every row's KV and delta-net state), no cap on rows, and on CUDA a KV pool sized from
what the card leaves rather than a 1 GiB default. The options the engine hands vllm.LLM are
tests/rollout/vllm/test_vllm_options.py."""

from __future__ import annotations

from copes.config.options import build_config
from copes.plan.memory import GIB, layer_activation_bytes_per_token, plan_for
from copes.rollout.vllm import STEP_TOKENS

from helpers.installed import pretend_installed
from helpers.paths import FIXTURES

QWEN35 = FIXTURES / "qwen3.5-4b"
HEADLINE = {"model": str(QWEN35), "task": "gsm8k", "device": "cuda", "device_memory_gib": 24, "dtype": "bfloat16",
            "population": 40, "subspaces": 4, "prompt_batch": 64, "rollout_engine": "vllm"}


def test_vllm_rows_are_not_capped() -> None:
    """Guards the plan capping vLLM at 2 rows per call on 24 GB as if vLLM prefilled every row unchunked: vLLM
    queues what its pool cannot hold, so every row of the prompt batch goes to one generate call."""
    plan = plan_for(build_config(HEADLINE))
    assert plan.fits and plan.rows == 64 and plan.batch_size is None
    assert plan.per_row == []
    step = {line.what: line.bytes for line in plan.per_call}
    per_token = max(layer_activation_bytes_per_token(plan.shape, 2).values())
    assert step["step activations"] == per_token * STEP_TOKENS


def test_vllm_kv_pool_on_cuda_is_what_the_card_leaves() -> None:
    """Guards vLLM's KV pool defaulting to 1 GiB on CUDA: without --vllm-kv-cache-gib it is the usable memory left
    after the weights and one scheduler step, and that is what the run starts vLLM with."""
    plan = plan_for(build_config(HEADLINE))
    kv = {line.what: line.bytes for line in plan.fixed}["vLLM KV cache"]
    assert kv > 8 * GIB and plan.vllm_kv_cache_gib == kv / GIB
    assert 0 <= plan.usable_bytes - plan.peak_bytes() < 1 << 20
    stated = plan_for(build_config({**HEADLINE, "vllm_kv_cache_gib": 6}))
    assert stated.vllm_kv_cache_gib == 6
    on_cpu = plan_for(build_config({**HEADLINE, "device": "cpu", "device_memory_gib": 24}))
    assert on_cpu.vllm_kv_cache_gib == 1.0


def test_a_card_too_small_for_vllm_is_one_line() -> None:
    plan = plan_for(build_config({**HEADLINE, "device_memory_gib": 8}))
    assert not plan.fits and plan.advice.startswith("vLLM needs") and "larger device" in plan.advice


def test_vllm_on_cpu_plans_its_load_with_the_checkpoint_mapped() -> None:
    """Guards the dress rehearsal's copes-vllm row at 1.45 of its plan: vLLM reads the checkpoint through one mapping,
    so while it loads, RSS holds the file's pages beside vLLM's copy (a 4B bf16 checkpoint: 7.8 GiB twice). On a CPU
    that load is the peak; on CUDA the mapped pages are host memory and the plan has no load line."""
    plan = plan_for(build_config({**HEADLINE, "device": "cpu", "device_memory_gib": 24, "prompt_batch": 1,
                                  "vllm_kv_cache_gib": 1.0, "vllm_cpu_weights": "plain"}))
    fixed = {line.what: line.bytes for line in plan.fixed}
    (mapped,) = plan.load
    assert plan.shape.stored_dtype == "bfloat16" and mapped.bytes == fixed["weights"]
    assert plan.load_bytes == fixed["weights"] + fixed["host process"] + mapped.bytes
    assert plan.peak_bytes() == plan.load_bytes > plan.fixed_bytes + plan.rollout_bytes(plan.rows)
    assert "checkpoint pages mapped" in plan.table() and "max(load" in plan.table()
    assert plan_for(build_config(HEADLINE)).load == []


def test_low_rank_on_vllm_plans_without_the_tied_embedding() -> None:
    """Guards EGGROLL on vLLM planning an 8.3 GiB update for the tied embedding, which its adapters cannot carry and
    the run leaves out (copes.config.components): the update buffers are sized by the largest tensor it does train."""
    eggroll = {**HEADLINE, "algorithm": "eggroll", "prompt_batch": 16}
    on_vllm, on_hf = plan_for(build_config(eggroll)), plan_for(build_config({**eggroll, "rollout_engine": "hf"}))
    embedding = on_hf.shape.vocab * on_hf.shape.hidden
    assert on_hf.shape.largest_tensor == embedding and on_hf.shape.trainable == on_hf.shape.parameters
    assert on_vllm.shape.trainable == on_vllm.shape.parameters - embedding
    assert on_vllm.shape.largest_tensor == on_vllm.shape.intermediate * on_vllm.shape.hidden
    assert on_vllm.update_bytes < on_hf.update_bytes / 20


def test_vllm_on_cuda_plans_its_cuda_graphs() -> None:
    """Guards #53: vLLM's captured decode graphs hold a private pool on the card that the plan left out (the KV pool
    took what the card leaves, so the graphs had no room). On CPU vLLM runs eagerly: no graph line."""
    fixed = {line.what: line for line in plan_for(build_config(HEADLINE)).fixed}
    assert fixed["CUDA graphs"].bytes > 0.25 * GIB
    on_cpu = plan_for(build_config({**HEADLINE, "device": "cpu", "vllm_kv_cache_gib": 1.0}))
    assert "CUDA graphs" not in {line.what for line in on_cpu.fixed}


def test_auto_engine_plans_vllm_on_cuda_where_importable_and_names_it(monkeypatch) -> None:
    """Guards #53 (`--rollout-engine auto`, the new default): on CUDA with vLLM importable the plan is vLLM's, without
    it HF's (rows per generate call capped), on CPU always HF's; the table's first line names the engine."""
    pretend_installed(monkeypatch, {"vllm": True})
    auto = {**HEADLINE, "rollout_engine": "auto"}
    assert build_config({k: v for k, v in auto.items() if k != "rollout_engine"}).rollout_engine == "auto"
    plan = plan_for(build_config(auto))
    assert plan.engine == "vllm" and plan.per_row == [] and "engine vllm" in plan.table().splitlines()[0]
    pretend_installed(monkeypatch, {"vllm": False})
    plan = plan_for(build_config(auto))
    assert plan.engine == "hf" and plan.rows < 64 and "engine hf" in plan.table().splitlines()[0]
    assert "engine hf" in plan.summary()
    pretend_installed(monkeypatch, {"vllm": True})
    assert plan_for(build_config({**auto, "device": "cpu", "prompt_batch": 1})).engine == "hf"

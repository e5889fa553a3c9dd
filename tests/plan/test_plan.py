"""The memory plan (copes.plan.memory) at real shapes, on this CPU machine: exact parameter counts of the Qwen3.5-4B
and Qwen3-4B configs built on the meta device, the activation model against peaks measured on the same
architectures at reduced width, `copes-run --plan` for a 24 GB card without a GPU, and runs refused before
loading when they cannot fit."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from copes.config.options import build_config
from copes.plan.memory import (
    GIB,
    kv_bytes_per_token,
    layer_activation_bytes_per_token,
    load_config,
    model_shape,
    plan_for,
    plan_json,
    recurrent_bytes_per_row,
)

from helpers.cli_runs import copes_run
from helpers.live_bytes import LiveBytes
from helpers.paths import FIXTURES, REPO
from helpers.reduced_models import REDUCED
from helpers.reduced_models import reduced as _reduced

QWEN35, QWEN3 = FIXTURES / "qwen3.5-4b", FIXTURES / "qwen3-4b"
PAPER = {"task": "gsm8k", "device": "cuda", "population": 40, "subspaces": 4, "dtype": "bfloat16", "prompt_batch": 64}


def _qwen3_count(t) -> int:
    """Qwen3ForCausalLM's parameters from its config by hand: tied embedding, q/k/v/o, q/k norms, MLP, 2 norms."""
    q, kv = t.num_attention_heads * t.head_dim, t.num_key_value_heads * t.head_dim
    layer = 2 * t.hidden_size * (q + kv) + 2 * t.head_dim + 3 * t.hidden_size * t.intermediate_size + 2 * t.hidden_size
    return t.vocab_size * t.hidden_size + t.num_hidden_layers * layer + t.hidden_size


def _qwen35_count(t) -> int:
    """Qwen3.5's text model by hand: gated full attention (q doubled by the output gate) and gated delta-net
    layers (qkv / z / a / b projections, depthwise conv, A_log, dt_bias, gated norm, out_proj)."""
    h, mlp = t.hidden_size, 3 * t.hidden_size * t.intermediate_size + 2 * t.hidden_size
    q, kv = t.num_attention_heads * t.head_dim, t.num_key_value_heads * t.head_dim
    full = h * 2 * q + 2 * h * kv + q * h + 2 * t.head_dim
    keys, values = t.linear_num_key_heads * t.linear_key_head_dim, t.linear_num_value_heads * t.linear_value_head_dim
    heads = t.linear_num_value_heads
    conv = 2 * keys + values
    linear = (h * conv + h * values + 2 * h * heads + conv * t.linear_conv_kernel_dim + 2 * heads
              + t.linear_value_head_dim + values * h)
    kinds = t.layer_types
    return (t.vocab_size * h + kinds.count("full_attention") * (full + mlp)
            + kinds.count("linear_attention") * (linear + mlp) + h)


def test_meta_builds_count_the_4b_parameters_exactly():
    qwen3 = model_shape(load_config(str(QWEN3)))
    assert qwen3.parameters == _qwen3_count(AutoConfig.from_pretrained(QWEN3)) == 4_022_468_096  # card: 4.0B
    assert qwen3.parameters - 151936 * 2560 == 3_633_511_936  # the card's "3.6B non-embedding"
    qwen35 = model_shape(load_config(str(QWEN35)))
    assert qwen35.parameters == _qwen35_count(AutoConfig.from_pretrained(QWEN35).get_text_config()) == 4_205_751_296
    assert (qwen35.full_attention_layers, qwen35.linear_layers, qwen35.kv_heads, qwen35.head_dim) == (8, 24, 4, 256)
    # The estimates: 8.4 GB of bf16 weights, ~32 KiB of KV per token per row, ~50 MB delta-net state per row.
    assert kv_bytes_per_token(qwen35, 2) == 8 * 2 * 4 * 256 * 2
    assert recurrent_bytes_per_row(qwen35, 2) == 24 * (8192 * 4 * 2 + 32 * 128 * 128 * 4)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("name", sorted(REDUCED))
def test_prefill_peak_matches_the_plan_within_15_percent(name, dtype):
    """A left-padded prefill (4 rows x 128 tokens, cache on, last position's logits) of the real transformers
    layers, its every allocation counted; the plan's cache + one layer's transients + mask + logits."""
    path, widths = REDUCED[name]
    config = _reduced(path, **widths)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=dtype).eval()
    rows, tokens = 4, 128
    ids = torch.randint(0, 4000, (rows, tokens))
    mask = torch.ones(rows, tokens, dtype=torch.long)
    mask[1:, : tokens // 4] = 0
    with torch.no_grad(), LiveBytes([*model.parameters(), *model.buffers(), ids, mask]) as live:
        model(input_ids=ids, attention_mask=mask, use_cache=True, logits_to_keep=1)
    s = dtype.itemsize
    shape = model_shape(config)
    planned = (kv_bytes_per_token(shape, s) * rows * tokens + recurrent_bytes_per_row(shape, s) * rows
               + max(layer_activation_bytes_per_token(shape, s).values()) * rows * tokens
               + rows * tokens * tokens + rows * shape.vocab * (s + 4))
    assert 0.85 <= live.peak / planned <= 1.15, (live.peak, planned)


def test_qwen35_4b_with_the_papers_settings_fits_a_24gb_card():
    plan = plan_for(build_config({"model": str(QWEN35), "device_memory_gib": 24, **PAPER}))
    assert plan.fits and 1 <= plan.rows < 64, plan.table()
    assert plan.peak_bytes(plan.rows + 1) > plan.usable_bytes  # the most rows that fit
    assert plan.batch_size == plan.rows
    as_json = json.loads(plan_json(plan))  # what the GPU check compares its measured peaks with
    assert as_json["rows"] == plan.rows and as_json["peak_bytes"] == plan.peak_bytes()
    lines = {line.what: line.bytes for line in plan.fixed}
    assert lines["weights"] == 4_205_751_296 * 2 and lines["fp32 masters"] == lines["Adam moments"] == 0


def test_a_24_gib_card_plans_at_most_11_rows_with_the_allocators_rounding():
    """Guards #53: the 12 rows planned on a 24.00 GiB card left 36 MiB, with each kept K/V tensor's rounding up to
    the CUDA caching allocator's 2 MiB block not counted. On CUDA it is a per-row line; a CPU plan has none."""
    settings = {"model": str(QWEN35), "device_memory_gib": 24, **PAPER, "device": "cuda"}
    plan = plan_for(build_config(settings))
    rounding = {line.what: line.bytes for line in plan.per_row}["allocator rounding"]
    assert rounding == 2 * plan.shape.full_attention_layers * (2 << 20)
    assert plan.fits and plan.rows <= 11 and plan.peak_bytes(plan.rows + 1) > plan.usable_bytes
    on_cpu = plan_for(build_config({**settings, "device": "cpu"}))
    assert "allocator rounding" not in {line.what for line in on_cpu.per_row}


@pytest.mark.integration
def test_cli_plan_without_a_gpu_prints_the_table_for_a_24gb_card():
    result = copes_run("--plan", "--model", str(QWEN35), "--task", "gsm8k", "--device", "cuda")
    assert result.returncode == 0, result.stderr
    assert "24.00 GiB default (no device visible)" in result.stdout and "KV cache" in result.stdout
    assert "fits: peak" in result.stdout  # the CoPES summary; the GRPO column and its line follow it (#39)


def test_plan_names_what_to_change_when_adam_cannot_fit():
    plan = plan_for(build_config({"model": str(QWEN3), "device_memory_gib": 24, "optimizer": "adam", **PAPER}))
    assert not plan.fits and "--optimizer sgd" in plan.advice and "--restore host" in plan.advice
    small = plan_for(build_config({"model": str(QWEN35), "device_memory_gib": 24, "rollout_batch": 64, **PAPER}))
    assert not small.fits and "use --rollout-batch" in small.advice


def test_the_refusal_of_a_card_too_small_states_no_zero_or_negative_figure():
    """Issue #54: a 0.5 GiB card was "-0.53 GiB usable", and freeing "the 0.00 GiB device backup" was advised."""
    from copes.errors import ConfigError
    from copes.plan.memory import check_plan

    cfg = build_config({"model": "tiny", "device_memory_gib": 0.5})
    with pytest.raises(ConfigError) as refused:
        check_plan(cfg, device="cuda", uses_tools=False, say=lambda line: None)
    message = str(refused.value)
    assert "needs " in message and "try " in message, message
    assert not re.search(r"-\d", message) and "0.00 GiB" not in message, message


@pytest.mark.integration
def test_a_run_that_cannot_fit_is_refused_before_loading(tmp_path):
    """The model's weights file is garbage: loading it would fail, so the refusal came from the plan, first."""
    model = tmp_path / "qwen3-4b"
    model.mkdir()
    (model / "config.json").write_bytes((QWEN3 / "config.json").read_bytes())
    (model / "model.safetensors").write_bytes(b"not weights")
    result = copes_run("--model", str(model), "--task", "gsm8k", "--optimizer", "adam", "--device", "cpu",
                       "--device-memory-gib", "24", "--output-dir", str(tmp_path / "out"))
    assert result.returncode == 2
    assert "does not fit" in result.stderr and "--optimizer sgd" in result.stderr, result.stderr


def test_the_run_takes_the_plans_rows_per_generate_call(tmp_path):
    from copes.run.trainer import Trainer

    settings = {"steps": 1, "eval_size": 0, "prompt_batch": 8, "output_dir": str(tmp_path), "device": "cpu"}
    roomy = plan_for(build_config(settings))
    card = (roomy.fixed_bytes + 3.5 * roomy.row_bytes + GIB) / 0.95 / GIB  # room for 3 rows
    trainer = Trainer(build_config({**settings, "device_memory_gib": card}), progress=False)
    assert trainer.plan.rows == 3 and trainer.agent.batch_size == 3


def test_setup_floors_match_what_the_code_uses():
    """transformers 5.5 is the first with `transformers.cache_utils.LinearAttentionLayer`, which the HF engine
    imports (#35 reproduced 5.2, the old floor, failing even `--plan`); triton.knobs first ships in triton 3.4.0;
    torch.autograd.graph.increment_version takes a list of tensors from torch 2.5 (2.4's _increment_version takes
    one tensor)."""
    import re

    text = (REPO / "setup.py").read_text()
    floors = {name: tuple(map(int, version.split(".")))
              for name, version in re.findall(r'"(torch|transformers|triton)>=([\d.]+)"', text)}
    assert floors == {"torch": (2, 5), "transformers": (5, 5), "triton": (3, 4)}
    assert "triton>=3.2" not in text


def test_a_gpu_model_is_loaded_straight_onto_its_device(monkeypatch):
    """The weights go from the checkpoint to the GPU through device_map, never through a whole host copy (the old
    load read them onto the CPU, then `.to(device)`); on the CPU nothing changes. The GPU check runs it for real."""
    import copes.modeling as modeling

    asked = {}

    def from_pretrained(path, **kwargs):
        asked.update(kwargs)
        raise OSError("recorded")

    monkeypatch.setattr(modeling, "resolve_device", lambda device: torch.device(device))
    monkeypatch.setattr(modeling.AutoModelForCausalLM, "from_pretrained", from_pretrained)
    with pytest.raises(modeling.UserError, match="recorded"):
        modeling.load_model("tiny", device="cuda:1", dtype="bfloat16")
    assert asked == {"dtype": torch.bfloat16, "device_map": {"": torch.device("cuda:1")}}
    asked.clear()
    with pytest.raises(modeling.UserError, match="recorded"):
        modeling.load_model("tiny", device="cpu")
    assert asked == {"dtype": torch.float32}


def test_the_vllm_engine_plans_its_own_kv_cache():
    settings = {"model": str(QWEN35), "device_memory_gib": 24, **PAPER}
    plan_for(build_config(settings))  # the HF engine plans the same settings too
    vllm = plan_for(build_config({**settings, "rollout_engine": "vllm", "vllm_kv_cache_gib": 6}))
    assert {line.what: line.bytes for line in vllm.fixed}["vLLM KV cache"] == 6 * GIB
    assert not {"KV cache", "kept KV copy"} & {line.what for line in vllm.per_row}


def _two_turn_peak(model, rows: int, chunk: int, new: int, observation: int,
                   decode: str = "eager") -> tuple[int, int]:
    """The measured peak of two turns of copes' HF engine (its `decode` loop) on `rows` ragged rows (every row ends
    its first turn as on a tool call, so its cache is kept), and the second turn's store columns."""
    from copes.rollout.hf_engine import HFEngine

    torch.manual_seed(1)
    prompts = [torch.randint(0, 4000, (length,)).tolist() for length in (96, 80, 72, 64) * (rows // 4)]
    engine, keys = HFEngine(model, prefill_chunk_tokens=chunk, decode=decode), list(range(rows))
    with torch.no_grad(), LiveBytes([*model.parameters(), *model.buffers()]) as live:
        engine.start_rollout()
        first = engine.generate_ids(prompts, [new + 1] * rows, eos=set(), keys=keys, remember=True,
                                    ends_on_stop=lambda ids, tokens: len(tokens) >= new)
        context = [p + t + list(range(5, 5 + observation)) for p, t in zip(prompts, first)]
        engine.generate_ids(context, [new - 4 * (row % 4) for row in keys], eos=set(), keys=keys, remember=True)
    return live.peak, max(map(len, context)) + new


@pytest.mark.parametrize("decode", ["eager", "static"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("name", sorted(REDUCED))
def test_the_hf_engines_two_turn_peak_matches_the_plan(name, dtype, decode):
    """Two turns of copes' HF engine (chunked prefill, caches kept across the turns, ragged rows leaving the
    decode batch, or under the static decode CUDA runs every row staying in it) at reduced width, every allocation
    counted. What each row adds (16 rows against 8) is the
    plan's per-row lines (KV store, kept copy, delta-net state, decode step) to 0.7-1.25x (measured 0.76-0.97);
    the whole peak is at most the plan's, which adds the per-call prefill chunk to the rows' peak though the two
    do not coincide (measured 0.72-0.96 of it)."""
    from copes.plan.memory import RolloutShape, _rollout_lines

    path, widths = REDUCED[name]
    config = _reduced(path, **widths)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=dtype).eval()
    chunk, new, observation = 32, 16, 16
    # At fewer rows the prefill chunk's activations, not the rows' caches, make the peak.
    (eight, columns), (sixteen, _) = (_two_turn_peak(model, rows, chunk, new, observation, decode)
                                      for rows in (8, 16))
    rollout = RolloutShape(2, 96, new, observation, columns, chunk, True)
    per_row, per_call, _ = _rollout_lines(model_shape(config), rollout, dtype.itemsize)
    row_bytes, call_bytes = sum(line.bytes for line in per_row), sum(line.bytes for line in per_call)
    assert 0.7 <= (sixteen - eight) / 8 / row_bytes <= 1.25, (sixteen - eight) / 8 / row_bytes
    assert 0.5 <= sixteen / (call_bytes + 16 * row_bytes) <= 1.0, sixteen / (call_bytes + 16 * row_bytes)


@pytest.mark.parametrize("name", sorted(REDUCED))
def test_one_members_long_context_rollout_matches_the_plan(name):
    """One row of 4K tokens through the HF engine's chunked prefill, bf16, every allocation counted, within the
    0.8-1.05 band (measured 0.86-1.01 from 1K to 64K by bench/memory_context.py). Guards #39: the plan added one
    layer's K/V repeated to the query heads on top of the heaviest layer's activations, though layers run one at a
    time, and counted it with one KV head, where transformers' repeat_kv is a stride-0 view (0.76 and 0.78 here)."""
    from copes.plan.memory import RolloutShape, _rollout_lines
    from copes.rollout.hf_engine import HFEngine

    path, widths = REDUCED[name]
    config = _reduced(path, **widths)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).eval()
    context, new, chunk = 4096, 16, 512
    prompt = torch.randint(1, 4000, (context - new,), generator=torch.Generator().manual_seed(0)).tolist()
    engine = HFEngine(model, prefill_chunk_tokens=chunk)
    with torch.no_grad(), LiveBytes([*model.parameters(), *model.buffers()]) as live:
        engine.start_rollout()
        engine.generate_ids([prompt], [new], eos=set(), keys=[0])
    per_row, per_call, _ = _rollout_lines(model_shape(config), RolloutShape(1, context - new, new, 0, context, chunk,
                                                                            True), 2)
    planned = sum(line.bytes for line in per_row + per_call if not line.what.startswith("kept"))  # one turn: none kept
    assert 0.8 <= live.peak / planned <= 1.05, (live.peak, planned)


def test_the_plan_counts_a_prefill_chunk_once_per_call_and_the_caches_per_row():
    """The paper's Qwen3.5-4B tool run on the HF engine: the prefill's activation peak is one 512-position chunk,
    whatever the rows; a tool-less run (one batched generate) keeps its per-row unchunked prefill."""
    plan = plan_for(build_config({"model": str(QWEN35), "device_memory_gib": 24, **PAPER}))
    call = {line.what: line.bytes for line in plan.per_call}
    assert plan.rollout.chunked and plan.rollout.prefill_tokens == 512
    shape, context = plan.shape, plan.rollout.context_tokens
    repeated = 2 * shape.heads * shape.head_dim * context * 2  # a full-attention layer's K/V at the query heads
    per_token = layer_activation_bytes_per_token(shape, 2)
    assert call["prefill activations"] == max(512 * per_token["gated delta-net"], 512 * per_token["mlp"],
                                              512 * per_token["attention"] + repeated) > 512 * max(per_token.values())
    assert "prefill activations" not in {line.what for line in plan.per_row}
    assert plan.peak_bytes(3) - plan.peak_bytes(2) == plan.row_bytes
    smaller = plan_for(build_config({"model": str(QWEN35), "device_memory_gib": 24, **PAPER}), prefill_chunk_tokens=128)
    assert smaller.call_bytes < plan.call_bytes and smaller.row_bytes == plan.row_bytes
    toolless = plan_for(build_config({"model": str(QWEN35), "device_memory_gib": 24, "tools": False, **PAPER}))
    assert not toolless.rollout.chunked and not toolless.per_call
    assert "prefill activations" in {line.what for line in toolless.per_row}


@pytest.mark.parametrize("algorithm", ["eggroll", "copes-lowrank"])
def test_a_low_rank_population_plans_prompt_batch_times_members_rows(algorithm):
    """Guards #35: EGGROLL / copes-lowrank roll out prompt batch x population rows in one rollout (640 for the
    shipped 4B config) while the plan sized one member's 16 and gave the agent no batch size, so all 640 went to
    one generate call. The plan now counts the 640 and caps one call at the rows that fit."""
    settings = {**PAPER, "algorithm": algorithm, "population": 40, "prompt_batch": 16, "device_memory_gib": 24,
                **({"subspaces": 4} if algorithm == "copes-lowrank" else {"subspaces": 1})}
    plan = plan_for(build_config({"model": str(QWEN35), **settings}))
    assert plan.rows_per_step == plan.rows_wanted == 640
    assert plan.fits and 1 <= plan.rows < 640 and plan.peak_bytes(plan.rows + 1) > plan.usable_bytes, plan.table()
    assert plan.batch_size == plan.rows
    assert "640 rows per step" in plan.summary() and f"{plan.rows} per generate call" in plan.summary()


def test_a_low_rank_run_batches_its_population_by_the_plans_rows(tmp_path):
    """Guards #35: the trainer's agent takes the plan's rows per call for a batched population (it got None, every
    row in one call)."""
    from copes.run.trainer import Trainer

    settings = {"steps": 1, "eval_size": 0, "prompt_batch": 2, "population": 4, "algorithm": "eggroll",
                "subspaces": 1, "output_dir": str(tmp_path), "device": "cpu", "device_memory_gib": 8}
    roomy = plan_for(build_config(settings))
    assert roomy.rows_wanted == roomy.rows_per_step == 8 and roomy.batch_size is None
    card = (roomy.fixed_bytes + max(roomy.call_bytes, 0) + 3.5 * roomy.row_bytes + GIB) / 0.95 / GIB
    trainer = Trainer(build_config({**settings, "device_memory_gib": card}), progress=False)
    assert trainer.plan.rows == 3 and trainer.agent.batch_size == 3


def test_the_plan_counts_decodes_repeated_kv_without_pack_gqa(monkeypatch):
    """Guards #35: before transformers 5.23 (the device image's 5.17) a masked one-position SDPA call repeats every
    row's K/V to the query heads over the whole context (2.9 GiB per attention layer at 11 rows x 16K), which the
    plan did not count; it does when transformers lacks pack_gqa, and fits fewer rows."""
    from transformers.integrations import sdpa_attention

    cfg = build_config({"model": str(QWEN35), "device_memory_gib": 24, **PAPER})
    packed = plan_for(cfg)
    assert "decode K/V repeated" not in {line.what for line in packed.per_row}
    monkeypatch.delattr(sdpa_attention, "pack_gqa")
    repeated = plan_for(cfg)
    lines = {line.what: line.bytes for line in repeated.per_row}
    shape = repeated.shape
    assert lines["decode K/V repeated"] == 2 * shape.heads * shape.head_dim * repeated.rollout.context_tokens * 2
    assert repeated.row_bytes > packed.row_bytes and repeated.rows <= packed.rows


def test_the_context_cap_is_clamped_to_the_engines_longest_context_at_start(tmp_path):
    """Guards #35: --max-context-tokens (default 131072) was not clamped to what the engine takes (vLLM's
    max_model_len, the model's max_position_embeddings), so a long row was refused mid-run; the agent now ends
    such a row truncated at the engine's limit (64 positions for the embedded model)."""
    from copes.run.trainer import Trainer

    settings = {"steps": 1, "eval_size": 0, "prompt_batch": 2, "output_dir": str(tmp_path), "device": "cpu",
                "device_memory_gib": 8}
    trainer = Trainer(build_config(settings), progress=False)
    assert trainer.model.config.max_position_embeddings == 64
    assert trainer.agent.max_context_tokens == 64
    small = Trainer(build_config({**settings, "max_context_tokens": 48}), progress=False)
    assert small.agent.max_context_tokens == 48


def test_a_cpu_plan_counts_the_host_process_against_the_ram_budget():
    """Guards #35: `--device cpu` plans RAM, where the interpreter, torch and the kernels count too (0.74 GiB peak
    RSS measured for a reduced-width run whose model and rollout the plan put at 0.02 GiB); a card has none."""
    settings = {"model": str(QWEN35), "dtype": "bfloat16", "device_memory_gib": 22, "task": "gsm8k"}
    cpu = plan_for(build_config({**settings, "device": "cpu"}))
    cuda = plan_for(build_config({**settings, "device": "cuda"}))
    assert {line.what: line.bytes for line in cpu.fixed}["host process"] > 0.5 * GIB
    assert "host process" not in {line.what for line in cuda.fixed}
    assert cpu.card_source == "stated" and cpu.usable_bytes < 22 * GIB


def test_a_cpu_plan_budgets_available_memory_not_just_free_pages(monkeypatch):
    """Guards #35: the CPU plan took MemFree, which counts the page cache as used: right after a 4B checkpoint was
    read (8.4 GB of cache) a run that fits was refused. It takes MemAvailable."""
    from copes.plan import memory as plan_module

    meminfo = "MemTotal:       24000000 kB\nMemFree:          500000 kB\nMemAvailable:   20000000 kB\n"
    real = Path.read_text
    monkeypatch.setattr(Path, "read_text", lambda self, *a, **k: meminfo if str(self) == "/proc/meminfo"
                        else real(self, *a, **k))
    assert plan_module.available_host_bytes() == 20000000 * 1024

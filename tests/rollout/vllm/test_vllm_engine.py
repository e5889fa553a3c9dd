"""vLLM as the rollout engine (copes.rollout.vllm.engine): the weights live inside the engine and ES writes them
in place through HF-named views. Against the Hugging Face engine (the reference), on real tiny models:

- the views are the HF model's tensors bit for bit, after the same member's perturbation, after every restore
  mode, and after an update in every update precision;
- the engine generates what HF generates on the same weights, perturbed ones included, for a prompt longer than
  one KV block (no stale prefix cache);
- `copes-eval --rollout-engine vllm` scores the embedded model as `copes-eval` on HF does;
- `copes-run --rollout-engine vllm` trains the embedded model for 3 steps and resumes, and with fp32 greedy it
  ends with the weights and held-out accuracy of the same run on HF;
- with packed linear weights (vLLM's oneDNN copies) a generation after any weight write runs on the written
  weights, as the plain engine's does, and a generation after none repacks nothing.
- the prefix cache is dropped before a rollout exactly when a weight was written since the last one;
- a model claiming a 1M-token context starts with max_model_len capped to the KV budget, said in one line, and a
  budget below one sequence is one line, not a vLLM traceback;
- bench/device/vllm_gpu_check.py's perturb -> generate -> restore -> generate check and its LoRA canaries pass
  (eager, on CPU).

The bitwise comparisons with HF run the plain engine: oneDNN's packed fp32 GEMMs may differ from F.linear in the
last bits, so the packed engine is compared with the plain one token for token (wide random logits: no near-ties)
and with itself (perturb + restore gives back its tokens).

The whole module skips, with the reason, where vLLM is not installed (pip install -e ".[vllm]", see the README).
"""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from helpers.paths import REPO

pytest.importorskip("vllm", reason="vLLM is not installed (pip install -e '.[vllm]'; see the README)")

from copes.cli import eval_command  # noqa: E402
from copes.errors import UserError  # noqa: E402
from copes.es.params import ParameterSpace  # noqa: E402
from copes.modeling import load_model  # noqa: E402
from copes.rollout.engine import engine_for, load_rollout_model  # noqa: E402
from copes.rollout.generate import generate_batch, prompt_token_counts  # noqa: E402

from helpers.cli_runs import assert_same_weights, copes_run, final_weights, metrics_without_time  # noqa: E402
from helpers.tiny_models import build_tiny_tokenizer, tiny_qwen3  # noqa: E402

pytestmark = pytest.mark.vllm

KV_CACHE_GIB = 0.0625  # 8K tokens of the tiny models: explicit, and small on a shared machine
CPU_KV_BLOCK = 128  # vLLM's KV block on CPU: prefix caching reuses whole blocks
PROMPTS = ["What is 12 plus 7?", "Name a prime number.", "Spell the word cat backwards.", "Count: one, two,"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random tiny Qwen3 with vLLM-CPU's smallest head size (32) and room for a several-block prompt."""
    folder = tmp_path_factory.mktemp("vllm-model")
    tokenizer = build_tiny_tokenizer(folder)
    tiny_qwen3(tokenizer, seed=0, head_dim=32).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def engine_views(model_dir: Path, dtype: str, cpu_weights: str) -> tuple[torch.nn.Module, object]:
    views, tokenizer, _ = load_rollout_model(str(model_dir), engine="vllm", dtype=dtype, cpu_threads=1,
                                             kv_cache_gib=KV_CACHE_GIB, vllm_cpu_weights=cpu_weights)
    return views, tokenizer


def engine_and_reference(model_dir: Path, dtype: str) -> tuple[torch.nn.Module, torch.nn.Module, object]:
    views, tokenizer = engine_views(model_dir, dtype, "plain")
    reference, _, _ = load_model(str(model_dir), dtype=dtype)
    return views, reference, tokenizer


@pytest.fixture(scope="module")
def fp32(model_dir: Path) -> Iterator[tuple[torch.nn.Module, torch.nn.Module, object]]:
    yield engine_and_reference(model_dir, "float32")


def assert_same_tensors(views: torch.nn.Module, reference: torch.nn.Module) -> None:
    ours, theirs = dict(views.named_parameters()), dict(reference.named_parameters())
    assert ours.keys() == theirs.keys()
    for name, tensor in ours.items():
        assert torch.equal(tensor.view(-1).view(torch.uint8), theirs[name].view(-1).view(torch.uint8)), name


def spaces(views: torch.nn.Module, reference: torch.nn.Module, **options) -> list[ParameterSpace]:
    return [ParameterSpace(model, chunk_size=1000, **options) for model in (views, reference)]


def test_views_are_the_hf_tensors_with_hf_names(fp32) -> None:
    views, reference, _ = fp32
    assert_same_tensors(views, reference)
    vllm_model = engine_for(views).llm.collective_rpc("copes_model")[0]
    storage = {tensor.untyped_storage().data_ptr() for tensor in vllm_model.parameters()}
    # No second copy: every HF-named parameter lies in vLLM's own storage.
    assert all(param.untyped_storage().data_ptr() in storage for param in views.parameters())


@pytest.mark.parametrize("restore", ["device", "host", "subtract"])
def test_perturb_and_restore_match_hf_bitwise(fp32, restore: str) -> None:
    views, reference, _ = fp32
    before = {name: tensor.clone() for name, tensor in reference.named_parameters()}
    engine_space, reference_space = spaces(views, reference, restore=restore)
    for space in (engine_space, reference_space):
        partition = space.partition(seed=123, num_subspaces=2)
        space.perturb(partition, seed=123, member=3, subspace=1, sigma=0.05)
    assert any(not torch.equal(before[name], tensor) for name, tensor in reference.named_parameters())
    assert_same_tensors(views, reference)
    engine_space.restore()
    reference_space.restore()
    assert_same_tensors(views, reference)
    if restore != "subtract":
        assert all(torch.equal(before[name], tensor) for name, tensor in reference.named_parameters())
    else:  # subtract leaves its rounding in both; put the exact weights back for the next test
        with torch.no_grad():
            for model in (views, reference):
                for name, tensor in model.named_parameters():
                    tensor.copy_(before[name])


def test_perturbed_long_prompt_generates_as_hf_without_stale_prefix_cache(fp32) -> None:
    """Prompts longer than one KV block: the first rollout fills the prefix cache under the base weights, the
    second runs under a perturbation and must not reuse that KV."""
    views, reference, tokenizer = fp32
    long_prompts = [" ".join([prompt] * 30) for prompt in PROMPTS]
    assert min(prompt_token_counts(tokenizer, long_prompts)) > CPU_KV_BLOCK
    engine = engine_for(views)
    engine.start_rollout()
    base = engine.generate(tokenizer, long_prompts, max_new_tokens=12)
    assert base == generate_batch(reference, tokenizer, long_prompts, max_new_tokens=12)
    engine_space, reference_space = spaces(views, reference)
    for space in (engine_space, reference_space):
        space.perturb(space.partition(seed=5, num_subspaces=1), seed=5, member=0, subspace=0, sigma=0.2)
    try:
        engine.start_rollout()
        perturbed = engine.generate(tokenizer, long_prompts, max_new_tokens=12)
        assert perturbed == generate_batch(reference, tokenizer, long_prompts, max_new_tokens=12)
        assert perturbed != base  # the perturbation changed the output: the test can see stale KV
    finally:
        engine_space.restore()
        reference_space.restore()


def test_stop_strings_and_row_limits_match_hf(fp32) -> None:
    views, reference, tokenizer = fp32
    free = generate_batch(reference, tokenizer, PROMPTS, max_new_tokens=16)
    # Strings that occur in the free outputs (whole characters: a stop string is text, not a byte fragment).
    stops = sorted({g.text[2:4] for g in free if len(g.text) >= 4 and g.text[2:4].isascii()})[:2]
    assert stops
    limits = [16, 3, 9, 1]
    options = dict(max_new_tokens=limits, stop_strings=stops)
    engine_for(views).start_rollout()
    ours = engine_for(views).generate(tokenizer, PROMPTS, **options)
    assert ours == generate_batch(reference, tokenizer, PROMPTS, **options)
    assert {g.finished_by for g in ours} >= {"stop", "length"}


@pytest.fixture(scope="module")
def packed(model_dir: Path) -> Iterator[tuple[torch.nn.Module, object]]:
    yield engine_views(model_dir, "float32", "packed")


def test_packed_weights_follow_every_write_and_repack_only_what_changed(fp32, packed) -> None:
    plain_views, _, tokenizer = fp32
    packed_views, _ = packed
    plain_engine, packed_engine = engine_for(plain_views), engine_for(packed_views)
    assert plain_engine.packed_weights is None
    packs = packed_engine.packed_weights
    layers = len(packs.layers)  # every linear layer and the LM head, 4 per decoder layer + 1

    def rollout(engine, new_rollout: bool = True) -> list:
        if new_rollout:
            engine.start_rollout()
        return engine.generate(tokenizer, PROMPTS, max_new_tokens=12)

    def repacks_during(generate) -> tuple[list, int]:
        before = packs.repacked_layers
        tokens = generate()
        return tokens, packs.repacked_layers - before

    base = rollout(packed_engine)
    assert layers == 4 * len(packed_views.model.layers) + 1
    assert base == rollout(plain_engine)
    assert repacks_during(lambda: rollout(packed_engine, new_rollout=False)) == (base, 0)  # the next turn
    assert repacks_during(lambda: rollout(packed_engine)) == (base, 0)  # the next rollout, nothing written
    for include, written_layers in ((None, layers), ("model.layers.0.mlp.*", 2)):  # gate_up_proj and down_proj
        engine_space, plain_space = (ParameterSpace(views, include=include, chunk_size=1000)
                                     for views in (packed_views, plain_views))
        for space in (engine_space, plain_space):
            space.perturb(space.partition(seed=5, num_subspaces=1), seed=5, member=0, subspace=0, sigma=0.2)
        try:
            perturbed, repacked = repacks_during(lambda: rollout(packed_engine))
            assert repacked == written_layers, include
            assert perturbed == rollout(plain_engine) and perturbed != base, include  # never a stale pack
        finally:
            engine_space.restore()
            plain_space.restore()
        assert repacks_during(lambda: rollout(packed_engine)) == (base, written_layers), include
    # A plain torch write (a resume's load_state_dict, a user's copy_) moves the version counter by itself.
    o_proj = packed_views.model.layers[1].self_attn.o_proj.weight
    original = o_proj.clone()
    with torch.no_grad():
        o_proj.mul_(-1)
    try:
        negated, repacked = repacks_during(lambda: rollout(packed_engine))
        assert (repacked, negated != base) == (1, True)
    finally:
        with torch.no_grad():
            o_proj.copy_(original)
    assert repacks_during(lambda: rollout(packed_engine)) == (base, 1)


@pytest.mark.slow
def test_updates_in_every_precision_match_hf_bitwise(model_dir: Path) -> None:
    views, reference, _ = engine_and_reference(model_dir, "bfloat16")
    for precision in ("native", "stochastic", "master_device", "master_host"):
        engine_space, reference_space = spaces(views, reference, update_precision=precision)
        norms = []
        for space in (engine_space, reference_space):
            partition = space.partition(seed=9, num_subspaces=2)
            space.perturb(partition, seed=9, member=1, subspace=0, sigma=0.01)
            space.restore()
            norms.append(space.apply_update(partition, seed=9, members=[0, 1, 2, 3], coeffs=[0.02, -0.01, 0.005, 0.01],
                                            member_subspaces=[0, 1, 0, 1]))
        assert norms[0] == norms[1] > 0, precision
        assert_same_tensors(views, reference)


def test_prefix_cache_is_dropped_only_after_a_weight_write(fp32) -> None:
    """Rollouts with no write between them (held-out evaluation, a member's next batch) keep the cached prefixes;
    a perturbation, a restore and any plain torch write each drop them before the next rollout."""
    views, _, tokenizer = fp32
    engine = engine_for(views)
    engine.start_rollout()
    resets = engine.prefix_cache_resets
    for _ in range(2):
        engine.start_rollout()
        engine.generate(tokenizer, PROMPTS, max_new_tokens=4)
    assert engine.prefix_cache_resets == resets
    space = ParameterSpace(views, include="model.layers.0.*", chunk_size=1000)
    space.perturb(space.partition(seed=3, num_subspaces=1), seed=3, member=0, subspace=0, sigma=0.01)
    engine.start_rollout()
    engine.start_rollout()
    assert engine.prefix_cache_resets == resets + 1
    space.restore()
    engine.start_rollout()
    assert engine.prefix_cache_resets == resets + 2
    with torch.no_grad():
        views.model.norm.weight.mul_(1.0)  # a write, even of the same values, moves the version counter
    engine.start_rollout()
    assert engine.prefix_cache_resets == resets + 3


def test_the_gpu_checks_perturb_restore_function_passes_on_cpu(fp32) -> None:
    """bench/device/vllm_gpu_check.py's check, which a GPU check runs with CUDA graphs on, here on vLLM-CPU (eager)."""
    sys.path.insert(0, str(REPO / "bench" / "device"))
    import vllm_gpu_check

    views, _, tokenizer = fp32
    assert vllm_gpu_check.check_perturb_restore(engine_for(views), tokenizer) == \
        {"perturb_restore_bitwise": True, "cuda_graphs": False}


def test_the_gpu_checks_lora_canaries_pass_on_cpu(tmp_path) -> None:
    """bench/device/vllm_gpu_check.py's LoRA canaries (EGGROLL's members as adapters on a reduced Qwen3.5 in the
    released wrapper layout, the tied embedding left out), which the GPU check runs on the device, here on vLLM-CPU:
    every member's logits differ from the base's on a 512-token prompt."""
    sys.path.insert(0, str(REPO / "bench" / "device"))
    sys.path.insert(0, str(REPO / "bench"))
    import vllm_gpu_check

    from common.rehearsal_model import REDUCED_TEXT, build_rehearsal_model

    folder = build_rehearsal_model(tmp_path / "qwen3.5", text_overrides=REDUCED_TEXT)
    differences = vllm_gpu_check.lora_canaries(str(folder), device="cpu", dtype="bfloat16", kv_cache_gib=0.25)
    assert sorted(differences) == [0, 1, 2] and all(difference > 0 for difference in differences.values())


def long_context_model(folder: Path) -> Path:
    """A tiny Qwen3 that claims a 1M-token context: its full KV cache would need ~16 GiB at fp32."""
    tokenizer = build_tiny_tokenizer(folder)
    tiny_qwen3(tokenizer, head_dim=32, max_position_embeddings=1 << 20).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def test_kv_cache_budget_caps_max_model_len_in_one_line(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    views, tokenizer, _ = load_rollout_model(str(long_context_model(tmp_path)), engine="vllm", cpu_threads=1,
                                             kv_cache_gib=KV_CACHE_GIB, max_context_tokens=4096,
                                             vllm_cpu_weights="plain")
    engine = engine_for(views)
    assert 4096 <= engine.max_model_len < 1 << 20
    assert engine.plan == (f"vLLM engine: max_model_len {engine.max_model_len} tokens (capped from the model's "
                           f"{1 << 20}: what --vllm-kv-cache-gib holds), KV cache {KV_CACHE_GIB:g} GiB")
    assert engine.plan in capsys.readouterr().err.splitlines()
    engine.start_rollout()
    assert len(engine.generate(tokenizer, PROMPTS, max_new_tokens=4)) == len(PROMPTS)


def test_kv_cache_too_small_for_one_token_is_one_line(tmp_path: Path) -> None:
    with pytest.raises(UserError, match=r"^--vllm-kv-cache-gib 1e-06 does not hold one sequence of this model: "
                                        r"raise it \(") as caught:
        load_rollout_model(str(long_context_model(tmp_path)), engine="vllm", cpu_threads=1, kv_cache_gib=1e-6)
    assert "\n" not in str(caught.value)


def test_unsupported_head_size_is_one_clear_error(tmp_path: Path) -> None:
    tokenizer = build_tiny_tokenizer(tmp_path)
    tiny_qwen3(tokenizer, head_dim=16).save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    with pytest.raises(UserError, match=r"CPU attention supports head_dim .*this model's is 16"):
        load_rollout_model(str(tmp_path), engine="vllm", kv_cache_gib=KV_CACHE_GIB)


@pytest.mark.slow
def test_copes_run_on_vllm_resumes_and_matches_hf(tmp_path: Path) -> None:
    """fp32 greedy: 3 steps on vLLM, resumed to 4, end where 4 steps on HF end, bit for bit."""
    on_vllm, on_hf = tmp_path / "vllm", tmp_path / "hf"
    vllm_flags = ["--rollout-engine", "vllm", "--vllm-cpu-weights", "plain", "--vllm-kv-cache-gib", str(KV_CACHE_GIB),
                  "--output-dir", str(on_vllm)]
    first = copes_run("--steps", "3", *vllm_flags, timeout=600)
    assert first.returncode == 0, first.stderr
    resumed = copes_run("--steps", "4", *vllm_flags, "--resume", str(on_vllm), timeout=600)
    assert resumed.returncode == 0, resumed.stderr
    reference = copes_run("--steps", "4", "--output-dir", str(on_hf))
    assert reference.returncode == 0, reference.stderr
    assert_same_weights(final_weights(on_vllm), final_weights(on_hf))
    assert metrics_without_time(on_vllm) == metrics_without_time(on_hf)
    assert any(record["update_norm"] > 0 for record in metrics_without_time(on_hf))
    ours, theirs = (json.loads((run / "summary.json").read_text()) for run in (on_vllm, on_hf))
    assert (ours["eval_before"], ours["eval_after"]) == (theirs["eval_before"], theirs["eval_after"])


def test_copes_run_on_vllm_with_packed_weights_resumes_bitwise(tmp_path: Path) -> None:
    """The default engine mode (packed GEMM copies, repacked after every write): 2 steps, resumed to 3, end where 3
    straight steps end, bit for bit, and the run really moved the weights."""
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    flags = ["--rollout-engine", "vllm", "--vllm-kv-cache-gib", str(KV_CACHE_GIB)]
    for args in (["--steps", "3", "--output-dir", str(straight)], ["--steps", "2", "--output-dir", str(resumed)],
                 ["--steps", "3", "--resume", str(resumed)]):
        result = copes_run(*flags, *args, timeout=600)
        assert result.returncode == 0, result.stderr
    assert_same_weights(final_weights(resumed), final_weights(straight))
    assert metrics_without_time(resumed) == metrics_without_time(straight)
    assert any(record["update_norm"] > 0 for record in metrics_without_time(straight))


def test_copes_eval_on_vllm_scores_as_on_hf(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The embedded model, fp32 greedy, plain weights: the same answers, rewards and token counts on both engines,
    and on vLLM from the model's GGUF (run as its dense folder, converted once into the machine's cache)."""
    from copes.gguf_io import export_gguf
    from copes.modeling import EMBEDDED_MODELS

    monkeypatch.setenv("COPES_CACHE_DIR", str(tmp_path / "cache"))
    gguf_file = tmp_path / "tiny.gguf"
    export_gguf(EMBEDDED_MODELS["tiny"], gguf_file, "f32")
    scored = {}
    for name, engine, model in (("hf", "hf", "tiny"), ("vllm", "vllm", "tiny"), ("vllm gguf", "vllm", gguf_file)):
        output = tmp_path / f"{name}.json"
        result = CliRunner().invoke(eval_command, [
            "--model", str(model), "--rollout-engine", engine, "--vllm-cpu-weights", "plain",
            "--vllm-kv-cache-gib", str(KV_CACHE_GIB), "--limit", "8", "--output", str(output)])
        assert result.exit_code == 0, result.output
        (scored[name],) = json.loads(output.read_text()).values()
        scored[name].pop("wall_seconds")
    assert scored["vllm"] == scored["hf"] == scored["vllm gguf"]
    assert scored["hf"]["n_examples"] == 8

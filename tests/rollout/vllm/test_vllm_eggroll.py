"""EGGROLL and CoPES-lowrank on vLLM: every member a LoRA adapter built in memory from the noise contract
(copes.rollout.vllm.lora), the whole population in one `llm.generate` call. Against the HF EGGROLL path (the
reference: per-row routing in HF forwards) on the embedded model, fp32, greedy, the same targets (the tied
embedding excluded on both):

- every member's trajectories and rewards equal the HF path's, before and after an update applied in place to the
  engine's HF-named views (greedy tokens are compared exactly: with sigma 0.5 the members' outputs differ from one
  another, and no logit tie turned up; a tie would show as one row differing, and this test would name it);
- one generate call carries every member; adapter ids and names never repeat across members or steps, and a new
  step's noise removes the previous step's adapters from the engine;
- a packed engine (CPU weights repacked after a write) packs each layer once with LoRA on and repacks exactly the
  layers an update wrote;
- `copes-run --algorithm eggroll --rollout-engine vllm --workers 2` (packed CPU weights, the default) ends 3 steps
  with the HF path's weights bit for bit and the same metrics: the update depends on the rewards and the noise
  contract only, so equal rewards give equal bits, and tolerance 0 is the justified one; `copes-replay` (on HF)
  rebuilds it bit for bit; a one-process run killed half-way through step 2's update and resumed ends bitwise
  there too.
"""

from __future__ import annotations

import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

pytest.importorskip("vllm", reason="vLLM is not installed (pip install -e '.[vllm]'; see the README)")

from copes.es.strategies import EGGROLL, CoPESLowRank  # noqa: E402
from copes.modeling import EMBEDDED_MODEL_DIR, load_model  # noqa: E402
from copes.rollout import AgentConfig  # noqa: E402
from copes.rollout.engine import engine_for, load_rollout_model  # noqa: E402
from copes.rollout.vllm.lora import LoRASlots  # noqa: E402
from copes.run.scoring import rollouts  # noqa: E402
from copes.tasks.plugins import build_task  # noqa: E402
from copes.timing import PhaseTimer  # noqa: E402

from helpers.cli_runs import assert_same_weights, copes_run, final_weights, metrics_without_time  # noqa: E402

pytestmark = pytest.mark.vllm

KV_CACHE_GIB = 0.0625
POPULATION, RANK = 4, 2  # rank 2 rides in vLLM's rank-8 slot
TIED = ["model.embed_tokens.weight"]
STRATEGIES = {
    "eggroll": lambda model: EGGROLL(model, population=POPULATION, sigma=0.5, lr=0.05, rank=RANK, seed=3,
                                     exclude=TIED, fitness="joint"),
    "copes-lowrank": lambda model: CoPESLowRank(model, population=POPULATION, num_subspaces=2, sigma=0.5, lr=0.05,
                                                rank=RANK, seed=3, exclude=TIED),
}


@pytest.fixture(scope="module")
def engines() -> Iterator[tuple[torch.nn.Module, torch.nn.Module, object]]:
    """(vLLM views with LoRA on, an HF model of the same checkpoint, the tokenizer): one engine for the module."""
    views, tokenizer, _ = load_rollout_model(str(EMBEDDED_MODEL_DIR), engine="vllm", dtype="float32", cpu_threads=1,
                                             kv_cache_gib=KV_CACHE_GIB, vllm_cpu_weights="plain",
                                             lora=LoRASlots(POPULATION, RANK))
    reference, _, _ = load_model(str(EMBEDDED_MODEL_DIR), dtype="float32")
    yield views, reference, tokenizer


def population_rollouts(strategy: EGGROLL | CoPESLowRank, model: torch.nn.Module, tokenizer: object
                        ) -> tuple[list[list[str]], torch.Tensor]:
    """Each member's final texts on 3 arithmetic questions and the rewards, through the trainer's scoring path."""
    task = build_task("arithmetic", {})
    examples = task.examples("train")[:3]
    agent = AgentConfig.for_task(task, max_new_tokens=8, greedy=True)
    texts: list[list[str]] = []

    def fitness(model: torch.nn.Module, row_members: object) -> list[list[float]]:
        scored = rollouts(model, tokenizer, task, examples, tools=[], agent=agent, timer=PhaseTimer(),
                          members=list(range(POPULATION)), row_members=row_members)
        texts.extend([trajectory.final_text for trajectory, _ in member] for member in scored)
        return [[score.reward for _, score in member] for member in scored]

    return texts, strategy.evaluate(fitness)


def generate_calls(views: torch.nn.Module, monkeypatch: pytest.MonkeyPatch) -> list[list[object]]:
    """Records each llm.generate call's per-request LoRARequests."""
    engine = engine_for(views)
    calls: list[list[object]] = []
    real = engine.llm.generate

    def recording(requests: object, params: object, **options: object) -> object:
        calls.append(list(options.get("lora_request") or []))
        return real(requests, params, **options)

    monkeypatch.setattr(engine.llm, "generate", recording)
    return calls


@pytest.mark.parametrize("algorithm", list(STRATEGIES))
def test_members_roll_out_as_on_hf_before_and_after_an_update(
        engines: tuple[torch.nn.Module, torch.nn.Module, object], algorithm: str,
        monkeypatch: pytest.MonkeyPatch) -> None:
    views, reference, tokenizer = engines
    originals = {name: p.clone() for name, p in reference.named_parameters()}
    on_vllm, on_hf = STRATEGIES[algorithm](views), STRATEGIES[algorithm](reference)
    calls = generate_calls(views, monkeypatch)
    try:
        for step in range(2):
            (texts, rewards), (hf_texts, hf_rewards) = (population_rollouts(s, m, tokenizer)
                                                        for s, m in ((on_vllm, views), (on_hf, reference)))
            assert texts == hf_texts, f"step {step}: members' outputs differ from the HF path"
            assert torch.equal(rewards, hf_rewards)
            assert len({tuple(t) for t in texts}) > 1, "the members should not all answer alike"
            for strategy, values in ((on_vllm, rewards), (on_hf, hf_rewards)):
                strategy.apply_update(values + torch.arange(POPULATION, dtype=torch.float64)[:, None])
            for name, param in reference.named_parameters():
                assert torch.equal(dict(views.named_parameters())[name], param), f"{name} differs after the update"
        assert any(not torch.equal(originals[n], p) for n, p in reference.named_parameters())
        # Multi-turn-free arithmetic: one call per rollout, every member in it.
        assert len(calls) == 2 and all(len({r.lora_int_id for r in call}) == POPULATION for call in calls)
    finally:  # the next test starts from the checkpoint's weights on both engines
        with torch.no_grad():
            for name, param in reference.named_parameters():
                param.copy_(originals[name])
                dict(views.named_parameters())[name].copy_(originals[name])


def test_adapter_ids_never_repeat_and_old_steps_are_removed(
        engines: tuple[torch.nn.Module, torch.nn.Module, object], monkeypatch: pytest.MonkeyPatch) -> None:
    views, _, tokenizer = engines
    engine = engine_for(views)
    strategy = STRATEGIES["eggroll"](views)
    calls = generate_calls(views, monkeypatch)
    originals = {name: p.clone() for name, p in views.named_parameters()}
    try:
        population_rollouts(strategy, views, tokenizer)
        population_rollouts(strategy, views, tokenizer)  # the same step again (a sampling rollout): same adapters
        strategy.apply_update(torch.zeros(POPULATION, 3, dtype=torch.float64))  # the next step, new noise
        population_rollouts(strategy, views, tokenizer)
    finally:
        with torch.no_grad():
            for name, param in views.named_parameters():
                param.copy_(originals[name])
    first, again, second = ({r.lora_int_id: r.lora_name for r in call} for call in calls)
    assert first == again and len(first) == POPULATION
    assert not set(first) & set(second) and not set(first.values()) & set(second.values())
    assert len(set(second.values())) == POPULATION
    assert engine.llm.llm_engine.list_loras() == set(second) == set(engine.adapters.store)


@pytest.mark.integration
def test_copes_run_eggroll_on_vllm_matches_hf_and_resumes_bitwise(tmp_path: Path) -> None:
    """3 steps on vLLM as 2 ranks (--workers 2: an engine per rank, each with its own members' adapters; packed
    weights) = 3 steps on HF with the tied embedding excluded, bit for bit; a one-process run killed half-way
    through step 2's update (the 40th of 28 tensor writes per step) resumes to the same bits."""
    flags = ["--algorithm", "eggroll", "--steps", "3", "--budget-hours", "1"]
    vllm = ["--rollout-engine", "vllm", "--vllm-kv-cache-gib", str(KV_CACHE_GIB)]
    straight, killed, hf = tmp_path / "straight", tmp_path / "killed", tmp_path / "hf"
    result = copes_run(*flags, *vllm, "--workers", "2", "--output-dir", str(straight), timeout=600)
    assert result.returncode == 0, result.stderr
    assert result.stderr.count("eggroll on vLLM leaves model.embed_tokens.weight unperturbed") == 1
    result = copes_run(*flags, "--exclude", TIED[0], "--output-dir", str(hf), timeout=600)
    assert result.returncode == 0, result.stderr
    assert_same_weights(final_weights(straight), final_weights(hf))
    assert metrics_without_time(straight) == metrics_without_time(hf)
    assert all(record["update_norm"] > 0 for record in metrics_without_time(straight))
    # copes-replay rebuilds the vLLM run on HF (the tied embedding left out there too), bit for bit.
    replayed = subprocess.run([shutil.which("copes-replay"), str(straight), "--output", str(tmp_path / "replayed"),
                               "--quiet"], capture_output=True, text=True, timeout=600)
    assert replayed.returncode == 0, replayed.stderr
    assert_same_weights(load_file(str(tmp_path / "replayed" / "model.safetensors")), final_weights(straight))

    result = copes_run(*flags, *vllm, "--output-dir", str(killed), env={"COPES_FAILPOINT": "update@40"}, timeout=600)
    assert result.returncode == -9, result.stderr
    result = copes_run(*flags, *vllm, "--resume", str(killed), timeout=600)
    assert result.returncode == 0, result.stderr
    assert_same_weights(final_weights(killed), final_weights(straight))
    assert metrics_without_time(killed) == metrics_without_time(straight)


def test_packed_weights_are_repacked_after_an_update(engines: tuple[torch.nn.Module, torch.nn.Module, object]) -> None:
    """With LoRA on, each linear layer is packed once (the base layer, not also its LoRA wrapper), and an update
    repacks exactly the layers it wrote, so the next rollout runs on the updated weights."""
    _, reference, tokenizer = engines
    packed, _, _ = load_rollout_model(str(EMBEDDED_MODEL_DIR), engine="vllm", dtype="float32", cpu_threads=1,
                                      kv_cache_gib=KV_CACHE_GIB, vllm_cpu_weights="packed",
                                      lora=LoRASlots(POPULATION, RANK))
    engine = engine_for(packed)
    layers = set(engine.packed_weights.layers)  # vLLM's fused layers (qkv_proj, gate_up_proj) and the tied lm_head
    assert all(name.endswith(".base_layer") for name in layers - {"lm_head"}) and len(layers) == 4 * 4 + 1
    on_vllm, on_hf = STRATEGIES["eggroll"](packed), STRATEGIES["eggroll"](reference)
    originals = {name: p.clone() for name, p in reference.named_parameters()}
    try:
        assert engine.repack_changed_weights() == len(layers)  # first packs
        for strategy in (on_vllm, on_hf):
            strategy.evaluate(lambda model, rows: torch.zeros(POPULATION))
            strategy.apply_update(torch.arange(POPULATION, dtype=torch.float64))
        assert engine.repack_changed_weights() == len(layers) - 1  # all but the tied lm_head (not a target)
        assert population_rollouts(on_vllm, packed, tokenizer)[0] == population_rollouts(on_hf, reference, tokenizer)[0]
    finally:
        with torch.no_grad():
            for name, param in reference.named_parameters():
                param.copy_(originals[name])

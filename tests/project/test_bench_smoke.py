"""Smoke tests of the end-to-end benchmarks (bench/*.py): each script's core function runs at a tiny size on real
models (a random Qwen3 checkpoint with a trained BPE tokenizer, a random Qwen3.5-architecture model), so the
scripts cannot rot. No timing is asserted; the measurements' invariants are (exact restores, untouched weights
under EGGROLL, a real update every step, a measured allocation)."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import tarfile
from pathlib import Path

import numpy as np
import pytest
import torch

from helpers.paths import REPO
from helpers.tiny_models import build_tiny_checkpoint, load_checkpoint

BENCH_DIR = REPO / "bench"
sys.path.insert(0, str(BENCH_DIR))

import eggroll_throughput  # noqa: E402
import gguf_llama_cpp  # noqa: E402
import memory  # noqa: E402
import rollout_engines  # noqa: E402
import sample_efficiency  # noqa: E402
import sandbox_throughput  # noqa: E402
import step_overhead  # noqa: E402
import vs_naive  # noqa: E402

from common import harness, memory_probe, models  # noqa: E402

# A 4-layer Qwen3.5-architecture model (three linear-attention layers, one full-attention) of 0.24M parameters.
SMALL_SHAPE = models.LargeModelShape(vocab_size=256, hidden_size=64, intermediate_size=128, num_layers=4)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_checkpoint(tmp_path_factory.mktemp("bench-tiny"))


def test_large_model_is_the_qwen3_5_architecture_at_the_requested_size() -> None:
    model = models.build_large_model(SMALL_SHAPE)
    assert type(model).__name__ == "Qwen3_5ForCausalLM"
    assert model.config.layer_types.count("linear_attention") == 3
    assert models.parameter_count(model) == sum(p.numel() for p in model.parameters())
    with pytest.raises(ValueError, match="hidden_size"):
        models.LargeModelShape(hidden_size=0)


def test_peak_memory_sees_a_transient_allocation_and_nothing_held_after_it() -> None:
    megabytes = 8
    with memory_probe.PeakMemory() as memory_use:
        buffer = torch.ones(megabytes * 2**20 // 4)  # written, so its pages are resident
        held_while_alive = memory_use.held()
        del buffer
    assert held_while_alive >= 0.9 * megabytes * 2**20
    assert memory_use.peak_bytes >= 0.9 * megabytes * 2**20
    assert memory_use.held() < 0.5 * megabytes * 2**20


def test_alternating_best_seconds_times_every_run_and_rejects_zero_repeats() -> None:
    calls = {"a": 0, "b": 0}
    best = harness.alternating_best_seconds({name: lambda name=name: calls.__setitem__(name, calls[name] + 1)
                                            for name in calls}, repeats=2)
    assert set(best) == {"a", "b"} and all(0 <= seconds < 1 for seconds in best.values())
    assert calls == {"a": 3, "b": 3}  # one warm-up round + two timed
    with pytest.raises(ValueError, match="repeats"):
        harness.alternating_best_seconds({"a": lambda: None}, repeats=0)


@pytest.mark.slow
def test_step_overhead_times_every_phase_and_the_large_workload_really_updates(checkpoint: Path) -> None:
    tiny = step_overhead.measure_tiny(str(checkpoint), population=4, subspaces=2, prompt_batch=2, steps=1,
                                      overrides={"max_new_tokens": 2})
    large = step_overhead.measure_large(SMALL_SHAPE, population=4, subspaces=2, prompt_batch=2, prompt_tokens=4,
                                        new_tokens=2, steps=1)
    for row in (tiny, large):
        assert row["steps"] == 1 and 0 < row["overhead_pct"] < 100
        assert row["eval_s_per_member_for_5pct"] == pytest.approx(19 * row["engine_s_per_member"])
    assert large["updated"] == 1  # the log-likelihood reward differs between members, so the update runs


def test_vs_naive_engine_restores_exactly_for_both_subspace_counts() -> None:
    rows = vs_naive.measure(models.build_large_model(SMALL_SHAPE), repeats=1)
    assert {(row["K"], row["implementation"]) for row in rows} == {(1, "engine"), (1, "naive"), (4, "engine"),
                                                                  (4, "naive")}
    for row in rows:
        assert row["perturb_restore_s"] > 0
        if row["implementation"] == "engine":
            assert row["exact_restore"] == "yes" and row["max_abs_error"] == 0
        else:
            assert row["speedup_vs_naive"] == 1


def test_eggroll_throughput_leaves_the_weights_untouched(checkpoint: Path) -> None:
    model, _ = load_checkpoint(checkpoint)
    before = [p.detach().clone() for p in model.parameters()]
    rows = eggroll_throughput.throughput_rows("tiny", model, population=2, rows_per_member=2, prompt_tokens=4,
                                              new_tokens=2, rank=1, repeats=1)
    assert [row["workload"] for row in rows] == ["prefill forward", "greedy generate"]
    assert [row["tokens"] for row in rows] == [4 * 4, 4 * 2]
    assert all(row["ratio"] > 0 and row["factors_s"] > 0 for row in rows)
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    with pytest.raises(ValueError, match="positions"):
        eggroll_throughput.throughput_rows("tiny", model, population=2, rows_per_member=1, prompt_tokens=4096,
                                           new_tokens=1, rank=1, repeats=1)


def test_memory_backs_up_one_subspace_and_the_exact_modes_restore_exactly() -> None:
    model = models.build_large_model(SMALL_SHAPE)
    rows = {row["mode"]: row for row in memory.measure(model, subspaces=2, chunk_size=4096, batch=2, prompt_tokens=4)}
    assert list(rows) == list(memory.MODES)
    device = rows["device"]
    # The device backup is subspace 0's chunks: about half the weights with K = 2.
    assert device["held_of_weights"] == pytest.approx(device["subspace_share"], abs=0.1)
    assert all(rows[mode]["exact_restore"] == "yes" for mode in ("device", "host", "host, streamed"))
    assert rows["subtract"]["bound_of_weights"] == "-"


@pytest.mark.slow
def test_sample_efficiency_runs_each_strategy_family_and_plots(checkpoint: Path, tmp_path: Path) -> None:
    settings = {"population": 2, "prompt_batch": 2, "steps": 2, "eval_size": 2, "eval_every": 1, "max_new_tokens": 2}
    curves = [sample_efficiency.run_curve(str(checkpoint), config, 0, settings)
              for config in ("CoPES K=2", "EGGROLL r=1")]
    for curve in curves:
        assert curve.steps == [1, 2] and curve.eval_steps == [0, 1, 2]
        assert all(0 <= value <= 1 for value in curve.rewards + curve.accuracies)
    rows = sample_efficiency.summarize(curves, evaluations_per_step=4)
    assert [row["config"] for row in rows] == ["CoPES K=2", "EGGROLL r=1"]
    assert rows[0]["evaluations"] == 8
    lines = sample_efficiency.curve_lines(curves, evaluations_per_step=4)
    assert [line[2] for line in lines[:3]] == [0, 1, 2] and lines[0][4] == ""  # step 0 has no training reward
    path = tmp_path / "curves.png"
    sample_efficiency.plot(curves, 4, path, "smoke")
    assert path.stat().st_size > 0
    with pytest.raises(ValueError, match="config"):
        sample_efficiency.run_curve(str(checkpoint), "CoPES K=3", 0, settings)


def test_trailing_mean_averages_the_last_window_points() -> None:
    values = np.array([[1.0, 2.0, 3.0, 4.0], [0.0, 0.0, 0.0, 8.0]])
    smoothed = sample_efficiency.trailing_mean(values, window=2)
    assert np.allclose(smoothed, [[1.0, 1.5, 2.5, 3.5], [0.0, 0.0, 0.0, 4.0]])
    assert math.isclose(float(sample_efficiency.trailing_mean(values, window=10)[0, -1]), 2.5)


SMALL_SHAPE_FLAGS = ["--vocab-size", "256", "--hidden-size", "64", "--intermediate-size", "128", "--layers", "4"]


@pytest.mark.slow
@pytest.mark.parametrize(("script", "flags", "outputs"), [
    ("step_overhead", ["--tiny-population", "2", "--tiny-prompt-batch", "2", "--tiny-steps", "1", "--subspaces", "2",
                       "--max-new-tokens", "2", "--large-population", "2", "--large-prompt-batch", "1",
                       "--prompt-tokens", "4", "--new-tokens", "2", *SMALL_SHAPE_FLAGS], ["step_overhead"]),
    ("vs_naive", ["--repeats", "1", *SMALL_SHAPE_FLAGS], ["vs_naive"]),
    ("memory", ["--subspaces", "2", "--batch", "1", "--prompt-tokens", "4", *SMALL_SHAPE_FLAGS], ["memory"]),
    ("eggroll_throughput", ["--tiny-population", "2", "--large-population", "2", "--rows-per-member", "1",
                            "--prompt-tokens", "4", "--new-tokens", "2", "--repeats", "1", *SMALL_SHAPE_FLAGS],
     ["eggroll_throughput"]),
    ("sample_efficiency", ["--configs", "ES (K=1)", "--seeds", "1", "--steps", "1", "--population", "2",
                           "--prompt-batch", "1", "--eval-size", "1", "--max-new-tokens", "2"],
     ["sample_efficiency", "sample_efficiency_curves"]),
])
def test_each_script_runs_from_its_command_line_and_writes_its_csv(
    script: str, flags: list[str], outputs: list[str], checkpoint: Path, tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
) -> None:
    module = sys.modules[script]
    monkeypatch.setattr(harness, "RESULTS_DIR", tmp_path)  # never overwrite the committed results
    monkeypatch.setattr(module, "RESULTS_DIR", tmp_path, raising=False)
    tiny = ["--tiny-model", str(checkpoint)] if "--tiny-population" in flags or script == "sample_efficiency" else []
    module.main([*flags, *tiny])
    label = harness.device_label()
    for name in outputs:
        assert (tmp_path / f"{name}_{label}.csv").stat().st_size > 0
    assert f"wrote {tmp_path}" in capsys.readouterr().out


def test_rollout_engines_runs_a_given_model_and_sets_each_engine_against_the_bandwidth_floor(
    checkpoint: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """--model: a real model's folder instead of the random Qwen3 (docs/real-model.md runs it on SmolLM2); every
    engine reproduces `generate`'s rows, and no engine outruns the floor of reading the weights once a step."""
    monkeypatch.setattr(harness, "RESULTS_DIR", tmp_path)
    rollout_engines.main(["--model", str(checkpoint), "--engines", "--dtypes", "float32", "--workloads", "uniform",
                          "gsm8k-2turn", "--prompts", "3", "--prompt-tokens", "4", "--new-tokens", "3",
                          "--repeats", "1", "--no-step"])
    rows = [row.split(",") for row in (tmp_path / f"rollout_engines_checkpoint_{harness.device_label()}.csv")
            .read_text().splitlines()]
    table = [dict(zip(rows[0], row)) for row in rows[1:]]
    assert {row["engine"] for row in table} == {"hf", "hf-engine", "hf-engine-static"} and len(table) == 6
    for row in table:
        assert row["rows_equal_to_hf"] == "3" and 0 < float(row["vs_floor"]) < 1
    model = load_checkpoint(checkpoint)[0]
    workload = rollout_engines.Workload("w", [[1, 2]] * 2, [4, 2], observations=[[3]] * 2)
    weight_bytes = sum(p.numel() * 4 for p in model.parameters())  # a tied head counted once: one read a step
    assert rollout_engines.floor_tokens_per_s(model, workload, 1e9) == pytest.approx(12 / (8 * weight_bytes / 1e9))


def _llama_cpp_rows(monkeypatch: pytest.MonkeyPatch, results: Path, argv: list[str]) -> list[dict[str, str]]:
    monkeypatch.setattr(harness, "RESULTS_DIR", results)
    gguf_llama_cpp.main(argv)
    (written,) = results.glob("gguf_llama_cpp_*.csv")
    lines = written.read_text().splitlines()
    return [dict(zip(lines[0].split(","), line.split(","))) for line in lines[1:]]


@pytest.mark.integration
def test_llama_cpp_runs_an_export_as_transformers_does(checkpoint: Path, tmp_path: Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """Where llama-cpp-python is installed (`.ci/run` does not build it): llama.cpp tokenizes every text as the
    model's tokenizer does, for the tiny Qwen3 checkpoint (with GPT-2's split and with Qwen2's) and (where it is
    cached) SmolLM2, a Llama; on SmolLM2 it
    picks the same next token everywhere and gives the same greedy answers (a random model's near-ties allow no
    such claim: its logits are compared instead)."""
    pytest.importorskip("llama_cpp", reason="pip install llama-cpp-python to run bench/gguf_llama_cpp.py")
    from copes.downloads import DOWNLOADABLE_MODELS, cache_dir

    qwen2_split = build_tiny_checkpoint(tmp_path / "qwen2-split", split="qwen2")
    for folder, split in ((checkpoint, "gpt-2"), (qwen2_split, "qwen2")):
        qwen3 = ["--model", str(folder), "--types", "f32", "f16", "--prompts", "2", "--new-tokens", "4"]
        for row in _llama_cpp_rows(monkeypatch, tmp_path / split, qwen3):
            assert row["pre_tokenizer"] == split and row["texts_same_tokens"] == row["texts"] == "3"
            assert float(row["max_logit_diff"]) < 0.01 * float(row["max_logit"])
    member = DOWNLOADABLE_MODELS["smollm2-135m-instruct"].member.rsplit("/", 1)[-1]
    if not (cache_dir() / "models" / member).is_file():
        pytest.skip("smollm2-135m-instruct is not cached here: copes-fetch smollm2-135m-instruct")
    smollm2 = ["--types", "f32", "--prompts", "2", "--new-tokens", "6"]
    (row,) = _llama_cpp_rows(monkeypatch, tmp_path / "smollm2", smollm2)
    assert row["pre_tokenizer"] == "gpt-2" and row["texts_same_tokens"] == row["texts"] == "3"
    assert row["argmax_agree"] == row["positions"] and row["greedy_same"] == row["prompts"] == "2"


def test_sandbox_throughput_times_a_git_revision_against_this_checkout() -> None:
    if subprocess.run(["git", "-C", str(BENCH_DIR), "rev-parse", "HEAD"], capture_output=True).returncode:
        pytest.skip("not a git checkout: there is no revision to compare against")
    rows = sandbox_throughput.measure("HEAD", runs_per_round=1, rounds=1)
    assert [row["sandbox"] for row in rows][:2] == ["HEAD", "this"]  # then the Landlock tier, where there is one
    assert rows[0]["ratio"] == 1 and all(row["runs_per_s"] > 0 for row in rows)


GPU_CHECK_PHASES = ("kernels", "rollout", "speed", "shapes", "generation", "trainer", "vllm")


@pytest.mark.integration
def test_gpu_check_dry_run_returns_one_tarball_with_a_summary_per_phase(tmp_path: Path) -> None:
    """bench/gpu_check.sh --cpu-dry-run: every phase's logic on the CPU at small shapes, and of what it writes only
    one file comes back under $OUT (the device returns few), holding each phase's log and results."""
    out = tmp_path / "out"
    done = subprocess.run(["bash", str(BENCH_DIR / "gpu_check.sh"), "--cpu-dry-run"], capture_output=True, text=True,
                          timeout=600, env={**os.environ, "OUT": str(out), "TMPDIR": str(tmp_path)})
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]
    summaries = [line for line in done.stdout.splitlines() if line.startswith("== ")]
    assert [line.split(":")[0] for line in summaries] == [f"== {p}" for p in (*GPU_CHECK_PHASES, "bundle")]
    # A phase with nothing to run here says so (#35: the vLLM phase said "passed" when vLLM was absent).
    assert all(": passed in " in line for line in summaries[:-1] if not line.startswith("== vllm")), done.stdout
    assert next(line for line in summaries if line.startswith("== vllm")).startswith("== vllm: not run in ")
    assert [path.name for path in out.iterdir()] == ["gpu_check.tar.gz"]
    with tarfile.open(out / "gpu_check.tar.gz") as bundle:
        names = {Path(name).name for name in bundle.getnames()}
        shapes = json.loads(bundle.extractfile("./shapes.json").read())
        rollout = json.loads(bundle.extractfile("./rollout.json").read())
    assert {f"{p}.{kind}" for p in GPU_CHECK_PHASES for kind in ("log", "json")} | {"summary.txt"} <= names
    assert shapes["restore"]["device"]["bitwise"] and shapes["restore"]["host"]["bitwise"]
    assert shapes["perturbed_equal"] and shapes["updated_equal"]
    # The rollout phase's peak beside the plan's for the same run (on a GPU: capped at 24 GiB, the 24 GB claim).
    assert rollout["error"] is None and rollout["plan"]["peak_bytes"] > 0 and rollout["measured_over_planned"] > 0
    assert rollout["delta_rule_path"] and rollout["conv1d_path"]
    # #53: the rollout runs the plan's rows on contexts long enough for its kept-copy and last-turn peaks; the speed
    # phase puts ms per decode step beside the memory-bandwidth floor and estimates one headline step.
    assert rollout["rows"] == rollout["plan"]["rows"] and rollout["context_tokens"] > 500
    speed = next(line for line in summaries if line.startswith("== speed"))
    assert "floor" in speed and "headline step" in speed, speed
    assert "hf eager: " in speed and "hf graphs: " in speed, speed  # the HF engine's static decode timed too
    assert not list(tmp_path.glob("gpu-check.*")), "the work folder outlived the script"


def test_the_speed_phases_hf_graphs_engine_is_the_hf_engines_static_decode() -> None:
    """#53: the GPU check's speed phase times "hf graphs", copes' own static decode (replayed as CUDA graphs on a
    GPU; on the CPU dry run the same decode without graphs), beside "hf eager": in fp32 on the CPU both give the
    same greedy tokens, so they time the same work."""
    from transformers import AutoModelForCausalLM, Qwen3_5TextConfig

    sys.path.insert(0, str(BENCH_DIR / "device"))
    import gpu_check

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(Qwen3_5TextConfig(**gpu_check.QWEN35_TINY), dtype=torch.float32).eval()
    prompts = torch.randint(1, 512, (3, 24), generator=torch.Generator().manual_seed(1)).tolist()
    graphs, eager = gpu_check.hf_engine(model, graphs=True), gpu_check.hf_engine(model, graphs=False)
    assert (graphs.decode, eager.decode) == ("static", "eager")
    assert graphs.generate_ids(prompts, [10] * 3, eos=set()) == eager.generate_ids(prompts, [10] * 3, eos=set())


def test_the_gpu_checks_generation_phase_fails_on_an_out_of_memory(monkeypatch: pytest.MonkeyPatch) -> None:
    """#53: the generation phase reported an out-of-memory as a pass. A CPU cannot run out of device memory, so the
    turn's OOM record is what `generate_turn` returns when `generate` raises torch.OutOfMemoryError."""
    sys.path.insert(0, str(BENCH_DIR / "device"))
    import gpu_check

    monkeypatch.setattr(gpu_check, "qwen35_model", lambda sizes: None)
    out_of_memory = {"oom": "CUDA out of memory", "peak_gib_above_weights": 1.0}
    monkeypatch.setattr(gpu_check, "generate_turn", lambda *args: out_of_memory)
    found = gpu_check.generation(gpu_check.CPU_DRY_RUN)
    assert not found["ok"] and "OOM" in found["summary"]

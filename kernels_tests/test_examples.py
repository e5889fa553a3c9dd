"""The examples: a plain ES loop on nothing but copes_kernels must actually learn."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

import pytest

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def load_example(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, EXAMPLES / f"{name}.py")
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    return example


@pytest.mark.slow
def test_embedded_es_loop_raises_the_reward(capsys: pytest.CaptureFixture[str]) -> None:
    history = load_example("embed_es").evolve(steps=30, log_every=10)
    assert len(history) == 30
    assert history[-1] > history[0] + 0.3  # -MSE from about -0.8 to about -0.3 in 30 steps
    assert "step   20  reward" in capsys.readouterr().out


@pytest.mark.slow
def test_the_ported_openai_es_loop_raises_the_reward(capsys: pytest.CaptureFixture[str]) -> None:
    """examples/openai_es.py: OpenAI-ES on ck.WeightSet (bf16, one seed per member, stochastic rounding)."""
    history = load_example("openai_es").evolve(iterations=30, log_every=10)
    assert len(history) == 30
    assert history[-1] > history[0] + 0.2
    assert "iteration   20  reward" in capsys.readouterr().out

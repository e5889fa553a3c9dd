"""examples/embed_es.py: a plain ES loop on nothing but copes_kernels must actually learn."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "embed_es.py"


@pytest.mark.slow
def test_embedded_es_loop_raises_the_reward(capsys: pytest.CaptureFixture[str]) -> None:
    spec = importlib.util.spec_from_file_location("embed_es", EXAMPLE)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    history = example.evolve(steps=30, log_every=10)
    assert len(history) == 30
    assert history[-1] > history[0] + 0.3  # -MSE from about -0.8 to about -0.3 in 30 steps
    assert "step   20  reward" in capsys.readouterr().out

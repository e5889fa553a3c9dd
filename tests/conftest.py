"""Fixtures the orchestrator tests share: one torch thread per test module, and the tiny tokenizer / model
(`tiny_models`) that the rollout, agent and evaluation tests generate with."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from tiny_models import build_tiny_tokenizer, tiny_qwen3


@pytest.fixture(autouse=True, scope="module")
def one_torch_thread() -> Iterator[None]:
    """Tiny models gain nothing from intra-op threads, and on a shared CPU the hand-offs cost more than the math
    (the tests ran twice as long); the previous count is restored after each module."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory):
    """The tiny byte-level BPE tokenizer with the Qwen-style chat template."""
    return build_tiny_tokenizer(tmp_path_factory.mktemp("tok"))


@pytest.fixture(scope="module")
def model(tokenizer):
    """The random-weight tiny Qwen3 sized to `tokenizer` (seed 0)."""
    return tiny_qwen3(tokenizer, seed=0)

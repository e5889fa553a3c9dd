"""Fixtures the orchestrator tests share: one torch thread per test module, the tiny tokenizer / model
(`tiny_models`) that the rollout, agent and evaluation tests generate with, and the data folder (`datadir`: the
full sets, else the slices in tests/fixtures/data).

No test reaches the Hugging Face hub: the offline switches are set here, for the whole session and every process
a test starts, before anything imports huggingface_hub (it reads them once, at import). A test that starts
`copes-run` must be marked `integration` (cli_runs refuses otherwise), so the default lane stays fast.
"""

from __future__ import annotations

import os

HUB_OFFLINE = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
os.environ.update(HUB_OFFLINE)

from collections.abc import Iterator  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

from helpers import cli_runs  # noqa: E402
from helpers.datadir import DATA_DIR  # noqa: E402
from helpers.timing import seconds  # noqa: E402
from helpers.tiny_models import build_tiny_tokenizer, tiny_qwen3  # noqa: E402

# The copes-run processes and get_task's default read the same folder as the tests (the slices on a bare clone:
# never the hub, never a COPES_DATA_DIR that names a missing folder).
os.environ["COPES_DATA_DIR"] = str(DATA_DIR)


def pytest_runtest_setup(item: pytest.Item) -> None:
    """Before the item's fixtures (a module-scoped run is started by the first test that needs it). The vllm lane
    is one of its own (.ci/run runs it apart), so its runs count as integration too."""
    cli_runs.INTEGRATION_TEST = any(item.get_closest_marker(lane) for lane in ("integration", "vllm"))


@pytest.fixture(autouse=True, scope="module")
def one_torch_thread() -> Iterator[None]:
    """Tiny models gain nothing from intra-op threads, and on a shared CPU the hand-offs cost more than the math
    (the tests ran twice as long); the previous count is restored after each module."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def data_dir() -> Path:
    """The real datasets' folder: the full sets ($COPES_DATA_DIR, else ../shared/data), else the repository's slices."""
    return DATA_DIR


@pytest.fixture(scope="session")
def sandbox_start_s() -> float:
    """The seconds a trivial sandbox run takes here and now (the slower of two): the unit the sandbox's
    deadline tests measure their slack in, so that a loaded machine does not fail them."""
    from copes.tools import PythonSandbox

    return max(seconds(lambda: PythonSandbox(timeout_s=30.0).run("pass")) for _ in range(2))


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory):
    """The tiny byte-level BPE tokenizer with the Qwen-style chat template."""
    return build_tiny_tokenizer(tmp_path_factory.mktemp("tok"))


@pytest.fixture(scope="module")
def model(tokenizer):
    """The random-weight tiny Qwen3 sized to `tokenizer` (seed 0)."""
    return tiny_qwen3(tokenizer, seed=0)

"""The test suite's own guarantees (docs/testing.md): no test reaches the Hugging Face hub, data comes from one
folder, and a test that starts copes-run cannot sit in the fast default lane."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from helpers import cli_runs
from helpers.paths import REPO

TEST_SOURCES = sorted([*(REPO / "tests").rglob("*.py"), *(REPO / "kernels_tests").glob("*.py")])


def test_the_hub_is_offline_for_the_whole_session() -> None:
    from huggingface_hub import constants

    assert constants.HF_HUB_OFFLINE, "huggingface_hub was imported before conftest.py switched it offline"


@pytest.mark.parametrize("source", TEST_SOURCES, ids=lambda path: path.name)
def test_no_test_turns_the_hub_back_on_or_hard_codes_the_data_folder(source: Path) -> None:
    text = source.read_text(encoding="utf-8")
    assert not re.search(r"""(HF_HUB_OFFLINE|HF_DATASETS_OFFLINE|TRANSFORMERS_OFFLINE)["']?\s*[:=,]\s*["']?(0|false)""",
                         text, re.IGNORECASE), "a test switches the hub back on"
    assert not re.search(r"""delenv\(\s*["'](HF_HUB_OFFLINE|HF_DATASETS_OFFLINE|TRANSFORMERS_OFFLINE)""", text)
    if source.name != "datadir.py":
        assert not re.search(r"""["']shared["']\s*\)?\s*/\s*["']data["']""", text), "use datadir.DATA_DIR"


def test_copes_run_is_refused_outside_an_integration_test() -> None:
    with pytest.raises(AssertionError, match="mark it @pytest.mark.integration"):
        cli_runs.copes_run("--steps", "0")

"""The docs a user reads are in the repository and stay true to it: every relative link in README.md and docs/
resolves, nothing a user reads or runs points outside the checkout, every TrainConfig field is in the
configuration reference, and the README stays short enough to read in five minutes."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest

from copes.config.options import TrainConfig

from helpers.paths import REPO

DOCS = [REPO / "README.md", REPO / "bench" / "README.md", *sorted((REPO / "docs").glob("*.md"))]
LINK = re.compile(r"\]\(([^)#\s]+)(#[^)\s]*)?\)")


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(REPO)))
def test_every_relative_link_resolves(doc: Path) -> None:
    broken = [target for target, _ in LINK.findall(doc.read_text())
              if "://" not in target and not (doc.parent / target).exists()]
    assert not broken, f"{doc.relative_to(REPO)} links to missing files: {broken}"


def test_nothing_a_user_reads_points_outside_the_checkout() -> None:
    user_facing = [*DOCS, *REPO.glob("copes/**/*.py"), *REPO.glob("copes_kernels/**/*.py"),
                   *REPO.glob("examples/**/*.py"), *REPO.glob("configs/*.yaml"), *REPO.glob("copes/assets/**/*.md")]
    outside = [str(path.relative_to(REPO)) for path in user_facing
               if re.search(r"\.\./shared|DESIGN\.md", path.read_text(errors="replace"))]
    assert not outside, f"these point outside the repository: {outside}"


def test_every_config_field_is_in_the_configuration_reference() -> None:
    reference = (REPO / "docs" / "configuration.md").read_text()
    missing = [f.name for f in dataclasses.fields(TrainConfig) if f"`{f.name}`" not in reference]
    assert not missing, f"docs/configuration.md does not list: {missing}"


def test_the_readme_fits_on_a_few_screens() -> None:
    lines = (REPO / "README.md").read_text().splitlines()
    assert len(lines) <= 160, f"README.md has {len(lines)} lines; move detail into docs/"


def test_bench_readme_lists_every_measurement_script() -> None:
    """bench/README.md's table has a row per measurement script (bench/*.py; the shared code and the GPU check's
    parts live in bench/common/ and bench/device/), each naming the doc that holds its result."""
    rows = {line.split("|")[1].strip(): line for line in (REPO / "bench" / "README.md").read_text().splitlines()
            if line.startswith("| `")}
    scripts = sorted(path.name for path in (REPO / "bench").glob("*.py"))
    missing = [name for name in scripts if f"`{name}`" not in rows]
    assert not missing, f"bench/README.md's table does not list: {missing}"
    assert all("../docs/" in rows[f"`{name}`"] for name in scripts), "every row links the doc with its result"

"""The docs a user reads are in the repository and stay true to it: every relative link in README.md and docs/
resolves, nothing a user reads or runs points outside the checkout, every TrainConfig field is in the
configuration reference, and the README stays short enough to read in five minutes."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest

from copes.run.config import TrainConfig

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

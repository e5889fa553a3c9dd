"""Where the tests find the repository and its fixtures, wherever a test file sits in the tree."""

from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
FIXTURES = REPO / "tests" / "fixtures"

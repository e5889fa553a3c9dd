"""Optional dependencies, imported only where they are used: math-verify (math rewards), bm25s (local search),
datasets (hub splits). `copes`, `copes_kernels` and the benchmarks import without them, so a bare GPU image runs
the kernels, the engine and the synthetic task; a feature that needs one fails with one line naming the extra."""

from __future__ import annotations

import importlib
import importlib.util
from types import ModuleType

from copes.errors import UserError

# module -> (pip package, extra of this package that installs it, what needs it)
OPTIONAL = {
    "math_verify": ("math-verify", "math", "math answer checking"),
    "bm25s": ("bm25s", "search", "the local BM25 search tool"),
    "datasets": ("datasets", "hub", "loading a split from the Hugging Face hub"),
}


def _missing(module: str) -> UserError:
    package, extra, purpose = OPTIONAL[module]
    return UserError(f"{purpose} needs the {package!r} package, which is not installed: pip install 'copes[{extra}]'")


def require(module: str) -> ModuleType:
    """Import an optional dependency, or fail with the one-line error naming its extra."""
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as error:
        if error.name != module:
            raise
        raise _missing(module) from None


def check_installed(module: str) -> None:
    """Fail early (before starting workers or reading data) when an optional dependency is missing."""
    if importlib.util.find_spec(module) is None:
        raise _missing(module)

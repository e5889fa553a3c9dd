"""CoPES: cooperative parameter-subspace evolution strategies for LLM post-training.

    es = copes.CoPES(model, population=40, num_subspaces=4, sigma=1e-3, lr=5e-4, seed=0)
    stats = es.step(fitness_fn)   # fitness_fn(model) -> float or per-question rewards
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

# Strategies load on first use so `import copes` (e.g. for the CLI's --help) stays light.
_LAZY = {
    "CoPES": "copes.strategies",
    "EGGROLL": "copes.strategies",
    "CoPESLowRank": "copes.strategies",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'copes' has no attribute {name!r}")


__all__ = ["CoPES", "CoPESLowRank", "EGGROLL", "__version__"]

"""CoPES: cooperative parameter-subspace evolution strategies for LLM post-training.

    es = copes.CoPES(model, population=40, num_subspaces=4, sigma=1e-3, lr=5e-4, seed=0)
    stats = es.step(fitness_fn)   # fitness_fn(model) -> float or per-question rewards

    summary = copes.train(copes.TrainConfig(task="gsm8k", model="Qwen/Qwen3.5-4B"))   # a whole copes-run

    trainer = copes.ESTrainer(model=..., reward_funcs=[...], args=copes.ESConfig(...), train_dataset=...)  # TRL's way
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

# The public names and the module each lives in. Importing them eagerly would load torch and transformers for
# every `copes.*` import (the CLI's --help took 4.6 s of CPU instead of 0.05 s), so they load on first use; the
# TYPE_CHECKING imports below show the very same names to IDEs and type checkers.
_EXPORTS = {
    "CoPES": "copes.es.strategies",
    "CoPESLowRank": "copes.es.strategies",
    "EGGROLL": "copes.es.strategies",
    "ESConfig": "copes.trl.config",
    "ESTrainer": "copes.trl.trainer",
    "ParameterSpace": "copes.es.params",
    "StepPlan": "copes.es.strategies",
    "StepStats": "copes.es.strategies",
    "Strategy": "copes.es.strategies",
    "TrainConfig": "copes.config.options",
    "Trainer": "copes.run.trainer",
    "UserError": "copes.errors",
    "build_config": "copes.config.options",
    "train": "copes.run.trainer",
}

if TYPE_CHECKING:
    from copes.config.options import TrainConfig, build_config
    from copes.errors import UserError
    from copes.es.params import ParameterSpace
    from copes.es.strategies import EGGROLL, CoPES, CoPESLowRank, StepPlan, StepStats, Strategy
    from copes.run.trainer import Trainer, train
    from copes.trl.config import ESConfig
    from copes.trl.trainer import ESTrainer


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'copes' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(__all__)


__all__ = [*_EXPORTS, "__version__"]

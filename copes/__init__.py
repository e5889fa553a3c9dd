"""CoPES: cooperative parameter-subspace evolution strategies for LLM post-training.

    es = copes.CoPES(model, population=40, num_subspaces=4, sigma=1e-3, lr=5e-4, seed=0)
    stats = es.step(fitness_fn)   # fitness_fn(model) -> float or per-question rewards

    summary = copes.train(copes.TrainConfig(task="gsm8k", model="Qwen/Qwen3.5-4B"))   # a whole copes-run
"""

from copes.config import TrainConfig, build_config
from copes.errors import UserError
from copes.strategies import EGGROLL, CoPES, CoPESLowRank, StepPlan, StepStats, Strategy
from copes.trainer import Trainer, train

__version__ = "0.1.0"

__all__ = [
    "EGGROLL",
    "CoPES",
    "CoPESLowRank",
    "StepPlan",
    "StepStats",
    "Strategy",
    "TrainConfig",
    "Trainer",
    "UserError",
    "__version__",
    "build_config",
    "train",
]

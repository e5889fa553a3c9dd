"""ES strategies: CoPES (standard ES is CoPES with num_subspaces=1), EGGROLL and the low-rank hybrid."""

from copes.strategies.copes import CoPES, StepPlan, StepStats
from copes.strategies.eggroll import EGGROLL, CoPESLowRank

__all__ = ["EGGROLL", "CoPES", "CoPESLowRank", "StepPlan", "StepStats"]

"""ES strategies: CoPES (standard ES is CoPES with num_subspaces=1), EGGROLL and the low-rank hybrid, over the
shared types and the `Strategy` protocol of `copes.es.strategies.base`."""

from copes.es.strategies.base import (
                                   PER_MEMBER,
                                   WHOLE_POPULATION,
                                   PerMemberStrategy,
                                   PopulationStrategy,
                                   StepPlan,
                                   StepStats,
                                   Strategy,
                                   step_seed,
)
from copes.es.strategies.copes import CoPES
from copes.es.strategies.eggroll import EGGROLL, CoPESLowRank

__all__ = ["EGGROLL", "PER_MEMBER", "WHOLE_POPULATION", "CoPES", "CoPESLowRank", "PerMemberStrategy",
           "PopulationStrategy", "StepPlan", "StepStats", "Strategy", "step_seed"]

"""The value lists of the options that take one of a few names, defined once: the library validates against them
and the config / CLI offer them as choices. Nothing heavy is imported, so the CLI's --help stays light."""

from typing import NamedTuple


class Algorithm(NamedTuple):
    """One row of the algorithm table; every list of algorithm names below derives from it."""

    name: str
    strategy: str  # the class in copes.es.strategies that runs it
    help: str
    per_member: bool  # perturbs the weights member by member (else: the whole population in one batched forward)
    subspaces: bool  # takes --subspaces (K); otherwise K = 1
    low_rank: bool  # members are rank-r perturbations (--rank)


ALGORITHM_TABLE = (
    Algorithm("copes", "CoPES", "K random parameter subspaces, N/K members each", True, True, False),
    Algorithm("es", "CoPES", "standard ES: copes with K=1", True, False, False),
    Algorithm("eggroll", "EGGROLL", "rank-r members, the whole population in one batched forward", False, False, True),
    Algorithm("copes-lowrank", "CoPESLowRank", "EGGROLL's low-rank members inside CoPES subspaces", False, True, True),
)
ALGORITHMS_BY_NAME = {a.name: a for a in ALGORITHM_TABLE}
ALGORITHMS = tuple(ALGORITHMS_BY_NAME)
PER_MEMBER_ALGORITHMS = tuple(a.name for a in ALGORITHM_TABLE if a.per_member)
SUBSPACE_ALGORITHMS = tuple(a.name for a in ALGORITHM_TABLE if a.subspaces)
LOWRANK_ALGORITHMS = tuple(a.name for a in ALGORITHM_TABLE if a.low_rank)
DTYPES = ("auto", "float32", "bfloat16", "float16")
RESTORE_MODES = ("device", "host", "subtract")
UPDATE_PRECISIONS = ("auto", "native", "stochastic", "master_device", "master_host")
FITNESS_MODES = ("joint", "per_subspace", "centered_rank", "per_question")
OPTIMIZERS = ("sgd", "adam")
TOOL_FORMATS = ("auto", "qwen", "tags")
ROLLOUT_ENGINES = ("auto", "hf", "vllm")
VLLM_CPU_WEIGHTS = ("plain", "packed")

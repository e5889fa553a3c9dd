"""copes_kernels: the noise contract and fused ES ops (perturb, restore, accumulate, low-rank).

Knows nothing about models or tasks: embed it in any ES trainer. The contract, in this repository:
docs/noise-contract.md; how to embed it: docs/embedding.md.
"""

from copes_kernels.dispatch import (
    accumulate_,
    backend_for,
    backup_chunks,
    lowrank_accumulate_,
    lowrank_factors,
    lowrank_linear,
    multi_accumulate_,
    multi_perturb_,
    multi_restore_,
    normal,
    perturb_,
    philox4x32_10,
    restore_chunks_,
)
from copes_kernels.partition import DEFAULT_CHUNK_SIZE, make_partition, num_chunks
from copes_kernels.rounding import round_stochastic, rounding_uniforms
from copes_kernels.run_tables import RunTable, build_run_table
from copes_kernels.warm_up import warm_up
from copes_kernels.weight_set import WeightSet, tensor_id_of

__all__ = [
    "DEFAULT_CHUNK_SIZE",
    "accumulate_",
    "backend_for",
    "backup_chunks",
    "build_run_table",
    "lowrank_accumulate_",
    "lowrank_factors",
    "lowrank_linear",
    "make_partition",
    "multi_accumulate_",
    "multi_perturb_",
    "multi_restore_",
    "normal",
    "num_chunks",
    "perturb_",
    "philox4x32_10",
    "restore_chunks_",
    "round_stochastic",
    "rounding_uniforms",
    "RunTable",
    "WeightSet",
    "tensor_id_of",
    "warm_up",
]

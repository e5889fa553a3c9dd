"""copes_kernels: the noise contract and fused ES ops (perturb, restore, accumulate, low-rank).

Knows nothing about models or tasks: embed it in any ES trainer. See DESIGN.md for the binding contract.
"""

from copes_kernels._dispatch import (
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
from copes_kernels.run_tables import RunTable, build_run_table

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
    "RunTable",
]

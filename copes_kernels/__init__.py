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
    normal,
    perturb_,
    philox4x32_10,
    restore_chunks_,
)
from copes_kernels.partition import DEFAULT_CHUNK_SIZE, make_partition, num_chunks

__all__ = [
    "DEFAULT_CHUNK_SIZE",
    "accumulate_",
    "backend_for",
    "backup_chunks",
    "lowrank_accumulate_",
    "lowrank_factors",
    "lowrank_linear",
    "make_partition",
    "normal",
    "num_chunks",
    "perturb_",
    "philox4x32_10",
    "restore_chunks_",
]

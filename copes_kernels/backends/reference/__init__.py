"""The reference backend: every public op in pure torch (Philox in exact numpy), the oracle of the others.

    per_tensor    the per-tensor ops (noise regenerated per run of selected chunks, in tiles: never a full-size
                  noise tensor)
    multi_tensor  the run-table ops, as loops over the per-tensor ones
"""

from copes_kernels.backends import OP_NAMES

# Every backend's face imports the same op names (OP_NAMES) by name, so IDEs and type checkers see them: the
# list repeats across backends/*/__init__.py on purpose.
from copes_kernels.backends.reference.multi_tensor import multi_accumulate_, multi_perturb_, multi_restore_
from copes_kernels.backends.reference.per_tensor import (
    accumulate_,
    backup_chunks,
    lowrank_accumulate_,
    lowrank_factors,
    lowrank_linear,
    normal,
    perturb_,
    philox4x32_10,
    restore_chunks_,
    round_stochastic,
    uniform_stream,
)

__all__ = [*OP_NAMES, "round_stochastic", "uniform_stream"]

"""The Triton backend: every public op as Triton kernels plus host launchers that validate and fail clearly.

    rng           the noise contract inside kernels (Philox tiles, uniforms, Box-Muller) and the stream arguments
    shared        how a float32 result is stored (round to nearest even, stochastic rounding), tile sizes
    perturb       perturb / chunk backup / restore        update        the reward-weighted accumulate
    lowrank       EGGROLL factors, batched low-rank linear, low-rank update
    multi_tensor  run-table launches: one kernel per member's perturb, its restore, a group's update

On CPU tensors these run in Triton's interpreter, which must be chosen (TRITON_INTERPRET=1) before this package
is first imported: the dispatcher sets it then when no GPU is in play.
"""

from copes_kernels.backends import OP_NAMES
from copes_kernels.backends.triton.lowrank import lowrank_accumulate_, lowrank_factors, lowrank_linear
from copes_kernels.backends.triton.multi_tensor import multi_accumulate_, multi_perturb_, multi_restore_
from copes_kernels.backends.triton.perturb import backup_chunks, perturb_, restore_chunks_
from copes_kernels.backends.triton.rng import normal, philox4x32_10
from copes_kernels.backends.triton.update import accumulate_

__all__ = list(OP_NAMES)

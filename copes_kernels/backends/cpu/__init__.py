"""The compiled CPU backend: every public op as a numba (LLVM) loop, multi-threaded over fixed tiles.

    numba_cache   the on-disk cache, stamped with this package's and the contract's source
    numerics      the noise contract and 16-bit storage conversions, inlined into the kernels
    kernels       per-tensor kernels          multi_kernels   run-table kernels (every tensor of a group per call)
    ops           per-tensor public ops       multi_tensor    run-table public ops
    warm_up       compile (or load from the cache) every kernel ahead of a run, timed

Compilations are cached on disk, so only the first process on a machine compiles (~10-20 s); `warm_up` lets a
trainer pay that as its own phase instead of inside its first perturb and update.
"""

from copes_kernels.backends import OP_NAMES

# The op names imported by name, as every backend's face does (see backends/reference/__init__.py).
from copes_kernels.backends.cpu.multi_tensor import multi_accumulate_, multi_perturb_, multi_restore_
from copes_kernels.backends.cpu.ops import (
    accumulate_,
    backup_chunks,
    lowrank_accumulate_,
    lowrank_factors,
    lowrank_linear,
    normal,
    perturb_,
    philox4x32_10,
    restore_chunks_,
    store_stochastic_,
    use_torch_threads,
)

__all__ = [*OP_NAMES, "store_stochastic_", "use_torch_threads"]

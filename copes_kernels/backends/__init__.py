"""The backends: one package per implementation of the public ops, each exporting every name in OP_NAMES with the
same signature and the same contract (see docs/noise-contract.md).

    reference/  pure torch + numpy: the oracle every other backend is tested against (and the CPU fallback)
    cpu/        numba (LLVM) loops over fixed tiles, multi-threaded: the CPU training path
    triton/     Triton kernels: CUDA tensors (and CPU tensors through Triton's interpreter, for tests)

A backend imports the contract (rng, partition, run_tables, _validate, _public_ops), never the dispatcher or another
backend.
This package imports none of them: the dispatcher loads a backend on its first op, so numba and triton load only
where they run.
"""

# Every public op, once: the dispatcher routes these names, and every backend package exports each of them.
OP_NAMES = (
    "philox4x32_10",
    "normal",
    "perturb_",
    "backup_chunks",
    "restore_chunks_",
    "accumulate_",
    "lowrank_factors",
    "lowrank_linear",
    "lowrank_accumulate_",
    "multi_perturb_",
    "multi_restore_",
    "multi_accumulate_",
)

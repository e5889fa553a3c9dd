"""Run every compiled CPU kernel once on tiny tensors of each storage dtype: numba compiles each kernel (or loads it
from the on-disk cache) on its first call with a new type signature, so after this a run compiles nothing."""

from __future__ import annotations

from collections.abc import Iterable

import torch

from copes_kernels.backends.cpu import multi_tensor, ops
from copes_kernels.partition import make_partition
from copes_kernels.run_tables import build_run_table

# Enough rows that the low-rank correction takes its parallel kernel when more than one thread runs.
_ROWS = 80


def compile_kernels(dtypes: Iterable[torch.dtype]) -> None:
    """Every kernel, for every dtype in `dtypes` (float32, bfloat16, float16), on throwaway tensors."""
    ops.philox4x32_10(torch.zeros(1, 4, dtype=torch.int64), torch.zeros(1, 2, dtype=torch.int64))
    ops.normal(8, seed=1, member=0, tensor_id=0)
    A, B = ops.lowrank_factors(seed=1, member=[0, 1], tensor_id=0, out_features=4, in_features=8, rank=1)
    for dtype in dtypes:
        weight = torch.zeros(4, 8, dtype=dtype)
        (partition,) = make_partition([2], num_subspaces=2, seed=1)
        flat = weight.view(-1)
        layout = dict(chunk_subspace=partition, subspace=0, chunk_size=16)
        ops.restore_chunks_(flat, ops.backup_chunks(flat, **layout), **layout)
        ops.perturb_(flat, seed=1, member=0, tensor_id=0, sigma=0.1, **layout)
        rounding = "nearest" if dtype == torch.float32 else "stochastic"
        ops.accumulate_(flat, seed=1, members=[0], coeffs=[0.1], tensor_id=0, rounding=rounding)
        ops.lowrank_linear(torch.zeros(_ROWS, 8, dtype=dtype), weight, None, A=A, B=B,
                           row_member=torch.zeros(_ROWS, dtype=torch.int64), sigma=0.1)
        ops.lowrank_accumulate_(weight, A=A, B=B, coeffs=[0.1, 0.2], scale=1.0, rounding=rounding)
        table = build_run_table([flat], tensor_ids=[0])
        backup = torch.empty(table.backup_numel, dtype=dtype)
        multi_tensor.multi_perturb_(table, seed=1, member=0, sigma=0.1, backup=backup)
        multi_tensor.multi_restore_(table, backup)
        multi_tensor.multi_accumulate_(table, seed=1, members=[0], coeffs=[0.1], rounding=rounding)

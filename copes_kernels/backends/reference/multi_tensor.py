"""The reference multi-tensor ops: the per-tensor reference ops looped over a run table's tensors.

Same signatures and results as the compiled run-table ops (bit for bit, being the per-tensor ops of the same
backend); they call the reference per-tensor ops directly, never the dispatcher.
"""

from __future__ import annotations

import torch

from copes_kernels import _public_ops as ops
from copes_kernels import _validate as v
from copes_kernels.backends.reference.per_tensor import accumulate_, backup_chunks, perturb_, restore_chunks_
from copes_kernels.run_tables import RunTable


def multi_perturb_(table: RunTable, *, seed: int, member: int, sigma: float,
                   backup: torch.Tensor | None = None) -> None:
    """Perturb every tensor of `table` on its subspace's chunks, first packing them into `backup` when given."""
    v.check_multi_perturb_args(table, seed=seed, member=member, sigma=sigma, backup=backup)
    cursor = 0
    for tensor, tensor_id, chunk_subspace in zip(table.tensors, table.tensor_ids, table.chunk_subspaces):
        layout = dict(chunk_subspace=chunk_subspace, subspace=table.subspace, chunk_size=table.chunk_size)
        if backup is not None:
            packed = backup_chunks(tensor, **layout)
            backup[cursor : cursor + packed.numel()].copy_(packed)
            cursor += packed.numel()
        perturb_(tensor, seed=seed, member=member, tensor_id=tensor_id, sigma=sigma, **layout)


def multi_restore_(table: RunTable, backup: torch.Tensor) -> None:
    """Write a `multi_perturb_` backup back into its chunks: the exact inverse, bit for bit."""
    v.check_multi_backup(table, backup)
    cursor = 0
    for tensor, chunk_subspace, size in zip(table.tensors, table.chunk_subspaces, table.backup_sizes):
        restore_chunks_(
            tensor, backup[cursor : cursor + size], chunk_subspace=chunk_subspace, subspace=table.subspace,
            chunk_size=table.chunk_size,
        )
        cursor += size


@ops.multi_accumulate_op
def multi_accumulate_(table, streams, coeffs_h, subspaces_h, rounding_seed, rounding) -> torch.Tensor:
    """the per-tensor reference `accumulate_` on each tensor in turn."""
    member_seeds = [key0 | key1 << 32 for _, key0, key1 in streams.tolist()]
    squared = torch.zeros((), dtype=torch.float64, device=table.device)
    for tensor, tensor_id, chunk_subspace in zip(table.tensors, table.tensor_ids, table.chunk_subspaces):
        before = tensor.clone()
        accumulate_(
            tensor, seed=rounding_seed, seeds=member_seeds, members=streams[:, 0], coeffs=coeffs_h,
            tensor_id=tensor_id, chunk_subspace=chunk_subspace, member_subspaces=subspaces_h,
            chunk_size=table.chunk_size, rounding=rounding,
        )
        norm = torch.linalg.vector_norm(tensor.float() - before.float(), dtype=torch.float64)
        squared += norm * norm
    return squared

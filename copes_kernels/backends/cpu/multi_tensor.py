"""The compiled CPU backend's multi-tensor ops: one compiled call per run table (see run_tables.py)."""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import numpy as np
import torch

from copes_kernels import _public_ops as ops
from copes_kernels import _validate as v
from copes_kernels.backends.cpu.multi_kernels import (
    multi_accumulate_kernel,
    multi_perturb_kernel,
    multi_restore_kernel,
)
from copes_kernels.backends.cpu.ops import kernel_array, philox_key, use_torch_threads
from copes_kernels.run_tables import BACKUP, START, STOP, TENSOR, RunTable

# Integer types of the storage's width: backups move raw bits.
_BITS_VIEWS = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16}


@dataclass(frozen=True)
class _KernelTable:
    """What the multi-tensor kernels take from a run table: numpy views of its columns, the tensors' sizes, and
    empty arrays that carry the element types (storage, and same-width integers for raw bits)."""

    runs: np.ndarray
    pointers: np.ndarray
    numels: np.ndarray
    ids: np.ndarray
    like: np.ndarray
    no_backup: np.ndarray


# Built once per table (a table lives one step), dropped with it.
_kernel_tables: weakref.WeakKeyDictionary[RunTable, _KernelTable] = weakref.WeakKeyDictionary()


def _kernel_table(table: RunTable) -> _KernelTable:
    """The kernels' view of `table`, checked once: its addresses are its tensors' and its rows lie inside them, so
    the kernels never write outside a tensor or its backup."""
    cached = _kernel_tables.get(table)
    if cached is not None:
        return cached
    runs, pointers = table.runs.numpy(), table.pointers.numpy()
    numels = np.array([t.numel() for t in table.tensors], dtype=np.int64)
    if pointers.tolist() != [t.data_ptr() for t in table.tensors]:
        raise ValueError("the run table's data pointers are not its tensors' (rebuild it with build_run_table)")
    if runs.size:
        tensor, start, stop, packed = runs[:, TENSOR], runs[:, START], runs[:, STOP], runs[:, BACKUP]
        inside = (tensor >= 0) & (tensor < numels.size) & (start >= 0) & (start <= stop)
        inside &= stop <= numels[np.clip(tensor, 0, numels.size - 1)]
        inside &= (packed >= 0) & (packed + stop - start <= table.backup_numel)
        if not inside.all():
            raise ValueError("the run table has rows outside its tensors or its backup "
                             "(rebuild it with build_run_table)")
    bits = _BITS_VIEWS[table.dtype]
    like = kernel_array(table.tensors[0][:0])
    cached = _KernelTable(runs, pointers, numels, table.ids.numpy(), like, torch.empty(0, dtype=bits).numpy())
    _kernel_tables[table] = cached
    return cached


def _backup_bits(backup: torch.Tensor) -> np.ndarray:
    return backup.view(_BITS_VIEWS[backup.dtype]).numpy()


def multi_perturb_(table: RunTable, *, seed: int, member: int, sigma: float,
                   backup: torch.Tensor | None = None) -> None:
    """Perturb every tensor of `table` on its subspace's chunks in one compiled call; with `backup`
    (table.backup_numel elements of the table's dtype) first copy those chunks there, packed in row order."""
    v.check_multi_perturb_args(table, seed=seed, member=member, sigma=sigma, backup=backup)
    kernel_table = _kernel_table(table)
    use_torch_threads()
    multi_perturb_kernel(
        kernel_table.runs, kernel_table.pointers, kernel_table.numels, kernel_table.ids, kernel_table.like,
        kernel_table.no_backup if backup is None else _backup_bits(backup), backup is not None, float(sigma),
        int(member), *philox_key(seed),
    )


def multi_restore_(table: RunTable, backup: torch.Tensor) -> None:
    """Write a `multi_perturb_` backup back into its chunks in one compiled call: the exact inverse, bit for bit."""
    v.check_multi_backup(table, backup)
    kernel_table = _kernel_table(table)
    use_torch_threads()
    multi_restore_kernel(kernel_table.runs, kernel_table.pointers, kernel_table.numels, _backup_bits(backup))


@ops.multi_accumulate_op
def multi_accumulate_(table, streams, coeffs_h, subspaces_h, rounding_seed, rounding) -> torch.Tensor:
    """one compiled call for every tensor."""
    kernel_table = _kernel_table(table)
    order = torch.argsort(subspaces_h, stable=True)  # members of one subspace form one segment, in member order
    use_torch_threads()
    squared = multi_accumulate_kernel(
        kernel_table.runs, kernel_table.pointers, kernel_table.numels, kernel_table.ids, kernel_table.like,
        subspaces_h[order].numpy(), streams[order].numpy(), coeffs_h[order].numpy(), rounding == "stochastic",
        *philox_key(rounding_seed),
    )
    return torch.tensor(squared, dtype=torch.float64)

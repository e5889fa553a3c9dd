"""Run tables: one subspace of a group of same-dtype tensors, described once per step for multi-tensor launches.

A table lists, for every tensor of the group (all on one device, one dtype), the chunks a subspace owns as rows

    (tensor index, start, stop, backup offset, subspace)          int64, element bounds [start, stop) in the tensor

plus a tensor table (data pointer, tensor_id). It is built on the host from the CPU-side partition (so sizing it
reads nothing back from the device) and uploaded with one copy; after that `multi_perturb_`, `multi_restore_` and
`multi_accumulate_` touch every tensor of the group in one launch each, with no host sync. `subspace=None` lists
every chunk (the update's table); the backup offsets then pack the whole group.

Without a partition (`chunk_subspaces=None`) the table has one subspace, 0, that owns every chunk: at K=1 one table
serves the full backup, the perturbation, the restore and the update.

A table holds raw data pointers: rebuild it when a tensor of the group is reallocated (once per step is the rule).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from copes_kernels.partition import DEFAULT_CHUNK_SIZE, PARTITION_DTYPE, num_chunks

STORAGE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# Columns of a run row.
TENSOR, START, STOP, BACKUP, SUBSPACE = range(5)
RUN_COLUMNS = 5


@dataclass(frozen=True, eq=False)
class RunTable:
    """The runs of `subspace` (every chunk when None) over `tensors`, on the host and on the device."""

    tensors: tuple[torch.Tensor, ...]  # flat views, same dtype and device
    tensor_ids: tuple[int, ...]
    chunk_subspaces: tuple[torch.Tensor, ...]  # the partition of each tensor, on the tensors' device
    subspace: int | None
    num_subspaces: int
    chunk_size: int
    backup_sizes: tuple[int, ...]  # elements of subspace's chunks in each tensor
    backup_numel: int  # their sum: the packed backup's size
    longest_run: int  # elements of the longest row (sizes the tiles per row)
    byte_alignment: int  # largest power of two <= 16 dividing every data pointer and row bound, in bytes
    runs: torch.Tensor  # int64 [rows, RUN_COLUMNS] on the device
    pointers: torch.Tensor  # int64 [tensors] on the device: data_ptr of each tensor
    ids: torch.Tensor  # int64 [tensors] on the device: tensor_id of each tensor
    requires_grad: bool  # a tensor of the group requires grad: the ops refuse to write it under grad mode

    @property
    def device(self) -> torch.device:
        return self.runs.device

    @property
    def dtype(self) -> torch.dtype:
        return self.tensors[0].dtype

    @property
    def num_runs(self) -> int:
        return self.runs.shape[0]


def upload(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """One host -> device copy, asynchronous on CUDA (through pinned memory), so it never waits for the GPU."""
    if device.type == "cuda":
        host = host.pin_memory()
    return host.to(device, non_blocking=True)


def _host_runs(numel: int, host_partition: np.ndarray, subspace: int | None, chunk_size: int) -> np.ndarray:
    """[rows, 3] (start, stop, subspace) of the chunks of one tensor that `subspace` owns (all when None)."""
    chunks = np.arange(host_partition.size, dtype=np.int64)
    if subspace is not None:
        chunks = chunks[host_partition == subspace]
    starts = chunks * chunk_size
    stops = np.minimum(starts + chunk_size, numel)
    return np.stack([starts, stops, host_partition[chunks].astype(np.int64)], axis=1)


def build_run_table(
    tensors: Iterable[torch.Tensor],
    *,
    tensor_ids: Iterable[int],
    chunk_subspaces: Sequence[torch.Tensor] | None = None,
    host_chunk_subspaces: Sequence[torch.Tensor] | None = None,
    subspace: int | None = None,
    num_subspaces: int | None = None,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
) -> RunTable:
    """The run table of `subspace` over `tensors` (contiguous, one dtype, one device).

    Each tensor maps its chunks with `chunk_subspaces[i]` (from make_partition, on the tensors' device), whose CPU
    copy `host_chunk_subspaces[i]` sizes the table: pass it when the partition lives on a GPU, so building reads
    nothing back (by default it is `chunk_subspaces[i].cpu()`, no copy on CPU). `num_subspaces` defaults to the
    partition's (its largest subspace + 1). Without `chunk_subspaces` there is one subspace, 0, owning every chunk;
    with one subspace `subspace` defaults to it (the same rows as every chunk's).
    """
    tensors = tuple(tensors)
    tensor_ids = tuple(int(i) for i in tensor_ids)
    if not tensors:
        raise ValueError("a run table needs at least one tensor")
    device, dtype = tensors[0].device, tensors[0].dtype
    for tensor in tensors:
        if tensor.device != device or tensor.dtype != dtype:
            raise ValueError(f"a run table's tensors share one device and dtype: {tensor.device}/{tensor.dtype} "
                             f"next to {device}/{dtype}")
    for index, tensor in enumerate(tensors):
        if tensor.dtype not in STORAGE_DTYPES or not tensor.is_contiguous():
            raise ValueError(f"tensor {index} must be contiguous float32, bfloat16 or float16, got a "
                             f"{'' if tensor.is_contiguous() else 'non-contiguous '}{tensor.dtype} tensor")
    tensors = tuple(t.view(-1) for t in tensors)
    if chunk_subspaces is None:
        if host_chunk_subspaces is not None:
            raise ValueError("host_chunk_subspaces was given without chunk_subspaces: pass both, or neither for one "
                             "subspace of every chunk")
        host_chunk_subspaces = [torch.zeros(num_chunks(t.numel(), chunk_size), dtype=PARTITION_DTYPE) for t in tensors]
        chunk_subspaces = [part.to(t.device) for part, t in zip(host_chunk_subspaces, tensors)]
    elif host_chunk_subspaces is None:
        host_chunk_subspaces = [part.cpu() for part in chunk_subspaces]
    if not (len(tensor_ids) == len(chunk_subspaces) == len(host_chunk_subspaces) == len(tensors)):
        raise ValueError("tensors, tensor_ids, chunk_subspaces and host_chunk_subspaces must have the same length")
    if num_subspaces is None:
        num_subspaces = 1 + max((int(part.max()) for part in host_chunk_subspaces if part.numel()), default=0)
    if subspace is None and num_subspaces == 1:
        subspace = 0  # one subspace owns every chunk: the same rows, and the table also serves perturb and restore
    if not 1 <= num_subspaces or (subspace is not None and not 0 <= subspace < num_subspaces):
        raise ValueError(f"subspace must be None or in [0, {num_subspaces}), got {subspace}")
    rows, backup_sizes = [], []
    for index, (tensor, host_partition) in enumerate(zip(tensors, host_chunk_subspaces)):
        host = host_partition.numpy()
        if host.size != num_chunks(tensor.numel(), chunk_size):
            raise ValueError(f"tensor {index} has {num_chunks(tensor.numel(), chunk_size)} chunks of {chunk_size} "
                             f"but its partition maps {host.size}")
        runs = _host_runs(tensor.numel(), host, subspace, chunk_size)
        backup_sizes.append(int((runs[:, 1] - runs[:, 0]).sum()))
        rows.append(np.concatenate([np.full((len(runs), 1), index, dtype=np.int64), runs], axis=1))
    table = np.concatenate(rows)
    lengths = table[:, 2] - table[:, 1]
    backup_offsets = np.cumsum(lengths) - lengths
    host_runs = np.stack([table[:, 0], table[:, 1], table[:, 2], backup_offsets, table[:, 3]], axis=1)
    header = np.array([[t.data_ptr() for t in tensors], list(tensor_ids)], dtype=np.int64)
    bounds_in_bytes = table[:, 1:3].reshape(-1) * tensors[0].element_size()
    every_bound = np.bitwise_or.reduce(np.concatenate([header[0], bounds_in_bytes]))
    byte_alignment = 16 if every_bound == 0 else int(min(16, every_bound & -every_bound))  # lowest set bit
    # One upload for the whole table: pointers, ids and runs in one buffer.
    packed = upload(torch.from_numpy(np.concatenate([header.reshape(-1), host_runs.reshape(-1)])), device)
    count = len(tensors)
    return RunTable(
        tensors=tensors,
        tensor_ids=tensor_ids,
        chunk_subspaces=tuple(chunk_subspaces),
        subspace=subspace,
        num_subspaces=int(num_subspaces),
        chunk_size=int(chunk_size),
        backup_sizes=tuple(backup_sizes),
        backup_numel=int(lengths.sum()),
        longest_run=int(lengths.max()) if lengths.size else 0,
        byte_alignment=byte_alignment,
        runs=packed[2 * count :].view(-1, RUN_COLUMNS),
        pointers=packed[:count],
        ids=packed[count : 2 * count],
        requires_grad=any(t.requires_grad for t in tensors),
    )

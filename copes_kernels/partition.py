"""Chunk -> subspace assignment for one CoPES step, and the chunk arithmetic every backend shares.

A parameter of `numel` elements is cut into chunks of `chunk_size` consecutive elements (the last may be short);
chunk c of a parameter covers elements [c * chunk_size, (c + 1) * chunk_size). All chunks of all parameters are
dealt round-robin into K subspaces (so each subspace gets floor or ceil of total/K chunks) and the deal is
shuffled by sorting Philox keys drawn from the step seed on a reserved stream: deterministic from the seed, a
fresh partition for every seed, identical on every rank.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from copes_kernels.rng import PARTITION_STREAM, philox_blocks

# Default chunk: 64K elements is large enough for a full-bandwidth GPU tile loop and small enough that a 4B model
# splits into ~60K chunks, so random subspaces are well mixed inside every matrix.
DEFAULT_CHUNK_SIZE = 1 << 16
PARTITION_DTYPE = torch.int16
MAX_SUBSPACES = torch.iinfo(PARTITION_DTYPE).max


def num_chunks(numel: int, chunk_size: int) -> int:
    return -(-numel // chunk_size)


def make_partition(
    chunk_counts: Sequence[int], *, num_subspaces: int, seed: int, device: torch.device | str | None = None
) -> list[torch.Tensor]:
    """One int16 tensor per parameter mapping each of its chunks to a subspace in [0, num_subspaces).

    Balanced globally: every subspace owns floor(C/K) or ceil(C/K) of the C chunks.
    """
    if not 1 <= num_subspaces <= MAX_SUBSPACES:
        raise ValueError(f"num_subspaces must be in [1, {MAX_SUBSPACES}], got {num_subspaces}")
    counts = [int(c) for c in chunk_counts]
    if any(c < 0 for c in counts):
        raise ValueError(f"chunk_counts must be >= 0, got {counts}")
    total = sum(counts)
    if total < num_subspaces:
        raise ValueError(
            f"{total} chunks cannot be split into {num_subspaces} non-empty subspaces; use a smaller chunk_size"
        )
    deal = torch.arange(total, dtype=torch.int64) % num_subspaces
    # One 32-bit key per chunk (word 0 of its Philox block); a stable sort breaks the rare ties by chunk index.
    keys = philox_blocks(0, total, seed=seed, member=PARTITION_STREAM, tensor_id=0)[:, 0]
    order = torch.sort(keys, stable=True).indices
    assignment = torch.empty(total, dtype=PARTITION_DTYPE)
    assignment[order] = deal.to(PARTITION_DTYPE)
    return [part.to(device) for part in assignment.split(counts)]


def chunk_span(numel: int, *, offset: int, chunk_size: int) -> tuple[int, int]:
    """First and last chunk touched by the slice [offset, offset + numel) (numel > 0)."""
    return offset // chunk_size, (offset + numel - 1) // chunk_size


def chunk_runs(
    chunks: torch.Tensor, *, numel: int, offset: int, chunk_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Global [start, stop) element bounds (int64, on chunks' device) of each chunk's part of the slice."""
    starts = torch.clamp(chunks * chunk_size, min=offset)
    stops = torch.clamp((chunks + 1) * chunk_size, max=offset + numel)
    return starts, stops


def selected_runs(
    numel: int, *, offset: int, chunk_subspace: torch.Tensor | None, subspace: int | None, chunk_size: int
) -> list[tuple[int, int]]:
    """Local [start, stop) ranges of a slice (dst[0] is element `offset`) whose chunks belong to `subspace`.

    Consecutive selected chunks merge into one run. Without a partition the whole slice is one run.
    """
    if numel == 0:
        return []
    if chunk_subspace is None:
        return [(0, numel)]
    first, last = chunk_span(numel, offset=offset, chunk_size=chunk_size)
    selected = (chunk_subspace[first : last + 1].to("cpu", torch.int64) == int(subspace)).tolist()
    runs: list[tuple[int, int]] = []
    for k, is_selected in enumerate(selected):
        if not is_selected:
            continue
        start = max((first + k) * chunk_size - offset, 0)
        stop = min((first + k + 1) * chunk_size - offset, numel)
        if runs and runs[-1][1] == start:
            runs[-1] = (runs[-1][0], stop)
        else:
            runs.append((start, stop))
    return runs

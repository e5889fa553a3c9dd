"""Fused perturbation of one member's subspace, and the packed backup/restore of that subspace.

    perturb_ : dst[i] = src[i] + sigma * eps(offset + i)    for i in chunks c with chunk_subspace[c] == subspace
    backup   : packed = concat(src[run] for each selected run)   (element order, 1/K of the tensor)
    restore  : dst[run] = packed[...]                            (the exact inverse, bit for bit)

The launch covers only the selected chunks: the host lists them (one nonzero over the partition) and each
program owns one tile of one selected chunk, so chunks of other subspaces cost neither bandwidth nor programs.
Each perturb tile regenerates the noise of its own Philox counters (element 4q + k <- word k of block q), loads
src, adds in float32 and casts once at the store (`to_storage`: round to nearest even). Backup/restore move raw
bits (integer views), so NaN payloads and signed zeros come back unchanged.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from copes_kernels import _public_ops as ops
from copes_kernels import _validate as v
from copes_kernels.backends.triton.rng import (
    STREAM_ARGS,
    int64_args,
    lanes_aligned,
    noise_block,
    normal_tile,
    run_tile,
    stream_args,
    tile_mask,
)
from copes_kernels.backends.triton.shared import noise_tiles_per_run, to_storage
from copes_kernels.partition import chunk_runs, chunk_span

# Integer views for bit-exact copies, by element size.
BIT_VIEWS = {2: torch.int16, 4: torch.int32}


@triton.jit(do_not_specialize=STREAM_ARGS + ["tiles_per_run"])
def _perturb_kernel(
    dst_ptr,
    src_ptr,
    run_starts_ptr,
    run_stops_ptr,
    tiles_per_run,
    sigma,
    seed_lo,
    seed_hi,
    member,
    tensor_id,
    offset_lo,
    offset_hi,
    ALIGNED: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """Program = (selected run, tile of BLOCK counters); runs hold global element bounds [start, stop)."""
    lanes: tl.constexpr = 128 // dst_ptr.dtype.element_ty.primitive_bitwidth  # elements per 128-bit access
    _, first_block, base, lane, mask = run_tile(
        run_starts_ptr, run_stops_ptr, tiles_per_run, offset_lo, offset_hi, ALIGNED, lanes, BLOCK
    )
    paired: tl.constexpr = ALIGNED and lanes == 8  # see rng._element_tile
    eps = normal_tile(first_block, seed_lo, seed_hi, member, tensor_id, BLOCK, paired)
    x = tl.load(src_ptr + base + lane, mask=mask).to(tl.float32)
    tl.store(dst_ptr + base + lane, to_storage(x + sigma * eps, dst_ptr.dtype.element_ty), mask=mask)


@triton.jit(do_not_specialize=["tiles_per_run"])
def _copy_runs_kernel(
    chunked_ptr, packed_ptr, run_starts_ptr, run_stops_ptr, packed_starts_ptr, tiles_per_run, TO_PACKED: tl.constexpr,
    ALIGNED: tl.constexpr, BLOCK: tl.constexpr,
):
    """Copy local runs [start, stop) of the chunked tensor to/from their packed positions (BLOCK elements a tile)."""
    lanes: tl.constexpr = 128 // chunked_ptr.dtype.element_ty.primitive_bitwidth  # elements per 128-bit access
    pid = tl.program_id(0)
    run = pid // tiles_per_run
    start = tl.load(run_starts_ptr + run)
    tile_start = start + (pid % tiles_per_run).to(tl.int64) * BLOCK
    lane, mask = tile_mask(start, tl.load(run_stops_ptr + run), tile_start, ALIGNED, lanes, BLOCK // 4)
    packed_start = tl.load(packed_starts_ptr + run) + tile_start - start
    if ALIGNED:
        tile_start = tl.multiple_of(tile_start, lanes)
        packed_start = tl.multiple_of(packed_start, lanes)
    if TO_PACKED:
        tl.store(packed_ptr + packed_start + lane, tl.load(chunked_ptr + tile_start + lane, mask=mask), mask=mask)
    else:
        tl.store(chunked_ptr + tile_start + lane, tl.load(packed_ptr + packed_start + lane, mask=mask), mask=mask)


# ----------------------------------------------------------------------------------------------- host side


def selected_chunk_runs(
    numel: int,
    *,
    offset: int,
    chunk_subspace: torch.Tensor | None,
    subspace: int | None,
    chunk_size: int,
    device: torch.device,
) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Global [start, stop) of each chunk of `subspace` inside the slice, and the longest run's length.

    Without a partition the whole slice is one run; an empty slice has none.
    """
    if numel == 0:
        empty = torch.empty(0, dtype=torch.int64, device=device)
        return empty, empty, 0
    if chunk_subspace is None:
        bounds = torch.tensor([[offset], [offset + numel]], dtype=torch.int64, device=device)
        return bounds[0], bounds[1], numel
    first, last = chunk_span(numel, offset=offset, chunk_size=chunk_size)
    chunks = torch.nonzero(chunk_subspace[first : last + 1] == int(subspace)).view(-1) + first
    starts, stops = chunk_runs(chunks, numel=numel, offset=offset, chunk_size=chunk_size)
    return starts, stops, min(chunk_size, numel)


@ops.perturb_op
def perturb_(dst, src, seed, member, tensor_id, sigma, offset, chunk_subspace, subspace, chunk_size) -> None:
    starts, stops, longest = selected_chunk_runs(
        dst.numel(), offset=offset, chunk_subspace=chunk_subspace, subspace=subspace, chunk_size=chunk_size,
        device=dst.device,
    )
    tiles, block = noise_tiles_per_run(longest, offset=offset, chunk_size=chunk_size, device=dst.device)
    if starts.numel() and tiles:
        aligned = lanes_aligned(offset, dst.numel(), chunk_size, element_size=dst.element_size(), block=block)
        _perturb_kernel[(starts.numel() * tiles,)](
            dst, dst if src is None else src, starts, stops, tiles, float(sigma),
            *stream_args(seed, member, tensor_id), *int64_args(offset), ALIGNED=aligned, BLOCK=block,
        )


class PackedRuns(NamedTuple):
    """Selected runs of a slice in local element indices, and where each lands in the packed backup."""

    starts: torch.Tensor
    stops: torch.Tensor
    packed_starts: torch.Tensor
    packed_size: int
    longest: int


def packed_runs(
    chunked: torch.Tensor, *, offset: int, chunk_subspace: torch.Tensor | None, subspace: int | None, chunk_size: int
) -> PackedRuns:
    starts, stops, longest = selected_chunk_runs(
        chunked.numel(), offset=offset, chunk_subspace=chunk_subspace, subspace=subspace, chunk_size=chunk_size,
        device=chunked.device,
    )
    lengths = stops - starts
    packed_ends = torch.cumsum(lengths, 0)
    packed_size = int(packed_ends[-1]) if lengths.numel() else 0  # a host sync the backup's allocation needs anyway
    return PackedRuns(starts - offset, stops - offset, packed_ends - lengths, packed_size, longest)


def _copy_runs(
    chunked: torch.Tensor, packed: torch.Tensor, runs: PackedRuns, *, offset: int, chunk_size: int, to_packed: bool
) -> None:
    block = noise_block(chunked.device)  # counters of a noise tile: 4 * block elements per program
    tiles = triton.cdiv(runs.longest, 4 * block)
    if runs.starts.numel() and tiles:
        bits = BIT_VIEWS[chunked.element_size()]
        # Every run bound (and so every packed start) a whole number of 128-bit accesses.
        aligned = lanes_aligned(offset, chunked.numel(), chunk_size, element_size=chunked.element_size(), block=block)
        _copy_runs_kernel[(runs.starts.numel() * tiles,)](
            chunked.view(bits), packed.view(bits), runs.starts, runs.stops, runs.packed_starts, tiles,
            TO_PACKED=to_packed, ALIGNED=aligned, BLOCK=4 * block,
        )


@ops.backup_op
def backup_chunks(src, chunk_subspace, subspace, chunk_size, offset) -> torch.Tensor:
    runs = packed_runs(src, offset=offset, chunk_subspace=chunk_subspace, subspace=subspace, chunk_size=chunk_size)
    packed = src.new_empty(runs.packed_size)
    _copy_runs(src, packed, runs, offset=offset, chunk_size=chunk_size, to_packed=True)
    return packed


@ops.restore_op
def restore_chunks_(dst, backup, chunk_subspace, subspace, chunk_size, offset) -> None:
    runs = packed_runs(dst, offset=offset, chunk_subspace=chunk_subspace, subspace=subspace, chunk_size=chunk_size)
    v.check_backup_size(backup, expected=runs.packed_size, subspace=subspace)
    _copy_runs(dst, backup.to(dst.device), runs, offset=offset, chunk_size=chunk_size, to_packed=False)

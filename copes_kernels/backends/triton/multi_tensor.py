"""Multi-tensor launches: one kernel covers every tensor of a run table (one dtype group, see run_tables.py).

    multi_perturb_   : backup[b + i - start] = w[i];  w[i] = w[i] + sigma * eps_(member, tensor_id)(i)   per run row
    multi_restore_   : w[i] = backup[b + i - start]                                                      per run row
    multi_accumulate_: w[i] += sum_j coeffs[j] * [subspace(row) == member_subspaces[j]] * eps_j(i);
                       returns sum over the group of (w_after - w_before)^2 (float64 0-d, on the device)

Program = (run row, tile of BLOCK counters). A row names its tensor (pointer and tensor_id from the tensor
table), its element bounds and its backup offset; the noise of element i is the contract's eps(i) of that tensor,
so the weights come out bit for bit as the per-tensor ops leave them. Backup and restore move raw bits (integer
views of the storage). The update's norm is measured in-kernel from the stored values: each program writes the
float64 sum of its squared changes, and one device-side sum adds them in a fixed order (deterministic).

Nothing here reads device data on the host: sizes come from the table's host-side fields.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from copes_kernels import _public_ops as ops
from copes_kernels import _validate as v
from copes_kernels.backends.triton.rng import lanes_aligned, normal_tile, stream_args, tile_mask, uniform_tile
from copes_kernels.backends.triton.shared import ROUNDING_STREAM_WORD, noise_tiles_per_run, round_stochastic, to_storage
from copes_kernels.run_tables import RUN_COLUMNS, RunTable, upload

# Storage dtype -> (Triton float type, integer type of the same width for bit-exact copies).
_TYPES = {
    torch.float32: (tl.float32, tl.int32, torch.int32),
    torch.bfloat16: (tl.bfloat16, tl.int16, torch.int16),
    torch.float16: (tl.float16, tl.int16, torch.int16),
}
_RUN_COLUMNS: tl.constexpr = tl.constexpr(RUN_COLUMNS)
MULTI_STREAM_ARGS = ["seed_lo", "seed_hi", "member"]


@triton.jit
def _add(a, b):
    return a + b


@triton.jit
def _row_tile(runs_ptr, pointers_ptr, tiles_per_run, BITS: tl.constexpr, ALIGNED: tl.constexpr, BLOCK: tl.constexpr):
    """Program (row, tile) -> row pointer, tensor index, the bit pointer of the tile's lane 0 and its position in
    the backup, the first Philox block, and `tile_mask`'s lanes and mask. ALIGNED: the table's pointers and row
    bounds are 16-byte aligned (RunTable.byte_alignment), so accesses stay 128-bit vectors."""
    lanes: tl.constexpr = 128 // BITS.primitive_bitwidth  # elements per 128-bit access
    pid = tl.program_id(0)  # int32, as in rng.run_tile
    row = runs_ptr + (pid // tiles_per_run) * _RUN_COLUMNS
    tensor = tl.load(row)
    start = tl.load(row + 1)
    first_block = (start >> 2) + (pid % tiles_per_run).to(tl.int64) * BLOCK
    tile_start = 4 * first_block
    lane, mask = tile_mask(start, tl.load(row + 2), tile_start, ALIGNED, lanes, BLOCK)
    tensor_ptr = tl.load(pointers_ptr + tensor).to(tl.pointer_type(BITS))
    backup_start = tl.load(row + 3) - start + tile_start
    if ALIGNED:
        tensor_ptr = tl.multiple_of(tensor_ptr, 16)  # bytes, on the pointer: an int -> pointer cast drops hints
        tile_start = tl.multiple_of(tile_start, lanes)
        backup_start = tl.multiple_of(backup_start, lanes)
    tile_ptr = tensor_ptr + tile_start
    return row, tensor, tile_ptr, backup_start, first_block, lane, mask


@triton.jit(do_not_specialize=MULTI_STREAM_ARGS + ["tiles_per_run"])
def _multi_perturb_kernel(
    runs_ptr, pointers_ptr, ids_ptr, backup_ptr, tiles_per_run, sigma, seed_lo, seed_hi, member,
    DTYPE: tl.constexpr, BITS: tl.constexpr, BACKUP: tl.constexpr, ALIGNED: tl.constexpr, BLOCK: tl.constexpr,
):
    _, tensor, tile_ptr, backup_start, first_block, lane, mask = _row_tile(
        runs_ptr, pointers_ptr, tiles_per_run, BITS, ALIGNED, BLOCK
    )
    bits = tl.load(tile_ptr + lane, mask=mask)
    if BACKUP:
        tl.store(backup_ptr + backup_start + lane, bits, mask=mask)
    paired: tl.constexpr = ALIGNED and BITS.primitive_bitwidth == 16  # see rng._element_tile
    eps = normal_tile(first_block, seed_lo, seed_hi, member, tl.load(ids_ptr + tensor), BLOCK, paired)
    x = bits.to(DTYPE, bitcast=True).to(tl.float32)
    tl.store(tile_ptr + lane, to_storage(x + sigma * eps, DTYPE).to(BITS, bitcast=True), mask=mask)


@triton.jit(do_not_specialize=["tiles_per_run"])
def _multi_restore_kernel(
    runs_ptr, pointers_ptr, backup_ptr, tiles_per_run, BITS: tl.constexpr, ALIGNED: tl.constexpr, BLOCK: tl.constexpr
):
    _, _, tile_ptr, backup_start, _, lane, mask = _row_tile(runs_ptr, pointers_ptr, tiles_per_run, BITS, ALIGNED, BLOCK)
    tl.store(tile_ptr + lane, tl.load(backup_ptr + backup_start + lane, mask=mask), mask=mask)


@triton.jit(do_not_specialize=["seed_lo", "seed_hi", "tiles_per_run"])
def _multi_accumulate_kernel(
    runs_ptr, pointers_ptr, ids_ptr, first_member_ptr, end_member_ptr, streams_ptr, coeffs_ptr, partials_ptr,
    tiles_per_run, seed_lo, seed_hi,
    DTYPE: tl.constexpr, BITS: tl.constexpr, STOCHASTIC: tl.constexpr, ALIGNED: tl.constexpr, BLOCK: tl.constexpr,
):
    """Rows of a subspace without members are neither read nor written (their partial is 0). Member j adds noise
    under its own key, streams[j] = (member, key word 0, key word 1); (seed_lo, seed_hi) keys the rounding."""
    row, tensor, tile_ptr, _, first_block, lane, mask = _row_tile(
        runs_ptr, pointers_ptr, tiles_per_run, BITS, ALIGNED, BLOCK
    )
    paired: tl.constexpr = ALIGNED and BITS.primitive_bitwidth == 16  # see rng._element_tile
    subspace = tl.load(row + 4)
    first_member = tl.load(first_member_ptr + subspace)
    end_member = tl.load(end_member_ptr + subspace)
    partial = tl.full([], 0.0, tl.float64)
    if end_member > first_member:
        tensor_id = tl.load(ids_ptr + tensor)
        before = tl.load(tile_ptr + lane, mask=mask).to(DTYPE, bitcast=True).to(tl.float32)
        total = before
        for j in range(first_member, end_member):
            stream = streams_ptr + 3 * j
            eps = normal_tile(
                first_block, tl.load(stream + 1), tl.load(stream + 2), tl.load(stream), tensor_id, BLOCK, paired
            )
            total += tl.load(coeffs_ptr + j) * eps
        if STOCHASTIC:
            rounding_stream = tl.full((), ROUNDING_STREAM_WORD, tl.uint32)
            u = uniform_tile(first_block, seed_lo, seed_hi, rounding_stream, tensor_id, BLOCK, paired)
            stored = round_stochastic(total, u, DTYPE)
        else:
            stored = to_storage(total, DTYPE)
        tl.store(tile_ptr + lane, stored.to(BITS, bitcast=True), mask=mask)
        change = tl.where(mask, stored.to(tl.float64) - before.to(tl.float64), 0.0)  # exact in float64
        # tl.reduce with our own combine: tl.sum's is jitted at `import triton`, which may precede the interpreter.
        partial = tl.reduce(change * change, 0, _add)
    tl.store(partials_ptr + tl.program_id(0), partial)


# ----------------------------------------------------------------------------------------------- host side


def _grid(table: RunTable) -> tuple[int, int, bool]:
    """(tiles per row, counters per tile, ALIGNED): rows start at chunk boundaries of whole tensors (offset 0)."""
    tiles, block = noise_tiles_per_run(table.longest_run, offset=0, chunk_size=table.chunk_size, device=table.device)
    aligned = table.byte_alignment == 16 and lanes_aligned(element_size=table.tensors[0].element_size(), block=block)
    return tiles, block, aligned


def member_segments(
    table: RunTable, streams_h: torch.Tensor, coeffs_h: torch.Tensor, subspaces_h: torch.Tensor
) -> tuple[torch.Tensor, ...]:
    """(first member, end member) per subspace and the member streams and coeffs sorted by subspace, on the device,
    from validated host tensors (the step's plan): one upload for the integers, one for the coeffs."""
    order = torch.argsort(subspaces_h, stable=True)
    sorted_subspaces = subspaces_h[order].contiguous()
    every_subspace = torch.arange(table.num_subspaces, dtype=torch.int64)
    first = torch.searchsorted(sorted_subspaces, every_subspace, right=False)
    end = torch.searchsorted(sorted_subspaces, every_subspace, right=True)
    integers = upload(torch.cat([first, end, streams_h[order].reshape(-1)]), table.device)
    sorted_coeffs = upload(coeffs_h[order], table.device)
    k = table.num_subspaces
    return integers[:k], integers[k : 2 * k], integers[2 * k :], sorted_coeffs


def multi_perturb_(table: RunTable, *, seed: int, member: int, sigma: float,
                   backup: torch.Tensor | None = None) -> None:
    """Perturb every tensor of `table` on its subspace's chunks; with `backup` (table.backup_numel elements of the
    table's dtype) first copy those chunks there, packed in row order, for `multi_restore_`."""
    v.check_multi_perturb_args(table, seed=seed, member=member, sigma=sigma, backup=backup)
    tiles, block, aligned = _grid(table)
    if table.num_runs and tiles:
        dtype, bits, bits_torch = _TYPES[table.dtype]
        backup_bits = table.runs if backup is None else backup.view(bits_torch)  # any pointer when BACKUP is off
        seed_lo, seed_hi, member_word, _ = stream_args(seed, member, 0)
        _multi_perturb_kernel[(table.num_runs * tiles,)](
            table.runs, table.pointers, table.ids, backup_bits, tiles, float(sigma), seed_lo, seed_hi, member_word,
            DTYPE=dtype, BITS=bits, BACKUP=backup is not None, ALIGNED=aligned, BLOCK=block,
        )


def multi_restore_(table: RunTable, backup: torch.Tensor) -> None:
    """Write a `multi_perturb_` backup back into its chunks: the exact inverse, bit for bit."""
    v.check_multi_backup(table, backup)
    tiles, block, aligned = _grid(table)
    if table.num_runs and tiles:
        _, bits, bits_torch = _TYPES[table.dtype]
        _multi_restore_kernel[(table.num_runs * tiles,)](
            table.runs, table.pointers, backup.to(table.device).view(bits_torch), tiles, BITS=bits, ALIGNED=aligned,
            BLOCK=block,
        )


@ops.multi_accumulate_op
def multi_accumulate_(table, streams, coeffs_h, subspaces_h, rounding_seed, rounding) -> torch.Tensor:
    """one launch for every tensor; the norm is summed from per-program partials."""
    first_member, end_member, sorted_streams, sorted_coeffs = member_segments(table, streams, coeffs_h, subspaces_h)
    tiles, block, aligned = _grid(table)
    programs = table.num_runs * tiles
    partials = torch.empty(programs, dtype=torch.float64, device=table.device)
    if programs:
        dtype, bits, _ = _TYPES[table.dtype]
        seed_lo, seed_hi, _, _ = stream_args(rounding_seed, 0, 0)
        _multi_accumulate_kernel[(programs,)](
            table.runs, table.pointers, table.ids, first_member, end_member, sorted_streams, sorted_coeffs, partials,
            tiles, seed_lo, seed_hi, DTYPE=dtype, BITS=bits, STOCHASTIC=rounding == "stochastic", ALIGNED=aligned,
            BLOCK=block,
        )
    return partials.sum()

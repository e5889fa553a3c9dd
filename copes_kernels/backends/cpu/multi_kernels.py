"""The compiled CPU backend's multi-tensor kernels: one call covers every tensor of a run table.

A run table (run_tables.py) lists each tensor by its data address: the kernels view it with numba.carray, so one
call covers every tensor of a dtype group. Tiles cut the rows on each tensor's own grid of TILE elements, with the
per-tensor kernels' arithmetic (the same bits).
"""

from __future__ import annotations

import numba
import numpy as np
from numba import prange, types
from numba.extending import intrinsic

from copes_kernels.backends.cpu.kernels import noise_sum, tile_blocks, tile_table
from copes_kernels.backends.cpu.numerics import (
    F32,
    JIT,
    ROUNDING_WORD,
    U64,
    as_words,
    fill_normals,
    fill_uniforms,
    from_float,
    round_stochastic,
    to_float,
)

# A run table (run_tables.py) lists each tensor by its data address: the kernels view it with numba.carray, so one
# call covers every tensor of a dtype group. Tiles cut the rows on each tensor's own grid of TILE elements.


@intrinsic
def _pointer_to(typingctx, address, like):
    """An int64 data address -> a pointer to elements of `like`'s dtype (`like` only carries the type)."""
    if not isinstance(address, types.Integer) or not isinstance(like, types.Array):
        return None
    pointer = types.CPointer(like.dtype)

    def codegen(context, builder, signature, args):
        return builder.inttoptr(args[0], context.get_value_type(pointer))

    return pointer(address, like), codegen


@numba.njit(inline="always", **JIT)
def _tensor_view(pointers, numels, tensor, like):
    """Tensor `tensor` of a run table as a 1-D array of `like`'s dtype (shared memory)."""
    return numba.carray(_pointer_to(pointers[tensor], like), numels[tensor])


@numba.njit(inline="always", **JIT)
def _copy(dst, dst_start, src, src_start, count):
    """dst[dst_start + k] = src[src_start + k] for k < count (non-negative indices: the loop vectorises)."""
    dst_run, src_run = dst[dst_start : dst_start + count], src[src_start : src_start + count]
    for k in range(count):
        dst_run[k] = src_run[k]


@numba.njit(parallel=True, **JIT)
def multi_perturb_kernel(
    runs, pointers, numels, ids, like, backup, with_backup, sigma, member, key0, key1
):
    """Per run row (tensor, start, stop, backup offset, subspace): pack the row's bits into `backup` (when
    `with_backup`; `backup` is a same-width integer array), then dst = dst + sigma * eps of that tensor."""
    tile_starts, tile_stops, tile_rows = tile_table(runs[:, 1], runs[:, 2], 0)
    sigma, member = F32(sigma), U64(member)
    _, key0, key1 = as_words(0, key0, key1)
    for t in prange(tile_starts.size):
        start, stop, row = tile_starts[t], tile_stops[t], tile_rows[t]
        tensor = runs[row, 0]
        dst = _tensor_view(pointers, numels, tensor, like)
        if with_backup:
            dst_bits = _tensor_view(pointers, numels, tensor, backup)
            _copy(backup, runs[row, 3] - runs[row, 1] + start, dst_bits, start, stop - start)
        first_block, blocks, shift = tile_blocks(0, start, stop)
        eps = np.empty(4 * blocks, np.float32)
        fill_normals(eps, first_block, blocks, member, U64(ids[tensor]), key0, key1)
        for i in range(start, stop):
            dst[i] = from_float(to_float(dst[i]) + sigma * eps[i + shift], dst)


@numba.njit(parallel=True, **JIT)
def multi_restore_kernel(runs, pointers, numels, backup):
    """Per run row: write its packed bits back from `backup` (the inverse of the perturb kernel's copy)."""
    tile_starts, tile_stops, tile_rows = tile_table(runs[:, 1], runs[:, 2], 0)
    for t in prange(tile_starts.size):
        start, stop, row = tile_starts[t], tile_stops[t], tile_rows[t]
        dst_bits = _tensor_view(pointers, numels, runs[row, 0], backup)
        _copy(dst_bits, start, backup, runs[row, 3] - runs[row, 1] + start, stop - start)


@numba.njit(parallel=True, **JIT)
def multi_accumulate_kernel(
    runs, pointers, numels, ids, like, member_owners, streams, coeffs, stochastic, key0, key1
):
    """Per run row: add the members of the row's subspace (members sorted by owner, `member_owners` ascending) in
    one float32 tile, store once; rows of a subspace without members are neither read nor written. Returns the
    float64 sum of squared stored changes, added over tiles in tile order (the same for any thread count).
    Each member adds noise under its own key (`streams`); (key0, key1) keys the stochastic-rounding stream."""
    tile_starts, tile_stops, tile_rows = tile_table(runs[:, 1], runs[:, 2], 0)
    partials = np.zeros(tile_starts.size, np.float64)
    _, key0, key1 = as_words(0, key0, key1)
    for t in prange(tile_starts.size):
        start, stop, row = tile_starts[t], tile_stops[t], tile_rows[t]
        low = np.searchsorted(member_owners, runs[row, 4], side="left")
        high = np.searchsorted(member_owners, runs[row, 4], side="right")
        if high > low:
            tensor = runs[row, 0]
            tensor_id = U64(ids[tensor])
            target = _tensor_view(pointers, numels, tensor, like)
            first_block, blocks, shift = tile_blocks(0, start, stop)
            total, eps = np.empty(stop - start, np.float32), np.empty(4 * blocks, np.float32)
            noise_sum(total, eps, target, start, stop, first_block, blocks, shift, streams, coeffs, low, high,
                       tensor_id)
            if stochastic:
                fill_uniforms(eps, first_block, blocks, ROUNDING_WORD, tensor_id, key0, key1)
            squares = 0.0
            for i in range(start, stop):
                before = to_float(target[i])
                if stochastic:
                    target[i] = round_stochastic(total[i - start], eps[i + shift], target)
                else:
                    target[i] = from_float(total[i - start], target)
                # A float32 difference, squared in float64: the per-tensor path's norm (torch float32 subtraction).
                change = np.float64(to_float(target[i]) - before)
                squares += change * change
            partials[t] = squares
    squared = 0.0
    for t in range(partials.size):
        squared += partials[t]
    return squared



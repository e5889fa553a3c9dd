"""The compiled CPU backend's per-tensor kernels: perturb, accumulate, backup / restore, normals, low-rank rows.

    perturb : per tile of at most TILE elements: regenerate its Philox blocks into an L1-resident buffer, then
              dst = src + sigma * eps with one cast at the store -- one pass over memory
    update  : per tile: load target once into float32, add each member of the tile's subspace (noise regenerated
              into the same buffer, each member under its own key), store once (round to nearest even, or
              stochastic rounding)

Tiles lie on a fixed grid of global element indices (tile t covers [t TILE, (t + 1) TILE) of the whole parameter,
cut by chunk bounds), so which element a tile holds never depends on the thread count and the results are
bitwise identical for 1 and 2 threads.
"""

from __future__ import annotations

import numba
import numpy as np
from numba import prange

from copes_kernels.backends.cpu.numerics import (
    F32,
    JIT,
    ROUNDING_WORD,
    SHIFT32,
    TILE,
    U64,
    as_words,
    fill_normals,
    fill_uniforms,
    from_float,
    philox,
    round_stochastic,
    to_float,
)


@numba.njit(inline="always", **JIT)
def tile_blocks(offset, start, stop):
    """Philox blocks of local elements [start, stop): (first block, block count, buffer index of element 0)."""
    first_block = (offset + start) >> 2
    return first_block, ((offset + stop - 1) >> 2) - first_block + 1, offset - 4 * first_block


@numba.njit(inline="always", **JIT)
def _grid_tile(offset, numel, t):
    """Local [start, stop) of the slice's t-th tile on the global grid of TILE elements."""
    return max((offset // TILE + t) * TILE - offset, 0), min((offset // TILE + t + 1) * TILE - offset, numel)


@numba.njit(**JIT)
def _selected_runs(numel, offset, chunk_size, chunk_owner, partitioned, sorted_owners):
    """Local [start, stop) of the slice's chunks whose owner appears in `sorted_owners`, with the segment
    [lo, hi) of `sorted_owners` holding that owner (without a partition: the whole slice and every entry)."""
    if not partitioned:
        whole = np.array([0, numel], dtype=np.int64)
        return whole[:1], whole[1:], np.zeros(1, np.int64), np.full(1, sorted_owners.size, np.int64)
    first, last = offset // chunk_size, (offset + numel - 1) // chunk_size
    starts, stops = np.empty(last - first + 1, np.int64), np.empty(last - first + 1, np.int64)
    lows, highs = np.empty(last - first + 1, np.int64), np.empty(last - first + 1, np.int64)
    count = 0
    for chunk in range(first, last + 1):
        owner = chunk_owner[chunk]
        low = np.searchsorted(sorted_owners, owner, side="left")
        high = np.searchsorted(sorted_owners, owner, side="right")
        if high > low:
            starts[count] = max(chunk * chunk_size - offset, 0)
            stops[count] = min((chunk + 1) * chunk_size - offset, numel)
            lows[count], highs[count] = low, high
            count += 1
    return starts[:count], stops[:count], lows[:count], highs[:count]


@numba.njit(**JIT)
def tile_table(starts, stops, offset):
    """Cut local runs on the global grid of TILE elements: (tile starts, tile stops, run of each tile)."""
    count = 0
    for r in range(starts.size):
        count += (offset + stops[r] - 1) // TILE - (offset + starts[r]) // TILE + 1
    tile_starts, tile_stops, tile_runs = np.empty(count, np.int64), np.empty(count, np.int64), np.empty(count, np.int64)
    t = 0
    for r in range(starts.size):
        start = starts[r]
        while start < stops[r]:
            stop = min(((offset + start) // TILE + 1) * TILE - offset, stops[r])
            tile_starts[t], tile_stops[t], tile_runs[t] = start, stop, r
            start = stop
            t += 1
    return tile_starts, tile_stops, tile_runs


@numba.njit(**JIT)
def _owner_runs(numel, offset, chunk_size, chunk_owner, partitioned, subspace):
    """Local [start, stop) of the slice's chunks owned by `subspace` (without a partition: the whole slice)."""
    starts, stops, _, _ = _selected_runs(numel, offset, chunk_size, chunk_owner, partitioned,
                                         np.full(1, subspace, np.int64))
    return starts, stops


@numba.njit(parallel=True, **JIT)
def perturb_kernel(
    dst, src, chunk_owner, partitioned, subspace, chunk_size, offset, sigma, member, tensor_id, key0, key1
):
    run_starts, run_stops = _owner_runs(dst.size, offset, chunk_size, chunk_owner, partitioned, subspace)
    tile_starts, tile_stops, _ = tile_table(run_starts, run_stops, offset)
    sigma, member = F32(sigma), U64(member)
    tensor_id, key0, key1 = as_words(tensor_id, key0, key1)
    for t in prange(tile_starts.size):
        start, stop = tile_starts[t], tile_stops[t]
        first_block, blocks, shift = tile_blocks(offset, start, stop)
        eps = np.empty(4 * blocks, np.float32)
        fill_normals(eps, first_block, blocks, member, tensor_id, key0, key1)
        for i in range(start, stop):
            dst[i] = from_float(to_float(src[i]) + sigma * eps[i + shift], dst)


@numba.njit(inline="always", **JIT)
def noise_sum(total, eps, target, start, stop, first_block, blocks, shift, streams, coeffs, low, high, tensor_id):
    """total[i - start] = target[i] in float32 plus coeffs[j] * eps_j(i) for j in [low, high), the noise of each
    member regenerated into the tile's buffer `eps`; streams[j] = (member, key word 0, key word 1) keys eps_j."""
    for i in range(start, stop):
        total[i - start] = to_float(target[i])
    for j in range(low, high):
        fill_normals(eps, first_block, blocks, U64(streams[j, 0]), tensor_id, U64(streams[j, 1]), U64(streams[j, 2]))
        coeff = coeffs[j]
        for i in range(start, stop):
            total[i - start] += coeff * eps[i + shift]


@numba.njit(parallel=True, **JIT)
def accumulate_kernel(
    target, chunk_owner, partitioned, chunk_size, member_owners, streams, coeffs, offset, stochastic, tensor_id,
    key0, key1,
):
    """Members sorted by owning subspace (`member_owners`, ascending): a tile adds its subspace's segment, each
    member under its own key (`streams`); (key0, key1) keys the stochastic-rounding stream."""
    run_starts, run_stops, run_lows, run_highs = _selected_runs(
        target.size, offset, chunk_size, chunk_owner, partitioned, member_owners
    )
    tile_starts, tile_stops, tile_runs = tile_table(run_starts, run_stops, offset)
    tensor_id, key0, key1 = as_words(tensor_id, key0, key1)
    for t in prange(tile_starts.size):
        start, stop, run = tile_starts[t], tile_stops[t], tile_runs[t]
        first_block, blocks, shift = tile_blocks(offset, start, stop)
        total, eps = np.empty(stop - start, np.float32), np.empty(4 * blocks, np.float32)
        noise_sum(total, eps, target, start, stop, first_block, blocks, shift, streams, coeffs, run_lows[run],
                   run_highs[run], tensor_id)
        if stochastic:
            fill_uniforms(eps, first_block, blocks, ROUNDING_WORD, tensor_id, key0, key1)
            for i in range(start, stop):
                target[i] = round_stochastic(total[i - start], eps[i + shift], target)
        else:
            for i in range(start, stop):
                target[i] = from_float(total[i - start], target)


@numba.njit(parallel=True, **JIT)
def store_stochastic_kernel(dst, values, offset, tensor_id, key0, key1):
    """dst[i] = stochastic rounding of float32 values[i] with the uniforms of element offset + i."""
    tiles = (offset + dst.size - 1) // TILE - offset // TILE + 1
    tensor_id, key0, key1 = as_words(tensor_id, key0, key1)
    for t in prange(tiles):
        start, stop = _grid_tile(offset, dst.size, t)
        first_block, blocks, shift = tile_blocks(offset, start, stop)
        u = np.empty(4 * blocks, np.float32)
        fill_uniforms(u, first_block, blocks, ROUNDING_WORD, tensor_id, key0, key1)
        for i in range(start, stop):
            dst[i] = round_stochastic(values[i], u[i + shift], dst)


@numba.njit(parallel=True, **JIT)
def normal_rows_kernel(out, members, offset, tensor_id, key0, key1):
    """out[p, i] = eps_{members[p]}(offset + i) for every row p of a 2-D float32 array."""
    n = out.shape[1]
    tiles_per_row = (offset + n - 1) // TILE - offset // TILE + 1
    tensor_id, key0, key1 = as_words(tensor_id, key0, key1)
    for job in prange(out.shape[0] * tiles_per_row):
        row, t = job // tiles_per_row, job % tiles_per_row
        start, stop = _grid_tile(offset, n, t)
        first_block, blocks, shift = tile_blocks(offset, start, stop)
        eps = np.empty(4 * blocks, np.float32)
        fill_normals(eps, first_block, blocks, U64(members[row]), tensor_id, key0, key1)
        for i in range(start, stop):
            out[row, i] = eps[i + shift]


@numba.njit(parallel=True, **JIT)
def philox_kernel(out, counters, keys):
    """out[e, :] = Philox4x32-10(counters[e, :], keys[e, :]) on uint32 values held in int64."""
    for e in prange(out.shape[0]):
        q = U64(counters[e, 0]) | (U64(counters[e, 1]) << SHIFT32)
        words = philox(q, U64(counters[e, 2]), U64(counters[e, 3]), U64(keys[e, 0]), U64(keys[e, 1]))
        out[e, 0], out[e, 1] = np.int64(words[0]), np.int64(words[1])
        out[e, 2], out[e, 3] = np.int64(words[2]), np.int64(words[3])


@numba.njit(**JIT)
def _packed_runs(numel, offset, chunk_size, chunk_owner, partitioned, subspace):
    """`subspace`'s local runs (the whole slice without a partition), where each starts in the packed copy, and the
    packed size."""
    starts, stops = _owner_runs(numel, offset, chunk_size, chunk_owner, partitioned, subspace)
    packed_starts = np.empty(starts.size, np.int64)
    size = 0
    for r in range(starts.size):
        packed_starts[r] = size
        size += stops[r] - starts[r]
    return starts, stops, packed_starts, size


@numba.njit(parallel=True, **JIT)
def backup_kernel(chunked, chunk_owner, partitioned, subspace, chunk_size, offset):
    """A new packed copy of `subspace`'s runs (integer views: exact bits)."""
    starts, stops, packed_starts, size = _packed_runs(chunked.size, offset, chunk_size, chunk_owner, partitioned,
                                                      subspace)
    packed = np.empty(size, chunked.dtype)
    for r in prange(starts.size):
        packed[packed_starts[r] : packed_starts[r] + stops[r] - starts[r]] = chunked[starts[r] : stops[r]]
    return packed


@numba.njit(parallel=True, **JIT)
def restore_kernel(chunked, packed, chunk_owner, partitioned, subspace, chunk_size, offset):
    """Write a packed copy back into `subspace`'s runs; returns the size it needs (and writes nothing if `packed`
    does not have it)."""
    starts, stops, packed_starts, size = _packed_runs(chunked.size, offset, chunk_size, chunk_owner, partitioned,
                                                      subspace)
    if packed.size == size:
        for r in prange(starts.size):
            chunked[starts[r] : stops[r]] = packed[packed_starts[r] : packed_starts[r] + stops[r] - starts[r]]
    return size


# Rows per parallel job of the low-rank correction: its buffers are allocated once per job, not once per row.
ROWS_PER_JOB = 64


@numba.njit(inline="always", **JIT)
def _dot8(x, row, B, m, r, in_features):
    """x[row] . B[m, :, r] in float32 with eight independent partial sums (hides the FMA latency)."""
    s0 = s1 = s2 = s3 = s4 = s5 = s6 = s7 = F32(0.0)
    whole = in_features - in_features % 8
    for k in range(0, whole, 8):
        s0 += to_float(x[row, k]) * B[m, k, r]
        s1 += to_float(x[row, k + 1]) * B[m, k + 1, r]
        s2 += to_float(x[row, k + 2]) * B[m, k + 2, r]
        s3 += to_float(x[row, k + 3]) * B[m, k + 3, r]
        s4 += to_float(x[row, k + 4]) * B[m, k + 4, r]
        s5 += to_float(x[row, k + 5]) * B[m, k + 5, r]
        s6 += to_float(x[row, k + 6]) * B[m, k + 6, r]
        s7 += to_float(x[row, k + 7]) * B[m, k + 7, r]
    for k in range(whole, in_features):
        s0 += to_float(x[row, k]) * B[m, k, r]
    return ((s0 + s1) + (s2 + s3)) + ((s4 + s5) + (s6 + s7))


@numba.njit(inline="always", **JIT)
def _correct_rows(out, x, A, B, row_slot, tokens, scale, job):
    """out[row] += scale * (x[row] B_m) A_m^T in float32 for the rows of one job, m = row_slot[row // tokens]."""
    rows, in_features, out_features, rank = out.shape[0], x.shape[1], out.shape[1], A.shape[2]
    correction = np.empty(out_features, np.float32)
    for row in range(job * ROWS_PER_JOB, min((job + 1) * ROWS_PER_JOB, rows)):
        m = row_slot[row // tokens]
        correction[:] = 0
        for r in range(rank):
            projected = _dot8(x, row, B, m, r, in_features)
            for o in range(out_features):
                correction[o] += projected * A[m, o, r]
        for o in range(out_features):
            out[row, o] = from_float(to_float(out[row, o]) + scale * correction[o], out)


@numba.njit(parallel=True, **JIT)
def lowrank_correction_kernel(out, x, A, B, row_slot, tokens, scale):
    """The low-rank correction of every row, jobs spread over the thread pool."""
    scale = F32(scale)
    for job in prange((out.shape[0] + ROWS_PER_JOB - 1) // ROWS_PER_JOB):
        _correct_rows(out, x, A, B, row_slot, tokens, scale, job)


@numba.njit(**JIT)
def lowrank_correction_serial(out, x, A, B, row_slot, tokens, scale):
    """The same rows on the calling thread: a decode step's correction is a few microseconds of work, less than
    starting the pool's parallel region."""
    scale = F32(scale)
    for job in range((out.shape[0] + ROWS_PER_JOB - 1) // ROWS_PER_JOB):
        _correct_rows(out, x, A, B, row_slot, tokens, scale, job)



"""The compiled CPU backend: every public op as a numba (LLVM) loop, multi-threaded over fixed tiles.

Same contract and signatures as `reference.py` (the oracle it is tested against):

    words   : Philox4x32-10 in uint64 registers (exact 32x32 -> 64-bit products), bit-identical to `rng.py`
    normals : u = (x >> 8) 2^-24 + 2^-25 in float32, then Box-Muller with float32 log / sin / cos written out as
              Cephes polynomials (plain + and *, so the loop vectorises and every element gets the same bits on
              any core, in any lane, for any thread count); within 2e-6 of numpy's transcendentals
    perturb : per tile of at most TILE elements: regenerate its Philox blocks into an L1-resident buffer, then
              dst = src + sigma * eps with one cast at the store -- one pass over memory
    update  : per tile: load target once into float32, add each member of the tile's subspace (noise regenerated
              into the same buffer), store once (round to nearest even, or stochastic rounding)
    multi   : multi_perturb_ / multi_restore_ / multi_accumulate_ cover every tensor of a run table in one call,
              reaching each through the table's data address (numba.carray; the table is checked once against its
              tensors and bounds), with the per-tensor kernels' tiles and arithmetic (the same bits)

Tiles lie on a fixed grid of global element indices (tile t covers [t TILE, (t + 1) TILE) of the whole parameter,
cut by chunk bounds), so which element a tile holds never depends on the thread count and the results are
bitwise identical for 1 and 2 threads. Threads follow `torch.get_num_threads()` (capped by numba's pool).

numba has no 16-bit float types: bfloat16 storage reaches the kernels as its uint16 bits and float16 as its int16
bits, converted in registers (bfloat16 with the same round-to-nearest-even as torch, float16 with LLVM's fptrunc;
a NaN is stored as torch's scalar conversion stores it). Compilations are cached on disk (`cache=True`), so only the first process
on a machine compiles.
"""

from __future__ import annotations

import functools
import math
import threading
import weakref
from collections.abc import Sequence
from dataclasses import dataclass

import numba
import numpy as np
import torch
import torch.nn.functional as F
from llvmlite import ir
from numba import prange, types
from numba.extending import intrinsic, overload

from copes_kernels import _validate as v
from copes_kernels.partition import DEFAULT_CHUNK_SIZE
from copes_kernels.run_tables import BACKUP, START, STOP, TENSOR, RunTable
from copes_kernels.rng import (
    MASK32,
    PHILOX_M0,
    PHILOX_M1,
    PHILOX_ROUNDS,
    PHILOX_W0,
    PHILOX_W1,
    ROUNDING_STREAM,
    TWO_PI,
    UNIFORM_HALF_STEP,
    UNIFORM_SCALE,
    check_philox_inputs,
)

# 2048 elements per tile: the float32 accumulator and the noise buffer of a tile (8 KB each) stay in L1, and the
# per-tile set-up (one small allocation) costs under 0.1 ns per element.
TILE = 2048
JIT = dict(nogil=True, cache=True, error_model="numpy")

_U64 = np.uint64
_M0, _M1, _W0, _W1, _LOW32 = _U64(PHILOX_M0), _U64(PHILOX_M1), _U64(PHILOX_W0), _U64(PHILOX_W1), _U64(MASK32)
_SHIFT32, _SHIFT8 = _U64(32), _U64(8)
_F = np.float32
_SCALE, _HALF_STEP, _TWO_PI = _F(UNIFORM_SCALE), _F(UNIFORM_HALF_STEP), _F(TWO_PI)
_ROUNDING = _U64(ROUNDING_STREAM)

# Cephes logf: log(x) = e ln 2 + log(m), m in [sqrt(1/2), sqrt(2)), ln 2 split so e ln 2 is exact in float32.
_SQRT_HALF = _F(0.707106781186547524)
_LN2_HI, _LN2_LO = _F(0.693359375), _F(-2.12194440e-4)
_LOG_POLY = tuple(_F(c) for c in (
    7.0376836292e-2, -1.1514610310e-1, 1.1676998740e-1, -1.2420140846e-1, 1.4249322787e-1, -1.6668057665e-1,
    2.0000714765e-1, -2.4999993993e-1, 3.3333331174e-1,
))
# Cephes sinf/cosf: reduce by multiples of pi/4 (pi/4 split in three so the reduction is exact for |x| < 8192).
_FOUR_OVER_PI = _F(1.27323954473516)
_DP1, _DP2, _DP3 = _F(0.78515625), _F(2.4187564849853515625e-4), _F(3.77489497744594108e-8)
_SIN_POLY = (_F(-1.9515295891e-4), _F(8.3321608736e-3), _F(-1.6666654611e-1))
_COS_POLY = (_F(2.443315711809948e-5), _F(-1.388731625493765e-3), _F(4.166664568298827e-2))

# What torch stores for a NaN: bfloat16 0x7FC0 whatever the sign, float16 sign | 0x7E00.
_BF16_NAN = np.uint16(0x7FC0)
_F16_QUIET_NAN = 0x7E00


# ----------------------------------------------------------------------------------------- bit-level intrinsics


@intrinsic
def _float_bits(typingctx, x):
    """float32 -> its int32 bit pattern."""
    if x != types.float32:
        return None

    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], ir.IntType(32))

    return types.int32(types.float32), codegen


@intrinsic
def _bits_float(typingctx, x):
    """The low 32 bits of an integer -> the float32 with that bit pattern."""
    if not isinstance(x, types.Integer):
        return None

    def codegen(context, builder, signature, args):
        value = args[0]
        if value.type.width > 32:
            value = builder.trunc(value, ir.IntType(32))
        return builder.bitcast(value, ir.FloatType())

    return types.float32(x), codegen


@intrinsic
def _half_bits_to_float(typingctx, x):
    """float16 bits (int16) -> float32, exactly (LLVM fpext)."""
    if x != types.int16:
        return None

    def codegen(context, builder, signature, args):
        return builder.fpext(builder.bitcast(args[0], ir.HalfType()), ir.FloatType())

    return types.float32(types.int16), codegen


@intrinsic
def _float_to_half_bits(typingctx, x):
    """float32 -> float16 bits (int16), rounded to nearest even (LLVM fptrunc)."""
    if x != types.float32:
        return None

    def codegen(context, builder, signature, args):
        return builder.bitcast(builder.fptrunc(args[0], ir.HalfType()), ir.IntType(16))

    return types.int16(types.float32), codegen


# ------------------------------------------------------------------------------ storage loads and stores


def to_float(value):
    """A storage element (float32, bfloat16 bits as uint16, float16 bits as int16) as float32."""


def from_float(x, like):
    """float32 -> an element of `like`'s storage dtype, rounded to nearest even (what torch stores)."""


def signed_bits(value):
    """A 16-bit storage element's bit pattern as a signed int32 (sign-magnitude order of the float)."""


def from_signed_bits(bits, like):
    """The inverse of `signed_bits` for an element of `like`'s dtype."""


@overload(to_float, inline="always")
def _to_float(value):
    if value == types.float32:
        return lambda value: value
    if value == types.uint16:
        return lambda value: _bits_float(np.int64(value) << 16)
    if value == types.int16:
        return lambda value: _half_bits_to_float(value)
    return None


@overload(from_float, inline="always")
def _from_float(x, like):
    dtype = like.dtype
    if dtype == types.float32:
        return lambda x, like: x
    if dtype == types.uint16:
        def to_bfloat16(x, like):
            bits = np.int64(_float_bits(x)) & 0xFFFFFFFF
            rounded = np.uint16((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16)
            return _BF16_NAN if x != x else rounded
        return to_bfloat16
    if dtype == types.int16:
        def to_float16(x, like):
            sign = (np.int64(_float_bits(x)) >> 16) & 0x8000
            return np.int16(sign | _F16_QUIET_NAN) if x != x else _float_to_half_bits(x)
        return to_float16
    return None


@overload(signed_bits, inline="always")
def _signed_bits(value):
    if value in (types.uint16, types.int16):
        return lambda value: np.int32(np.int16(value))
    return None


@overload(from_signed_bits, inline="always")
def _from_signed_bits(bits, like):
    if like.dtype == types.uint16:
        return lambda bits, like: np.uint16(bits & 0xFFFF)
    if like.dtype == types.int16:
        return lambda bits, like: np.int16(bits)
    return None


# ------------------------------------------------------------------------------------ the noise contract


@numba.njit(inline="always", **JIT)
def _philox(q, member, tensor_id, key0, key1):
    """Philox4x32-10 of counter (q lo, q hi, member, tensor_id) under key (key0, key1); words held in uint64."""
    c0, c1, c2, c3 = q & _LOW32, q >> _SHIFT32, member, tensor_id
    for _ in range(PHILOX_ROUNDS):
        p0 = c0 * _M0
        p1 = c2 * _M1
        c0, c1, c2, c3 = (p1 >> _SHIFT32) ^ c1 ^ key0, p1 & _LOW32, (p0 >> _SHIFT32) ^ c3 ^ key1, p0 & _LOW32
        key0 = (key0 + _W0) & _LOW32
        key1 = (key1 + _W1) & _LOW32
    return c0, c1, c2, c3


@numba.njit(inline="always", **JIT)
def _as_words(tensor_id, key0, key1):
    """Stream ids passed as int64 -> uint64 (mixing signed and unsigned integers would give float64 in numba)."""
    return _U64(tensor_id), _U64(key0), _U64(key1)


@numba.njit(inline="always", **JIT)
def _uniform(word):
    return _F(word >> _SHIFT8) * _SCALE + _HALF_STEP


@numba.njit(inline="always", **JIT)
def _log(x):
    """Natural log of a positive, normal float32 (Cephes logf, ~1 ulp)."""
    bits = np.int64(_float_bits(x))
    exponent = (bits >> 23) - 126
    m = _bits_float((bits & 0x007FFFFF) | 0x3F000000)  # x = m 2^exponent, m in [0.5, 1)
    small = m < _SQRT_HALF
    exponent = exponent - 1 if small else exponent
    m = (m + m - _F(1.0)) if small else (m - _F(1.0))
    z = m * m
    y = _LOG_POLY[0]
    for coefficient in _LOG_POLY[1:]:
        y = y * m + coefficient
    y = y * m * z
    e = _F(exponent)
    y = y + e * _LN2_LO - _F(0.5) * z
    return m + y + e * _LN2_HI


@numba.njit(inline="always", **JIT)
def _sin_cos(x):
    """(sin x, cos x) for float32 x in [0, 2 pi] (Cephes sinf/cosf with a shared reduction)."""
    octant = np.int32(x * _FOUR_OVER_PI)
    octant = octant + (octant & 1)  # round up to even: z lands in [-pi/4, pi/4]
    y = _F(octant)
    octant = octant & 7
    z = ((x - y * _DP1) - y * _DP2) - y * _DP3
    zz = z * z
    c = (((_COS_POLY[0] * zz + _COS_POLY[1]) * zz + _COS_POLY[2]) * zz * zz) - _F(0.5) * zz + _F(1.0)
    s = ((_SIN_POLY[0] * zz + _SIN_POLY[1]) * zz + _SIN_POLY[2]) * zz * z + z
    swapped = (octant & 2) != 0
    sine = c if swapped else s
    cosine = s if swapped else c
    sine = -sine if octant >= 4 else sine
    cosine = -cosine if (octant == 2) | (octant == 4) else cosine
    return sine, cosine


@numba.njit(inline="always", **JIT)
def _normals(q, member, tensor_id, key0, key1):
    """The four Box-Muller normals of Philox block q."""
    x0, x1, x2, x3 = _philox(q, member, tensor_id, key0, key1)
    radius0 = np.sqrt(_F(-2.0) * _log(_uniform(x0)))
    radius1 = np.sqrt(_F(-2.0) * _log(_uniform(x2)))
    sin0, cos0 = _sin_cos(_TWO_PI * _uniform(x1))
    sin1, cos1 = _sin_cos(_TWO_PI * _uniform(x3))
    return radius0 * cos0, radius0 * sin0, radius1 * cos1, radius1 * sin1


@numba.njit(inline="always", **JIT)
def _fill_normals(buffer, first_block, blocks, member, tensor_id, key0, key1):
    """buffer[4 b + k] = normal k of block first_block + b, for b < blocks."""
    for b in range(blocks):
        n0, n1, n2, n3 = _normals(_U64(first_block + b), member, tensor_id, key0, key1)
        buffer[4 * b] = n0
        buffer[4 * b + 1] = n1
        buffer[4 * b + 2] = n2
        buffer[4 * b + 3] = n3


@numba.njit(inline="always", **JIT)
def _fill_uniforms(buffer, first_block, blocks, stream, tensor_id, key0, key1):
    """buffer[4 b + k] = uniform of word k of block first_block + b (the stochastic-rounding stream)."""
    for b in range(blocks):
        x0, x1, x2, x3 = _philox(_U64(first_block + b), stream, tensor_id, key0, key1)
        buffer[4 * b] = _uniform(x0)
        buffer[4 * b + 1] = _uniform(x1)
        buffer[4 * b + 2] = _uniform(x2)
        buffer[4 * b + 3] = _uniform(x3)


def round_stochastic(value, u, like):
    """float32 -> 16-bit storage: the nearest value, or its neighbour towards `value` with probability |error| / gap."""


@overload(round_stochastic, inline="always")
def _round_stochastic(value, u, like):
    if like.dtype == types.float32:
        # Never called (stochastic rounding of float32 is rejected up front); typed so one kernel serves every dtype.
        return lambda value, u, like: value

    def to_neighbour(value, u, like):
        # The reference's rule: in the signed-bits view of a 16-bit float, +1 moves away from zero for either sign.
        nearest = from_float(value, like)
        nearest_f = to_float(nearest)
        error = value - nearest_f
        if nearest_f == 0:
            neighbour_bits = 1 if error > 0 else -0x7FFF
        else:
            neighbour_bits = signed_bits(nearest) + (1 if (error > 0) == (nearest_f > 0) else -1)
        neighbour = from_signed_bits(neighbour_bits, like)
        gap = abs(to_float(neighbour) - nearest_f)
        return neighbour if (error != 0) and (u * gap < abs(error)) else nearest

    return to_neighbour


# ----------------------------------------------------------------------------------------------- kernels


@numba.njit(inline="always", **JIT)
def _tile_blocks(offset, start, stop):
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
def _tile_table(starts, stops, offset):
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
def _perturb_kernel(
    dst, src, chunk_owner, partitioned, subspace, chunk_size, offset, sigma, member, tensor_id, key0, key1
):
    run_starts, run_stops = _owner_runs(dst.size, offset, chunk_size, chunk_owner, partitioned, subspace)
    tile_starts, tile_stops, _ = _tile_table(run_starts, run_stops, offset)
    sigma, member = _F(sigma), _U64(member)
    tensor_id, key0, key1 = _as_words(tensor_id, key0, key1)
    for t in prange(tile_starts.size):
        start, stop = tile_starts[t], tile_stops[t]
        first_block, blocks, shift = _tile_blocks(offset, start, stop)
        eps = np.empty(4 * blocks, np.float32)
        _fill_normals(eps, first_block, blocks, member, tensor_id, key0, key1)
        for i in range(start, stop):
            dst[i] = from_float(to_float(src[i]) + sigma * eps[i + shift], dst)


@numba.njit(inline="always", **JIT)
def _noise_sum(total, eps, target, start, stop, first_block, blocks, shift, members, coeffs, low, high, tensor_id,
               key0, key1):
    """total[i - start] = target[i] in float32 plus coeffs[j] * eps_(members[j])(i) for j in [low, high), the
    noise of each member regenerated into the tile's buffer `eps`."""
    for i in range(start, stop):
        total[i - start] = to_float(target[i])
    for j in range(low, high):
        _fill_normals(eps, first_block, blocks, _U64(members[j]), tensor_id, key0, key1)
        coeff = coeffs[j]
        for i in range(start, stop):
            total[i - start] += coeff * eps[i + shift]


@numba.njit(parallel=True, **JIT)
def _accumulate_kernel(
    target, chunk_owner, partitioned, chunk_size, member_owners, members, coeffs, offset, stochastic, tensor_id,
    key0, key1,
):
    """Members sorted by owning subspace (`member_owners`, ascending): a tile adds its subspace's segment."""
    run_starts, run_stops, run_lows, run_highs = _selected_runs(
        target.size, offset, chunk_size, chunk_owner, partitioned, member_owners
    )
    tile_starts, tile_stops, tile_runs = _tile_table(run_starts, run_stops, offset)
    tensor_id, key0, key1 = _as_words(tensor_id, key0, key1)
    for t in prange(tile_starts.size):
        start, stop, run = tile_starts[t], tile_stops[t], tile_runs[t]
        first_block, blocks, shift = _tile_blocks(offset, start, stop)
        total, eps = np.empty(stop - start, np.float32), np.empty(4 * blocks, np.float32)
        _noise_sum(total, eps, target, start, stop, first_block, blocks, shift, members, coeffs, run_lows[run],
                   run_highs[run], tensor_id, key0, key1)
        if stochastic:
            _fill_uniforms(eps, first_block, blocks, _ROUNDING, tensor_id, key0, key1)
            for i in range(start, stop):
                target[i] = round_stochastic(total[i - start], eps[i + shift], target)
        else:
            for i in range(start, stop):
                target[i] = from_float(total[i - start], target)


@numba.njit(parallel=True, **JIT)
def _store_stochastic_kernel(dst, values, offset, tensor_id, key0, key1):
    """dst[i] = stochastic rounding of float32 values[i] with the uniforms of element offset + i."""
    tiles = (offset + dst.size - 1) // TILE - offset // TILE + 1
    tensor_id, key0, key1 = _as_words(tensor_id, key0, key1)
    for t in prange(tiles):
        start, stop = _grid_tile(offset, dst.size, t)
        first_block, blocks, shift = _tile_blocks(offset, start, stop)
        u = np.empty(4 * blocks, np.float32)
        _fill_uniforms(u, first_block, blocks, _ROUNDING, tensor_id, key0, key1)
        for i in range(start, stop):
            dst[i] = round_stochastic(values[i], u[i + shift], dst)


@numba.njit(parallel=True, **JIT)
def _normal_rows_kernel(out, members, offset, tensor_id, key0, key1):
    """out[p, i] = eps_{members[p]}(offset + i) for every row p of a 2-D float32 array."""
    n = out.shape[1]
    tiles_per_row = (offset + n - 1) // TILE - offset // TILE + 1
    tensor_id, key0, key1 = _as_words(tensor_id, key0, key1)
    for job in prange(out.shape[0] * tiles_per_row):
        row, t = job // tiles_per_row, job % tiles_per_row
        start, stop = _grid_tile(offset, n, t)
        first_block, blocks, shift = _tile_blocks(offset, start, stop)
        eps = np.empty(4 * blocks, np.float32)
        _fill_normals(eps, first_block, blocks, _U64(members[row]), tensor_id, key0, key1)
        for i in range(start, stop):
            out[row, i] = eps[i + shift]


@numba.njit(parallel=True, **JIT)
def _philox_kernel(out, counters, keys):
    """out[e, :] = Philox4x32-10(counters[e, :], keys[e, :]) on uint32 values held in int64."""
    for e in prange(out.shape[0]):
        q = _U64(counters[e, 0]) | (_U64(counters[e, 1]) << _SHIFT32)
        words = _philox(q, _U64(counters[e, 2]), _U64(counters[e, 3]), _U64(keys[e, 0]), _U64(keys[e, 1]))
        out[e, 0], out[e, 1] = np.int64(words[0]), np.int64(words[1])
        out[e, 2], out[e, 3] = np.int64(words[2]), np.int64(words[3])


@numba.njit(**JIT)
def _packed_runs(numel, offset, chunk_size, chunk_owner, subspace):
    """`subspace`'s local runs, where each starts in the packed copy, and the packed size."""
    starts, stops = _owner_runs(numel, offset, chunk_size, chunk_owner, True, subspace)
    packed_starts = np.empty(starts.size, np.int64)
    size = 0
    for r in range(starts.size):
        packed_starts[r] = size
        size += stops[r] - starts[r]
    return starts, stops, packed_starts, size


@numba.njit(parallel=True, **JIT)
def _backup_kernel(chunked, chunk_owner, subspace, chunk_size, offset):
    """A new packed copy of `subspace`'s runs (integer views: exact bits)."""
    starts, stops, packed_starts, size = _packed_runs(chunked.size, offset, chunk_size, chunk_owner, subspace)
    packed = np.empty(size, chunked.dtype)
    for r in prange(starts.size):
        packed[packed_starts[r] : packed_starts[r] + stops[r] - starts[r]] = chunked[starts[r] : stops[r]]
    return packed


@numba.njit(parallel=True, **JIT)
def _restore_kernel(chunked, packed, chunk_owner, subspace, chunk_size, offset):
    """Write a packed copy back into `subspace`'s runs; returns the size it needs (and writes nothing if `packed`
    does not have it)."""
    starts, stops, packed_starts, size = _packed_runs(chunked.size, offset, chunk_size, chunk_owner, subspace)
    if packed.size == size:
        for r in prange(starts.size):
            chunked[starts[r] : stops[r]] = packed[packed_starts[r] : packed_starts[r] + stops[r] - starts[r]]
    return size


# Rows per parallel job of the low-rank correction: its buffers are allocated once per job, not once per row.
_ROWS_PER_JOB = 64


@numba.njit(inline="always", **JIT)
def _dot8(x, row, B, m, r, in_features):
    """x[row] . B[m, :, r] in float32 with eight independent partial sums (hides the FMA latency)."""
    s0 = s1 = s2 = s3 = s4 = s5 = s6 = s7 = _F(0.0)
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
    for row in range(job * _ROWS_PER_JOB, min((job + 1) * _ROWS_PER_JOB, rows)):
        m = row_slot[row // tokens]
        correction[:] = 0
        for r in range(rank):
            projected = _dot8(x, row, B, m, r, in_features)
            for o in range(out_features):
                correction[o] += projected * A[m, o, r]
        for o in range(out_features):
            out[row, o] = from_float(to_float(out[row, o]) + scale * correction[o], out)


@numba.njit(parallel=True, **JIT)
def _lowrank_correction_kernel(out, x, A, B, row_slot, tokens, scale):
    """The low-rank correction of every row, jobs spread over the thread pool."""
    scale = _F(scale)
    for job in prange((out.shape[0] + _ROWS_PER_JOB - 1) // _ROWS_PER_JOB):
        _correct_rows(out, x, A, B, row_slot, tokens, scale, job)


@numba.njit(**JIT)
def _lowrank_correction_serial(out, x, A, B, row_slot, tokens, scale):
    """The same rows on the calling thread: a decode step's correction is a few microseconds of work, less than
    starting the pool's parallel region."""
    scale = _F(scale)
    for job in range((out.shape[0] + _ROWS_PER_JOB - 1) // _ROWS_PER_JOB):
        _correct_rows(out, x, A, B, row_slot, tokens, scale, job)


# ------------------------------------------------------------------------- multi-tensor kernels (run tables)
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
def _multi_perturb_kernel(
    runs, pointers, numels, ids, like, backup, with_backup, sigma, member, key0, key1
):
    """Per run row (tensor, start, stop, backup offset, subspace): pack the row's bits into `backup` (when
    `with_backup`; `backup` is a same-width integer array), then dst = dst + sigma * eps of that tensor."""
    tile_starts, tile_stops, tile_rows = _tile_table(runs[:, 1], runs[:, 2], 0)
    sigma, member = _F(sigma), _U64(member)
    _, key0, key1 = _as_words(0, key0, key1)
    for t in prange(tile_starts.size):
        start, stop, row = tile_starts[t], tile_stops[t], tile_rows[t]
        tensor = runs[row, 0]
        dst = _tensor_view(pointers, numels, tensor, like)
        if with_backup:
            dst_bits = _tensor_view(pointers, numels, tensor, backup)
            _copy(backup, runs[row, 3] - runs[row, 1] + start, dst_bits, start, stop - start)
        first_block, blocks, shift = _tile_blocks(0, start, stop)
        eps = np.empty(4 * blocks, np.float32)
        _fill_normals(eps, first_block, blocks, member, _U64(ids[tensor]), key0, key1)
        for i in range(start, stop):
            dst[i] = from_float(to_float(dst[i]) + sigma * eps[i + shift], dst)


@numba.njit(parallel=True, **JIT)
def _multi_restore_kernel(runs, pointers, numels, backup):
    """Per run row: write its packed bits back from `backup` (the inverse of the perturb kernel's copy)."""
    tile_starts, tile_stops, tile_rows = _tile_table(runs[:, 1], runs[:, 2], 0)
    for t in prange(tile_starts.size):
        start, stop, row = tile_starts[t], tile_stops[t], tile_rows[t]
        dst_bits = _tensor_view(pointers, numels, runs[row, 0], backup)
        _copy(dst_bits, start, backup, runs[row, 3] - runs[row, 1] + start, stop - start)


@numba.njit(parallel=True, **JIT)
def _multi_accumulate_kernel(
    runs, pointers, numels, ids, like, member_owners, members, coeffs, stochastic, key0, key1
):
    """Per run row: add the members of the row's subspace (members sorted by owner, `member_owners` ascending) in
    one float32 tile, store once; rows of a subspace without members are neither read nor written. Returns the
    float64 sum of squared stored changes, added over tiles in tile order (the same for any thread count)."""
    tile_starts, tile_stops, tile_rows = _tile_table(runs[:, 1], runs[:, 2], 0)
    partials = np.zeros(tile_starts.size, np.float64)
    _, key0, key1 = _as_words(0, key0, key1)
    for t in prange(tile_starts.size):
        start, stop, row = tile_starts[t], tile_stops[t], tile_rows[t]
        low = np.searchsorted(member_owners, runs[row, 4], side="left")
        high = np.searchsorted(member_owners, runs[row, 4], side="right")
        if high > low:
            tensor = runs[row, 0]
            tensor_id = _U64(ids[tensor])
            target = _tensor_view(pointers, numels, tensor, like)
            first_block, blocks, shift = _tile_blocks(0, start, stop)
            total, eps = np.empty(stop - start, np.float32), np.empty(4 * blocks, np.float32)
            _noise_sum(total, eps, target, start, stop, first_block, blocks, shift, members, coeffs, low, high,
                       tensor_id, key0, key1)
            if stochastic:
                _fill_uniforms(eps, first_block, blocks, _ROUNDING, tensor_id, key0, key1)
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


# ----------------------------------------------------------------------------------------------- host side

# numba cannot hold 16-bit floats: their bits travel as integers, bfloat16 as uint16 and float16 as int16.
_KERNEL_VIEWS = {torch.float32: torch.float32, torch.bfloat16: torch.uint16, torch.float16: torch.int16}


def _kernel_array(tensor: torch.Tensor) -> np.ndarray:
    """A numpy view (shared memory) of a contiguous float storage tensor, in the kernels' element type."""
    if tensor.dtype == torch.float32:
        return tensor.numpy()
    return tensor.view(_KERNEL_VIEWS[tensor.dtype]).numpy()


@functools.cache
def _start_thread_pool() -> None:
    """Start numba's pool once. With the OpenMP layer that resets the OpenMP thread count torch shares, so torch's
    setting (e.g. `--cpu-threads 1`) is put back."""
    torch_threads = torch.get_num_threads()
    numba.set_num_threads(numba.config.NUMBA_NUM_THREADS)
    torch.set_num_threads(torch_threads)


# numba's thread count is per calling thread; remembering the last one set skips numba's (locking) getter.
_calling_thread = threading.local()


def use_torch_threads() -> int:
    """Run the parallel loops on as many threads as torch may use (numba's pool is the cap)."""
    _start_thread_pool()
    threads = max(1, min(torch.get_num_threads(), numba.config.NUMBA_NUM_THREADS))
    if getattr(_calling_thread, "threads", None) != threads:
        numba.set_num_threads(threads)
        _calling_thread.threads = threads
    return threads


def _key(seed: int) -> tuple[int, int]:
    """The Philox key words of `seed`. Stream ids reach the kernels as Python ints (cheaper to pass than numpy
    scalars) and become uint64 there (`_as_words`)."""
    return int(seed) & MASK32, int(seed) >> 32


_NO_PARTITION = np.empty(0, np.int16)


def _chunk_owner(chunk_subspace: torch.Tensor | None) -> tuple[np.ndarray, bool]:
    """The partition as the kernels take it: (chunk -> subspace array, whether there is one)."""
    return (_NO_PARTITION, False) if chunk_subspace is None else (chunk_subspace.numpy(), True)


def _touches_nothing(
    numel: int, *, offset: int, chunk_subspace: torch.Tensor | None, subspace: int | None, chunk_size: int
) -> bool:
    """An empty slice, or one inside a single chunk of another subspace: nothing to read or write.

    Most small tensors are one chunk, so most of a member's calls on them end here, before the kernel call's
    fixed cost."""
    if numel == 0:
        return True
    if chunk_subspace is None:
        return False
    first = offset // chunk_size
    return first == (offset + numel - 1) // chunk_size and int(chunk_subspace.numpy()[first]) != int(subspace)


def philox4x32_10(counter: torch.Tensor, key: torch.Tensor) -> torch.Tensor:
    """Philox4x32-10 on int64 tensors holding uint32 values: counter [..., 4], key [..., 2] -> words [..., 4]."""
    check_philox_inputs(counter, key)
    shape = torch.broadcast_shapes(counter.shape[:-1], key.shape[:-1])
    counters = counter.cpu().expand(*shape, 4).reshape(-1, 4).contiguous()
    keys = key.cpu().expand(*shape, 2).reshape(-1, 2).contiguous()
    out = torch.empty(counters.shape[0], 4, dtype=torch.int64)
    if out.numel():
        use_torch_threads()
        _philox_kernel(out.numpy(), counters.numpy(), keys.numpy())
    return out.view(*shape, 4).to(counter.device)


def _normal_rows(out: torch.Tensor, members: Sequence[int], *, seed: int, tensor_id: int, offset: int) -> None:
    if out.numel():
        use_torch_threads()
        _normal_rows_kernel(out.numpy(), np.asarray(members, np.int64), offset, int(tensor_id), *_key(seed))


def normal(
    n: int, *, seed: int, member: int, tensor_id: int, offset: int = 0, device: torch.device | str | None = None
) -> torch.Tensor:
    v.check_normal_args(n, seed=seed, member=member, tensor_id=tensor_id, offset=offset)
    out = torch.empty(1, int(n), dtype=torch.float32)
    _normal_rows(out, [member], seed=seed, tensor_id=tensor_id, offset=int(offset))
    return out.view(-1).to(device)


def perturb_(
    dst: torch.Tensor,
    *,
    seed: int,
    member: int,
    tensor_id: int,
    sigma: float,
    offset: int = 0,
    src: torch.Tensor | None = None,
    chunk_subspace: torch.Tensor | None = None,
    subspace: int | None = None,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
) -> torch.Tensor:
    """dst[i] = src[i] + sigma * eps(offset + i) on the chunks of `subspace`; nothing else is read or written."""
    v.check_perturb_args(
        dst, src, seed=seed, member=member, tensor_id=tensor_id, sigma=sigma, offset=offset,
        chunk_subspace=chunk_subspace, subspace=subspace, chunk_size=chunk_size,
    )
    if _touches_nothing(dst.numel(), offset=offset, chunk_subspace=chunk_subspace, subspace=subspace,
                        chunk_size=chunk_size):
        return dst
    flat_dst = _kernel_array(dst.view(-1))
    flat_src = flat_dst if src is None else _kernel_array(src.reshape(-1))
    use_torch_threads()
    _perturb_kernel(
        flat_dst, flat_src, *_chunk_owner(chunk_subspace), 0 if subspace is None else int(subspace), chunk_size,
        offset, float(sigma), int(member), int(tensor_id), *_key(seed),
    )
    return dst


def accumulate_(
    target: torch.Tensor,
    *,
    seed: int,
    members: Sequence[int] | torch.Tensor,
    coeffs: Sequence[float] | torch.Tensor,
    tensor_id: int,
    offset: int = 0,
    chunk_subspace: torch.Tensor | None = None,
    member_subspaces: Sequence[int] | torch.Tensor | None = None,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    rounding: str = "nearest",
) -> torch.Tensor:
    """target[i] += sum_j coeffs[j] * [subspace(chunk(i)) == member_subspaces[j]] * eps_j(offset + i).

    A tile only regenerates the noise of the members that own its subspace. `rounding="stochastic"` stores
    bfloat16/float16 targets with unbiased stochastic rounding (keyed by seed and tensor_id).
    """
    members_t, coeffs_t = v.as_members_and_coeffs(target, members, coeffs)
    subspaces_t = v.check_accumulate_args(
        target, seed=seed, members=members_t, tensor_id=tensor_id, offset=offset, chunk_subspace=chunk_subspace,
        member_subspaces=member_subspaces, chunk_size=chunk_size, rounding=rounding,
    )
    if target.numel() == 0 or members_t.numel() == 0:
        return target
    if subspaces_t is None:
        subspaces_t = torch.zeros_like(members_t)
    order = torch.argsort(subspaces_t, stable=True)  # members of one subspace form one segment
    use_torch_threads()
    _accumulate_kernel(
        _kernel_array(target.view(-1)), *_chunk_owner(chunk_subspace), chunk_size, subspaces_t[order].numpy(),
        members_t[order].numpy(), coeffs_t[order].numpy(), offset, rounding == "stochastic", int(tensor_id),
        *_key(seed),
    )
    return target


def backup_chunks(
    src: torch.Tensor,
    *,
    chunk_subspace: torch.Tensor,
    subspace: int,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    offset: int = 0,
) -> torch.Tensor:
    """A packed 1-D copy of the elements in `subspace`'s chunks (1/K of the tensor), in element order."""
    v.check_storage("src", src)
    v.check_chunking(src, offset=offset, chunk_subspace=chunk_subspace, subspace=subspace, chunk_size=chunk_size)
    if _touches_nothing(src.numel(), offset=offset, chunk_subspace=chunk_subspace, subspace=subspace,
                        chunk_size=chunk_size):
        return src.new_empty(0)
    use_torch_threads()
    # Slice copies move raw bits, NaN payloads included, in any element type.
    packed = _backup_kernel(_kernel_array(src.view(-1)), chunk_subspace.numpy(), int(subspace), chunk_size, offset)
    return torch.from_numpy(packed).view(src.dtype)


def restore_chunks_(
    dst: torch.Tensor,
    backup: torch.Tensor,
    *,
    chunk_subspace: torch.Tensor,
    subspace: int,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    offset: int = 0,
) -> torch.Tensor:
    """Write a `backup_chunks` copy back into its chunks: the exact inverse, bit for bit."""
    v.check_restore_args(dst, backup, offset=offset, chunk_subspace=chunk_subspace, subspace=subspace,
                         chunk_size=chunk_size)
    if _touches_nothing(dst.numel(), offset=offset, chunk_subspace=chunk_subspace, subspace=subspace,
                        chunk_size=chunk_size):
        v.check_backup_size(backup, expected=0, subspace=subspace)
        return dst
    use_torch_threads()
    needed = _restore_kernel(
        _kernel_array(dst.view(-1)), _kernel_array(backup.view(-1)), chunk_subspace.numpy(), int(subspace), chunk_size,
        offset,
    )
    v.check_backup_size(backup, expected=needed, subspace=subspace)  # the kernel wrote nothing if this fails
    return dst


def lowrank_factors(
    *,
    seed: int,
    member: int | Sequence[int] | torch.Tensor,
    tensor_id: int,
    out_features: int,
    in_features: int,
    rank: int,
    device: torch.device | str | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """EGGROLL factors from the eps stream of (seed, member, tensor_id): A = eps[0 : m r] as [m, r], B the next n r.

    An int member gives A [m, r], B [n, r]; a sequence of members gives [P, m, r], [P, n, r].
    """
    v.check_factor_request(seed=seed, tensor_id=tensor_id, out_features=out_features, in_features=in_features,
                           rank=rank)
    member_list, single = v.as_member_list(member)
    population, a_size = len(member_list), out_features * rank
    A = torch.empty(population, a_size, dtype=torch.float32)
    B = torch.empty(population, in_features * rank, dtype=torch.float32)
    _normal_rows(A, member_list, seed=seed, tensor_id=tensor_id, offset=0)
    _normal_rows(B, member_list, seed=seed, tensor_id=tensor_id, offset=a_size)
    A = A.view(population, out_features, rank).to(device)
    B = B.view(population, in_features, rank).to(device)
    return (A[0], B[0]) if single else (A, B)


def lowrank_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    *,
    A: torch.Tensor,
    B: torch.Tensor,
    row_member: torch.Tensor,
    sigma: float,
    check_rows: bool = True,
) -> torch.Tensor:
    """Row b of x (shape [batch, ..., in]) sees W + sigma / sqrt(r) * A_m B_m^T with m = row_member[b].

    One base GEMM for the whole batch (torch), then the per-row rank-r correction added in place (one pass).
    `check_rows=False` skips the row_member range check (done once per step by the caller).
    """
    rank = v.check_lowrank_linear_args(x, weight, A, B, row_member, sigma, check_rows=check_rows)
    out = F.linear(x, weight, bias).contiguous()
    if out.numel() == 0:
        return out
    batch, out_features, in_features = x.shape[0], weight.shape[0], weight.shape[1]
    tokens = out.numel() // (batch * out_features)
    # One job of rows (a decode step on a small model) or one thread: no parallel region. Each row is computed
    # the same way by either kernel, so the bits do not depend on the choice.
    serial = out.numel() <= _ROWS_PER_JOB * out_features or use_torch_threads() == 1
    (_lowrank_correction_serial if serial else _lowrank_correction_kernel)(
        _kernel_array(out).reshape(-1, out_features), _kernel_array(x.contiguous()).reshape(-1, in_features),
        A.contiguous().numpy(), B.contiguous().numpy(), row_member.contiguous().numpy(), tokens,
        float(sigma) / math.sqrt(rank),
    )
    return out


def store_stochastic_(
    dst: torch.Tensor, values: torch.Tensor, *, seed: int, tensor_id: int, offset: int = 0
) -> torch.Tensor:
    """Store float32 `values` into 16-bit `dst` (same numel, contiguous) with unbiased stochastic rounding."""
    if dst.numel():
        use_torch_threads()
        _store_stochastic_kernel(
            _kernel_array(dst.view(-1)), values.contiguous().view(-1).numpy(), offset, int(tensor_id), *_key(seed)
        )
    return dst


def lowrank_accumulate_(
    weight: torch.Tensor,
    *,
    A: torch.Tensor,
    B: torch.Tensor,
    coeffs: Sequence[float] | torch.Tensor,
    scale: float,
    rounding: str = "nearest",
    seed: int = 0,
    tensor_id: int = 0,
) -> torch.Tensor:
    """weight += scale * sum_j coeffs[j] A_j B_j^T as one GEMM over the stacked factors [m, P r] x [P r, n].

    `seed` and `tensor_id` only key the stochastic rounding stream (a compiled store loop).
    """
    updated = v.lowrank_updated(weight, A=A, B=B, coeffs=coeffs, scale=scale, rounding=rounding)
    if rounding == "stochastic":
        return store_stochastic_(weight, updated, seed=seed, tensor_id=tensor_id)
    return weight.copy_(updated)


# ------------------------------------------------------------------------------ multi-tensor ops (run tables)

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
            raise ValueError("the run table has rows outside its tensors or its backup (rebuild it with build_run_table)")
    bits = _BITS_VIEWS[table.dtype]
    like = _kernel_array(table.tensors[0][:0])
    cached = _KernelTable(runs, pointers, numels, table.ids.numpy(), like, torch.empty(0, dtype=bits).numpy())
    _kernel_tables[table] = cached
    return cached


def _backup_bits(backup: torch.Tensor) -> np.ndarray:
    return backup.view(_BITS_VIEWS[backup.dtype]).numpy()


def multi_perturb_(table: RunTable, *, seed: int, member: int, sigma: float, backup: torch.Tensor | None = None) -> None:
    """Perturb every tensor of `table` on its subspace's chunks in one compiled call; with `backup`
    (table.backup_numel elements of the table's dtype) first copy those chunks there, packed in row order."""
    v.check_multi_perturb_args(table, seed=seed, member=member, sigma=sigma, backup=backup)
    kernel_table = _kernel_table(table)
    use_torch_threads()
    _multi_perturb_kernel(
        kernel_table.runs, kernel_table.pointers, kernel_table.numels, kernel_table.ids, kernel_table.like,
        kernel_table.no_backup if backup is None else _backup_bits(backup), backup is not None, float(sigma),
        int(member), *_key(seed),
    )


def multi_restore_(table: RunTable, backup: torch.Tensor) -> None:
    """Write a `multi_perturb_` backup back into its chunks in one compiled call: the exact inverse, bit for bit."""
    v.check_multi_backup(table, backup)
    kernel_table = _kernel_table(table)
    use_torch_threads()
    _multi_restore_kernel(kernel_table.runs, kernel_table.pointers, kernel_table.numels, _backup_bits(backup))


def multi_accumulate_(
    table: RunTable,
    *,
    seed: int,
    members: Sequence[int] | torch.Tensor,
    coeffs: Sequence[float] | torch.Tensor,
    member_subspaces: Sequence[int] | torch.Tensor,
    rounding: str = "nearest",
) -> torch.Tensor:
    """Add the reward-weighted noise of `members` to every tensor of `table` (a table of every chunk) in one
    compiled call, each run only the members of its own subspace; returns the squared L2 norm of the stored change
    (float64 0-d)."""
    members_h, coeffs_h, subspaces_h = v.check_multi_accumulate_args(
        table, seed=seed, members=members, coeffs=coeffs, member_subspaces=member_subspaces, rounding=rounding
    )
    kernel_table = _kernel_table(table)
    order = torch.argsort(subspaces_h, stable=True)  # members of one subspace form one segment, in member order
    use_torch_threads()
    squared = _multi_accumulate_kernel(
        kernel_table.runs, kernel_table.pointers, kernel_table.numels, kernel_table.ids, kernel_table.like,
        subspaces_h[order].numpy(), members_h[order].numpy(), coeffs_h[order].numpy(), rounding == "stochastic",
        *_key(seed),
    )
    return torch.tensor(squared, dtype=torch.float64)

"""The compiled CPU backend's arithmetic: the noise contract and the storage conversions as inlined numba code.

    words   : Philox4x32-10 in uint64 registers (exact 32x32 -> 64-bit products), bit-identical to `rng.py`
    normals : u = (x >> 8) 2^-24 + 2^-25 in float32, then Box-Muller with float32 log / sin / cos written out as
              Cephes polynomials (plain + and *, so the loop vectorises and every element gets the same bits on
              any core, in any lane, for any thread count); within 2e-6 of numpy's transcendentals
    storage : numba has no 16-bit float types: bfloat16 storage reaches the kernels as its uint16 bits and float16
              as its int16 bits, converted in registers (bfloat16 with the same round-to-nearest-even as torch,
              float16 with LLVM's fptrunc; a NaN is stored as torch's scalar conversion stores it)
    rounding: unbiased stochastic rounding to 16-bit storage, the reference's rule

Everything here is inlined into the kernels of `kernels.py` and `multi_kernels.py`; `numba_cache` (imported first)
keys their on-disk cache by the source of this whole package and of the contract, so a changed constant here or in
`copes_kernels.rng` recompiles them.
"""

from __future__ import annotations

import numba
import numpy as np
from llvmlite import ir
from numba import types
from numba.extending import intrinsic, overload

from copes_kernels.backends.cpu import numba_cache  # noqa: F401  (before any @njit: the cache's source stamp)

# The contract's constants by name, as triton/rng.py imports them: each compiler reads module globals as
# compile-time constants, so each kernel module imports its own (the values live once, in copes_kernels/rng.py).
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
)

# 2048 elements per tile: the float32 accumulator and the noise buffer of a tile (8 KB each) stay in L1, and the
# per-tile set-up (one small allocation) costs under 0.1 ns per element.
TILE = 2048
JIT = dict(nogil=True, cache=True, error_model="numpy")

U64 = np.uint64
_M0, _M1, _W0, _W1, _LOW32 = U64(PHILOX_M0), U64(PHILOX_M1), U64(PHILOX_W0), U64(PHILOX_W1), U64(MASK32)
SHIFT32, _SHIFT8 = U64(32), U64(8)
F32 = np.float32
_SCALE, _HALF_STEP, _TWO_PI = F32(UNIFORM_SCALE), F32(UNIFORM_HALF_STEP), F32(TWO_PI)
ROUNDING_WORD = U64(ROUNDING_STREAM)

# Cephes logf: log(x) = e ln 2 + log(m), m in [sqrt(1/2), sqrt(2)), ln 2 split so e ln 2 is exact in float32.
_SQRT_HALF = F32(0.707106781186547524)
_LN2_HI, _LN2_LO = F32(0.693359375), F32(-2.12194440e-4)
_LOG_POLY = tuple(F32(c) for c in (
    7.0376836292e-2, -1.1514610310e-1, 1.1676998740e-1, -1.2420140846e-1, 1.4249322787e-1, -1.6668057665e-1,
    2.0000714765e-1, -2.4999993993e-1, 3.3333331174e-1,
))
# Cephes sinf/cosf: reduce by multiples of pi/4 (pi/4 split in three so the reduction is exact for |x| < 8192).
_FOUR_OVER_PI = F32(1.27323954473516)
_DP1, _DP2, _DP3 = F32(0.78515625), F32(2.4187564849853515625e-4), F32(3.77489497744594108e-8)
_SIN_POLY = (F32(-1.9515295891e-4), F32(8.3321608736e-3), F32(-1.6666654611e-1))
_COS_POLY = (F32(2.443315711809948e-5), F32(-1.388731625493765e-3), F32(4.166664568298827e-2))

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
def philox(q, member, tensor_id, key0, key1):
    """Philox4x32-10 of counter (q lo, q hi, member, tensor_id) under key (key0, key1); words held in uint64."""
    c0, c1, c2, c3 = q & _LOW32, q >> SHIFT32, member, tensor_id
    for _ in range(PHILOX_ROUNDS):
        p0 = c0 * _M0
        p1 = c2 * _M1
        c0, c1, c2, c3 = (p1 >> SHIFT32) ^ c1 ^ key0, p1 & _LOW32, (p0 >> SHIFT32) ^ c3 ^ key1, p0 & _LOW32
        key0 = (key0 + _W0) & _LOW32
        key1 = (key1 + _W1) & _LOW32
    return c0, c1, c2, c3


@numba.njit(inline="always", **JIT)
def as_words(tensor_id, key0, key1):
    """Stream ids passed as int64 -> uint64 (mixing signed and unsigned integers would give float64 in numba)."""
    return U64(tensor_id), U64(key0), U64(key1)


@numba.njit(inline="always", **JIT)
def _uniform(word):
    return F32(word >> _SHIFT8) * _SCALE + _HALF_STEP


@numba.njit(inline="always", **JIT)
def _log(x):
    """Natural log of a positive, normal float32 (Cephes logf, ~1 ulp)."""
    bits = np.int64(_float_bits(x))
    exponent = (bits >> 23) - 126
    m = _bits_float((bits & 0x007FFFFF) | 0x3F000000)  # x = m 2^exponent, m in [0.5, 1)
    small = m < _SQRT_HALF
    exponent = exponent - 1 if small else exponent
    m = (m + m - F32(1.0)) if small else (m - F32(1.0))
    z = m * m
    y = _LOG_POLY[0]
    for coefficient in _LOG_POLY[1:]:
        y = y * m + coefficient
    y = y * m * z
    e = F32(exponent)
    y = y + e * _LN2_LO - F32(0.5) * z
    return m + y + e * _LN2_HI


@numba.njit(inline="always", **JIT)
def _sin_cos(x):
    """(sin x, cos x) for float32 x in [0, 2 pi] (Cephes sinf/cosf with a shared reduction)."""
    octant = np.int32(x * _FOUR_OVER_PI)
    octant = octant + (octant & 1)  # round up to even: z lands in [-pi/4, pi/4]
    y = F32(octant)
    octant = octant & 7
    z = ((x - y * _DP1) - y * _DP2) - y * _DP3
    zz = z * z
    c = (((_COS_POLY[0] * zz + _COS_POLY[1]) * zz + _COS_POLY[2]) * zz * zz) - F32(0.5) * zz + F32(1.0)
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
    x0, x1, x2, x3 = philox(q, member, tensor_id, key0, key1)
    radius0 = np.sqrt(F32(-2.0) * _log(_uniform(x0)))
    radius1 = np.sqrt(F32(-2.0) * _log(_uniform(x2)))
    sin0, cos0 = _sin_cos(_TWO_PI * _uniform(x1))
    sin1, cos1 = _sin_cos(_TWO_PI * _uniform(x3))
    return radius0 * cos0, radius0 * sin0, radius1 * cos1, radius1 * sin1


@numba.njit(inline="always", **JIT)
def fill_normals(buffer, first_block, blocks, member, tensor_id, key0, key1):
    """buffer[4 b + k] = normal k of block first_block + b, for b < blocks."""
    for b in range(blocks):
        n0, n1, n2, n3 = _normals(U64(first_block + b), member, tensor_id, key0, key1)
        buffer[4 * b] = n0
        buffer[4 * b + 1] = n1
        buffer[4 * b + 2] = n2
        buffer[4 * b + 3] = n3


@numba.njit(inline="always", **JIT)
def fill_uniforms(buffer, first_block, blocks, stream, tensor_id, key0, key1):
    """buffer[4 b + k] = uniform of word k of block first_block + b (the stochastic-rounding stream)."""
    for b in range(blocks):
        x0, x1, x2, x3 = philox(U64(first_block + b), stream, tensor_id, key0, key1)
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



"""Triton twin of the noise contract in rng.py: Philox4x32-10, uniforms and Box–Muller normals inside kernels.

The math, word for word as in rng.py (the words must come out bit-identical):

    key     = (seed & 0xffffffff, seed >> 32)
    counter = (q & 0xffffffff, q >> 32, member, tensor_id),  q = i >> 2
    round   : (c0, c1, c2, c3) <- (hi(M1 c2) ^ c1 ^ k0, lo(M1 c2), hi(M0 c0) ^ c3 ^ k1, lo(M0 c0));  k += (W0, W1)
    u_k     = (x_k >> 8) * 2^-24 + 2^-25
    n0, n1  = sqrt(-2 ln u0) * (cos, sin)(2 pi u1);  n2, n3 likewise from (u2, u3);  eps(i) = n_(i & 3)

A tile owns BLOCK consecutive counters q and returns their 4 * BLOCK values already in element order
(element 4q + k takes word k), so every block's ten rounds run once and loads/stores stay contiguous.
This is our own Philox: tl.randn / tl.philox are not used because their conversions change between Triton versions.

Stream ids reach kernels as int32 bit patterns (`stream_args`, `int64_args`): Triton types a Python int argument
by its value (i32 / i64 / u64), so a raw seed that crossed 2^31 would compile a second kernel. Together with
`do_not_specialize` (no specialisation on a value of 1 or on divisibility by 16) a new seed never recompiles.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from copes_kernels import _validate as v

# The contract's constants by name (as cpu/numerics.py imports them): Triton reads module globals as compile-time
# constants; the values live once, in copes_kernels/rng.py.
from copes_kernels.rng import (
    MASK32,
    PHILOX_M0,
    PHILOX_M1,
    PHILOX_ROUNDS,
    PHILOX_W0,
    PHILOX_W1,
    UNIFORM_HALF_STEP,
    UNIFORM_SCALE,
    check_philox_inputs,
)

# Philox constants (all in [2^31, 2^32), so Triton types them uint32; they meet uint64 operands in the rounds).
_M0: tl.constexpr = tl.constexpr(PHILOX_M0)
_M1: tl.constexpr = tl.constexpr(PHILOX_M1)
_W0: tl.constexpr = tl.constexpr(PHILOX_W0)
_W1: tl.constexpr = tl.constexpr(PHILOX_W1)
_ROUNDS: tl.constexpr = tl.constexpr(PHILOX_ROUNDS)
_SCALE: tl.constexpr = tl.constexpr(UNIFORM_SCALE)
_HALF_STEP: tl.constexpr = tl.constexpr(UNIFORM_HALF_STEP)
# Box-Muller without libdevice (whose logf and sinf/cosf carry special-value and large-argument paths that
# uniforms in [2^-25, 1] never take):
# - ln u: libdevice's reduction u = 2^e * m, m in [2/3, 4/3), and its float32 polynomial in f = m - 1, with every
#   coefficient scaled by -2 (exact) so the radius's -2 ln u comes out directly:
#   -2 ln u = f * (f * P(f) - 2) - 2 e ln 2, P the scaled polynomial.
# - cos/sin(2 pi u): a reduction by half turns, u = k/2 + d with k = round(2u) (a magic-number add, no conversions)
#   and d in [-1/4, 1/4] exact, so cos(2 pi u) = (-1)^k cos(2 pi d) and sin likewise; the sign goes into the
#   radius. Minimax polynomials in d (fitted for this range): sin(2 pi d) = d * S(d^2), |error| < 1e-8;
#   cos(2 pi d) = 1 + d^2 C(d^2), |error| < 6e-8. No angle 2 pi u is ever rounded, so both are closer to the
#   exact contract than float32 cos(float32(2 pi u)) (bench/README.md, "GPU readiness").
_LOG_REDUCTION: tl.constexpr = tl.constexpr(0x3F2AAAAB)  # bits of 2/3: m = u / 2^e lands in [2/3, 4/3)
_EXPONENT_FIELD: tl.constexpr = tl.constexpr(-0x800000)  # 0xFF800000 as int32: sign and exponent bits
_MINUS_2_LN2_PER_EXPONENT_BIT: tl.constexpr = tl.constexpr(-2 * 0.693147182464599609375 * 2.0**-23)
# libdevice logf's P(f) coefficients (from f^8 down to f^0), each times -2.
_LOG_P8: tl.constexpr = tl.constexpr(0.2603771388530731)
_LOG_P7: tl.constexpr = tl.constexpr(-0.2816922068595886)
_LOG_P6: tl.constexpr = tl.constexpr(0.24297255277633667)
_LOG_P5: tl.constexpr = tl.constexpr(-0.2796122133731842)
_LOG_P4: tl.constexpr = tl.constexpr(0.3336847126483917)
_LOG_P3: tl.constexpr = tl.constexpr(-0.4002459943294525)
_LOG_P2: tl.constexpr = tl.constexpr(0.49999338388442993)
_LOG_P1: tl.constexpr = tl.constexpr(-0.666663646697998)
_ROUND_MAGIC: tl.constexpr = tl.constexpr(12582912.0)  # 1.5 * 2^23: x + magic rounds x to an integer in the low bits
_SIN_S4: tl.constexpr = tl.constexpr(39.7617301940918)
_SIN_S3: tl.constexpr = tl.constexpr(-76.58140563964844)
_SIN_S2: tl.constexpr = tl.constexpr(81.60248565673828)
_SIN_S1: tl.constexpr = tl.constexpr(-41.34168243408203)
_SIN_S0: tl.constexpr = tl.constexpr(6.2831854820251465)
_COS_C3: tl.constexpr = tl.constexpr(56.340843200683594)
_COS_C2: tl.constexpr = tl.constexpr(-85.2540283203125)
_COS_C1: tl.constexpr = tl.constexpr(64.93521881103516)
_COS_C0: tl.constexpr = tl.constexpr(-19.739181518554688)

# Counters per program on a GPU: 2048 elements, 16 per thread at 4 warps, enough independent work per thread to
# hide memory latency without spilling the Philox state.
GPU_NOISE_BLOCK = 512
# The CPU interpreter pays per program (every tl op is a numpy call), not per element: big tiles keep tests fast.
INTERPRETER_NOISE_BLOCK = 1 << 14
# Rows of `philox4x32_10` per program.
PHILOX_ROWS = 1024

# Kernel arguments that carry stream ids: never specialised on their value (see the module docstring).
STREAM_ARGS = ["seed_lo", "seed_hi", "member", "tensor_id", "offset_lo", "offset_hi"]


# ----------------------------------------------------------------------------------------------- jit helpers


@triton.jit
def philox_rounds(c0, c1, c2, c3, k0, k1):
    """Philox4x32-10 on uint32 words.

    Each 32x32-bit product is formed in 64 bits (one mul.wide.u32 on NVIDIA, both halves at once, where
    umulhi + a wrapping 32-bit multiply is two instructions) and then split; every sum that must wrap mod 2^32
    is likewise done in 64 bits and truncated, so Triton's integer-overflow sanitizer (on in the interpreter and
    under TRITON_DEBUG) has nothing to flag.
    """
    for _ in tl.static_range(_ROUNDS):
        p0 = c0.to(tl.uint64) * _M0
        p1 = c2.to(tl.uint64) * _M1
        c0 = (p1 >> 32).to(tl.uint32) ^ c1 ^ k0
        c1 = p1.to(tl.uint32)
        c2 = (p0 >> 32).to(tl.uint32) ^ c3 ^ k1
        c3 = p0.to(tl.uint32)
        k0 = (k0.to(tl.uint64) + _W0).to(tl.uint32)
        k1 = (k1.to(tl.uint64) + _W1).to(tl.uint32)
    return c0, c1, c2, c3


@triton.jit
def int64_from_words(lo, hi):
    """The int64 split by `int64_args` into two int32 bit patterns."""
    return (hi.to(tl.int64) << 32) | lo.to(tl.uint32).to(tl.int64)


@triton.jit
def philox_tile(first_block, seed_lo, seed_hi, member, tensor_id, BLOCK: tl.constexpr, STRIDE: tl.constexpr):
    """Words x0..x3 of counters q = first_block + STRIDE * [0, BLOCK) (first_block int64).

    The ids may be int32 bit patterns or int64 values: `.to(tl.uint32)` keeps their low 32 bits either way.
    """
    q = first_block + tl.arange(0, BLOCK).to(tl.int64) * STRIDE
    c0 = q.to(tl.uint32)
    c1 = (q >> 32).to(tl.uint32)
    c2 = tl.full([BLOCK], 0, tl.uint32) + member.to(tl.uint32)  # tl.full, a builtin (see counter_words)
    c3 = tl.full([BLOCK], 0, tl.uint32) + tensor_id.to(tl.uint32)
    return philox_rounds(c0, c1, c2, c3, seed_lo.to(tl.uint32), seed_hi.to(tl.uint32))


@triton.jit
def uniforms(x0, x1, x2, x3):
    """u_k = (x_k >> 8) * 2^-24 + 2^-25 in float32; the product is exact, so a fused multiply-add rounds the same."""
    return (
        (x0 >> 8).to(tl.float32) * _SCALE + _HALF_STEP,
        (x1 >> 8).to(tl.float32) * _SCALE + _HALF_STEP,
        (x2 >> 8).to(tl.float32) * _SCALE + _HALF_STEP,
        (x3 >> 8).to(tl.float32) * _SCALE + _HALF_STEP,
    )


@triton.jit
def counter_words(w0, w1, w2, w3):
    """[N] x 4 per-counter values -> [N, 4] (counter, word k): each counter's four words in one thread.

    tl.join + permute + reshape (builtins) rather than tl.interleave, a @triton.jit helper of triton.language: when
    triton is imported before TRITON_INTERPRET is set (transformers imports it), such helpers cannot run in the
    interpreter."""
    words = tl.join(tl.join(w0, w1), tl.join(w2, w3))  # [N, 2, 2]: (q, k & 1, k >> 1)
    return tl.reshape(tl.permute(words, (0, 2, 1)), [w0.shape[0], 4])


@triton.jit
def tile_mask(start, stop, tile_start, ALIGNED: tl.constexpr, VEC: tl.constexpr, BLOCK: tl.constexpr):
    """int32 lanes [0, 4 BLOCK) of the tile whose lane 0 is element `tile_start`, and the mask of the lanes inside
    [start, stop) (int64 scalars: the bounds are clamped once per program, so the per-lane compares are int32).

    ALIGNED is the host's promise that start <= tile_start and that stop - tile_start is a multiple of VEC (the
    lanes of one 128-bit access): the mask is then constant over each VEC lanes and loads/stores stay vectors.
    """
    lane = tl.arange(0, 4 * BLOCK)
    hi = tl.minimum(tl.maximum(stop - tile_start, 0), 4 * BLOCK).to(tl.int32)
    if ALIGNED:
        mask = lane < tl.multiple_of(hi, VEC)
    else:
        lo = tl.minimum(tl.maximum(start - tile_start, 0), 4 * BLOCK).to(tl.int32)
        mask = (lane >= lo) & (lane < hi)
    return lane, mask


@triton.jit
def run_tile(
    run_starts_ptr, run_stops_ptr, tiles_per_run, offset_lo, offset_hi, ALIGNED: tl.constexpr, VEC: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """The tile of program (selected run, tile) over runs of global bounds [start, stop): its run, first Philox
    block, the int64 index of its lane 0 inside the slice, and `tile_mask`'s lanes and mask. Shared by every noise
    kernel launched over runs; element `base + lane` of the slice is global element 4 * first_block + lane."""
    pid = tl.program_id(0)  # int32: a grid holds < 2^31 programs, and int32 division costs a fraction of int64's
    run = pid // tiles_per_run
    start = tl.load(run_starts_ptr + run)
    stop = tl.load(run_stops_ptr + run)
    first_block = (start >> 2) + (pid % tiles_per_run).to(tl.int64) * BLOCK
    lane, mask = tile_mask(start, stop, 4 * first_block, ALIGNED, VEC, BLOCK)
    base = 4 * first_block - int64_from_words(offset_lo, offset_hi)
    if ALIGNED:
        base = tl.multiple_of(base, VEC)
    return run, first_block, base, lane, mask


@triton.jit
def minus_2_log(u):
    """-2 ln u for float32 u in [2^-25, 1] (constants above; ~2 ulp)."""
    bits = u.to(tl.int32, bitcast=True)
    exponent_bits = (bits - _LOG_REDUCTION) & _EXPONENT_FIELD  # e * 2^23, e in [-25, 0]
    f = (bits - exponent_bits).to(tl.float32, bitcast=True) - 1.0
    # Tensor first in every product: constexpr * tensor stays a constexpr in the interpreter.
    p = ((((f * _LOG_P8 + _LOG_P7) * f + _LOG_P6) * f + _LOG_P5) * f + _LOG_P4) * f + _LOG_P3
    p = ((p * f + _LOG_P2) * f + _LOG_P1) * f + 1.0
    return f * (f * p - 2.0) + exponent_bits.to(tl.float32) * _MINUS_2_LN2_PER_EXPONENT_BIT


@triton.jit
def box_muller(u_radius, u_angle):
    """(n0, n1) = sqrt(-2 ln u_radius) * (cos, sin)(2 pi u_angle) (constants above)."""
    rounded = u_angle * 2.0 + _ROUND_MAGIC  # k = round(2 u) in the low mantissa bits
    d = u_angle - (rounded - _ROUND_MAGIC) * 0.5  # exact
    z = d * d
    radius = tl.sqrt(minus_2_log(u_radius))
    # (-1)^k: bit 0 of k, moved to the sign bit, flips the radius.
    sign = rounded.to(tl.uint32, bitcast=True) << 31
    signed = (radius.to(tl.uint32, bitcast=True) ^ sign).to(tl.float32, bitcast=True)
    cos = (((z * _COS_C3 + _COS_C2) * z + _COS_C1) * z + _COS_C0) * z + 1.0
    sin = ((((z * _SIN_S4 + _SIN_S3) * z + _SIN_S2) * z + _SIN_S1) * z + _SIN_S0) * d
    return signed * cos, signed * sin


@triton.jit
def _noise_words(first_block, seed_lo, seed_hi, member, tensor_id, BLOCK: tl.constexpr, STRIDE: tl.constexpr,
                 NORMAL: tl.constexpr):
    """[BLOCK, 4] eps (NORMAL) or u of counters first_block + STRIDE * [0, BLOCK)."""
    x0, x1, x2, x3 = philox_tile(first_block, seed_lo, seed_hi, member, tensor_id, BLOCK, STRIDE)
    u0, u1, u2, u3 = uniforms(x0, x1, x2, x3)
    if NORMAL:
        n0, n1 = box_muller(u0, u1)
        n2, n3 = box_muller(u2, u3)
        return counter_words(n0, n1, n2, n3)
    return counter_words(u0, u1, u2, u3)


@triton.jit
def _element_tile(first_block, seed_lo, seed_hi, member, tensor_id, BLOCK: tl.constexpr, PAIRED: tl.constexpr,
                  NORMAL: tl.constexpr):
    """Values of elements 4 * first_block + [0, 4 BLOCK) in element order (word i & 3 of counter i >> 2).

    PAIRED (aligned 16-bit storage: one 128-bit access holds 8 elements, two counters) computes the even and the
    odd counters as two tensors and interleaves them, so each thread owns two consecutive counters and the compiler
    needs no shared-memory shuffle to give the 8 elements of an access to one thread."""
    if PAIRED:
        even = _noise_words(first_block, seed_lo, seed_hi, member, tensor_id, BLOCK // 2, 2, NORMAL)
        odd = _noise_words(first_block + 1, seed_lo, seed_hi, member, tensor_id, BLOCK // 2, 2, NORMAL)
        return tl.reshape(tl.permute(tl.join(even, odd), (0, 2, 1)), [4 * BLOCK])  # [BLOCK/2, 2, 4]: (pair, odd, k)
    return tl.reshape(_noise_words(first_block, seed_lo, seed_hi, member, tensor_id, BLOCK, 1, NORMAL), [4 * BLOCK])


@triton.jit
def normal_tile(first_block, seed_lo, seed_hi, member, tensor_id, BLOCK: tl.constexpr, PAIRED: tl.constexpr):
    """eps of elements 4 * first_block + [0, 4 BLOCK), in element order, float32."""
    return _element_tile(first_block, seed_lo, seed_hi, member, tensor_id, BLOCK, PAIRED, True)


@triton.jit
def uniform_tile(first_block, seed_lo, seed_hi, member, tensor_id, BLOCK: tl.constexpr, PAIRED: tl.constexpr):
    """u of elements 4 * first_block + [0, 4 BLOCK), in element order (word i & 3 of block i >> 2)."""
    return _element_tile(first_block, seed_lo, seed_hi, member, tensor_id, BLOCK, PAIRED, False)


# ----------------------------------------------------------------------------------------------- kernels


@triton.jit
def _philox_kernel(counter_ptr, key_ptr, words_ptr, rows, BLOCK: tl.constexpr):
    pid = tl.program_id(0).to(tl.int64)
    row = pid * BLOCK + tl.arange(0, BLOCK).to(tl.int64)
    mask = row < rows
    c0 = tl.load(counter_ptr + 4 * row, mask=mask, other=0).to(tl.uint32)
    c1 = tl.load(counter_ptr + 4 * row + 1, mask=mask, other=0).to(tl.uint32)
    c2 = tl.load(counter_ptr + 4 * row + 2, mask=mask, other=0).to(tl.uint32)
    c3 = tl.load(counter_ptr + 4 * row + 3, mask=mask, other=0).to(tl.uint32)
    k0 = tl.load(key_ptr + 2 * row, mask=mask, other=0).to(tl.uint32)
    k1 = tl.load(key_ptr + 2 * row + 1, mask=mask, other=0).to(tl.uint32)
    x0, x1, x2, x3 = philox_rounds(c0, c1, c2, c3, k0, k1)
    # uint32 -> int64 zero-extends, so the words come back as their unsigned values.
    tl.store(words_ptr + 4 * row, x0.to(tl.int64), mask=mask)
    tl.store(words_ptr + 4 * row + 1, x1.to(tl.int64), mask=mask)
    tl.store(words_ptr + 4 * row + 2, x2.to(tl.int64), mask=mask)
    tl.store(words_ptr + 4 * row + 3, x3.to(tl.int64), mask=mask)


@triton.jit(do_not_specialize=STREAM_ARGS + ["n", "tiles_per_row"])
def _normal_rows_kernel(
    out_ptr, members_ptr, n, tiles_per_row, seed_lo, seed_hi, tensor_id, offset_lo, offset_hi, ALIGNED: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """Row r of out [rows, n] gets eps(offset), ..., eps(offset + n - 1) of member members[r]."""
    pid = tl.program_id(0)
    row = pid // tiles_per_row
    offset = int64_from_words(offset_lo, offset_hi)
    first_block = (offset >> 2) + (pid % tiles_per_row).to(tl.int64) * BLOCK
    lane, mask = tile_mask(offset, offset + n, 4 * first_block, ALIGNED, 4, BLOCK)
    base = row.to(tl.int64) * n + 4 * first_block - offset
    if ALIGNED:
        base = tl.multiple_of(base, 4)
    eps = normal_tile(first_block, seed_lo, seed_hi, tl.load(members_ptr + row), tensor_id, BLOCK, False)
    tl.store(out_ptr + base + lane, eps, mask=mask)


# ----------------------------------------------------------------------------------------------- host side


def int32_pattern(word: int) -> int:
    """A uint32 value as the int32 with the same bits (so Triton always types the argument i32)."""
    return word - (1 << 32) if word >= 1 << 31 else word


def stream_args(seed: int, member: int, tensor_id: int) -> tuple[int, int, int, int]:
    """(seed_lo, seed_hi, member, tensor_id) as int32 bit patterns."""
    seed = int(seed)
    return (
        int32_pattern(seed & MASK32),
        int32_pattern(seed >> 32),
        int32_pattern(int(member)),
        int32_pattern(int(tensor_id)),
    )


def int64_args(value: int) -> tuple[int, int]:
    """A non-negative int64 as (lo, hi) int32 bit patterns, rebuilt in-kernel by `int64_from_words`."""
    return int32_pattern(int(value) & MASK32), int32_pattern(int(value) >> 32)


def noise_block(device: torch.device) -> int:
    return INTERPRETER_NOISE_BLOCK if device.type == "cpu" else GPU_NOISE_BLOCK


def lanes_aligned(*elements: int, element_size: int, block: int) -> bool:
    """Whether every count of elements (offsets, sizes, chunk size), and a tile of `block` counters, is a whole number
    of 128-bit accesses: `tile_mask`'s ALIGNED promise, which keeps a kernel's loads and stores vectorised."""
    lanes = 16 // element_size
    return all(count % lanes == 0 for count in (*elements, 4 * block))


def blocks_spanned(length: int, *, aligned: bool) -> int:
    """Most Philox counters a run of `length` elements touches: one more when runs may start mid-block."""
    return -(-length // 4) if aligned else (length + 2) // 4 + 1


def fill_normal_rows_(
    out: torch.Tensor, members: torch.Tensor, *, seed: int, tensor_id: int, offset: int
) -> torch.Tensor:
    """out [rows, n] float32: row r = eps stream of member members[r] (int64 [rows]) from element `offset`."""
    rows, n = out.shape
    if rows == 0 or n == 0:
        return out
    block = noise_block(out.device)
    tiles_per_row = triton.cdiv(blocks_spanned(n, aligned=offset % 4 == 0), block)
    seed_lo, seed_hi, _, tensor_word = stream_args(seed, 0, tensor_id)
    _normal_rows_kernel[(rows * tiles_per_row,)](
        out, members, n, tiles_per_row, seed_lo, seed_hi, tensor_word, *int64_args(offset),
        ALIGNED=lanes_aligned(offset, n, element_size=4, block=block), BLOCK=block,
    )
    return out


def philox4x32_10(counter: torch.Tensor, key: torch.Tensor) -> torch.Tensor:
    """Philox4x32-10 on int64 tensors holding uint32 values: counter [..., 4], key [..., 2] -> words [..., 4]."""
    check_philox_inputs(counter, key)
    v.check_same_device("key", key, counter, "counter")
    lead = torch.broadcast_shapes(counter.shape[:-1], key.shape[:-1])
    counters = counter.expand(*lead, 4).reshape(-1, 4).contiguous()
    keys = key.expand(*lead, 2).reshape(-1, 2).contiguous()
    words = torch.empty_like(counters)
    rows = counters.shape[0]
    if rows:
        _philox_kernel[(triton.cdiv(rows, PHILOX_ROWS),)](counters, keys, words, rows, BLOCK=PHILOX_ROWS)
    return words.view(*lead, 4)


def normal(
    n: int, *, seed: int, member: int, tensor_id: int, offset: int = 0, device: torch.device | str | None = None
) -> torch.Tensor:
    v.check_normal_args(n, seed=seed, member=member, tensor_id=tensor_id, offset=offset)
    device = torch.device("cpu") if device is None else torch.device(device)
    out = torch.empty(1, n, dtype=torch.float32, device=device)
    members = torch.tensor([int(member)], dtype=torch.int64, device=device)
    return fill_normal_rows_(out, members, seed=seed, tensor_id=tensor_id, offset=offset).view(n)

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
from copes_kernels.rng import (
    MASK32,
    PHILOX_M0,
    PHILOX_M1,
    PHILOX_ROUNDS,
    PHILOX_W0,
    PHILOX_W1,
    TWO_PI,
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
_TWO_PI: tl.constexpr = tl.constexpr(TWO_PI)
# sincos: angles lie in (0, 2 pi], so one Cody-Waite reduction by pi/2 (three parts, each product k * part exact
# for k <= 4) and Cephes' float32 minimax polynomials on [-pi/4, pi/4] give cos and sin together (~1 ulp), with
# none of libdevice's large-argument (Payne-Hanek) paths and one reduction instead of two.
_TWO_OVER_PI: tl.constexpr = tl.constexpr(0.636619772367581343)
_PIO2_HI: tl.constexpr = tl.constexpr(1.5703125)
_PIO2_MID: tl.constexpr = tl.constexpr(4.837512969970703125e-4)
_PIO2_LO: tl.constexpr = tl.constexpr(7.54978995489188216e-8)
_SIN1: tl.constexpr = tl.constexpr(-1.6666654611e-1)
_SIN2: tl.constexpr = tl.constexpr(8.3321608736e-3)
_SIN3: tl.constexpr = tl.constexpr(-1.9515295891e-4)
_COS1: tl.constexpr = tl.constexpr(4.166664568298827e-2)
_COS2: tl.constexpr = tl.constexpr(-1.388731625493765e-3)
_COS3: tl.constexpr = tl.constexpr(2.443315711809948e-5)

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
def philox_tile(first_block, seed_lo, seed_hi, member, tensor_id, BLOCK: tl.constexpr):
    """Words x0..x3 of counters q = first_block + [0, BLOCK) (first_block int64).

    The ids may be int32 bit patterns or int64 values: `.to(tl.uint32)` keeps their low 32 bits either way.
    """
    q = first_block + tl.arange(0, BLOCK).to(tl.int64)
    c0 = q.to(tl.uint32)
    c1 = (q >> 32).to(tl.uint32)
    c2 = tl.full([BLOCK], 0, tl.uint32) + member.to(tl.uint32)  # tl.full, a builtin (see in_element_order)
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
def in_element_order(w0, w1, w2, w3):
    """[BLOCK] x 4 per-counter values -> [4 BLOCK] with element 4q + k holding w_k.

    tl.join + reshape (builtins) rather than tl.interleave, a @triton.jit helper of triton.language: when triton is
    imported before TRITON_INTERPRET is set (transformers imports it), such helpers cannot run in the interpreter."""
    pairs02 = tl.join(w0, w2)  # [BLOCK, 2]
    pairs13 = tl.join(w1, w3)
    return tl.reshape(tl.join(pairs02, pairs13), [4 * w0.shape[0]])  # [BLOCK, 2, 2]: (q, k & 1, k >> 1)


@triton.jit
def run_tile(run_starts_ptr, run_stops_ptr, tiles_per_run, offset_lo, offset_hi, BLOCK: tl.constexpr):
    """The tile of program (selected run, tile): its first Philox block, element indices local to the slice, and the
    mask of elements inside the run's global bounds [start, stop). Shared by every noise kernel launched over runs."""
    pid = tl.program_id(0).to(tl.int64)
    run = pid // tiles_per_run
    tile = pid % tiles_per_run
    start = tl.load(run_starts_ptr + run)
    stop = tl.load(run_stops_ptr + run)
    first_block = (start >> 2) + tile * BLOCK
    element = 4 * first_block + tl.arange(0, 4 * BLOCK).to(tl.int64)
    mask = (element >= start) & (element < stop)
    return run, first_block, element - int64_from_words(offset_lo, offset_hi), mask


@triton.jit
def sincos(angle):
    """(cos, sin) of float32 angles in [0, 2 pi] with one shared range reduction (constants above)."""
    quadrant = (angle * _TWO_OVER_PI + 0.5).to(tl.int32)  # round to nearest: angle >= 0
    k = quadrant.to(tl.float32)
    r = angle - k * _PIO2_HI
    r = r - k * _PIO2_MID
    r = r - k * _PIO2_LO
    r2 = r * r
    s = r + r * r2 * (_SIN1 + r2 * (_SIN2 + r2 * _SIN3))
    c = 1.0 - 0.5 * r2 + r2 * r2 * (_COS1 + r2 * (_COS2 + r2 * _COS3))
    q = quadrant & 3
    swap = (q & 1) == 1
    cos_r = tl.where(swap, s, c)
    sin_r = tl.where(swap, c, s)
    cos = tl.where((q == 1) | (q == 2), -cos_r, cos_r)
    sin = tl.where(q >= 2, -sin_r, sin_r)
    return cos, sin


@triton.jit
def normal_tile(first_block, seed_lo, seed_hi, member, tensor_id, BLOCK: tl.constexpr):
    """eps of elements 4 * first_block + [0, 4 BLOCK), in element order, float32."""
    x0, x1, x2, x3 = philox_tile(first_block, seed_lo, seed_hi, member, tensor_id, BLOCK)
    u0, u1, u2, u3 = uniforms(x0, x1, x2, x3)
    radius01 = tl.sqrt_rn(-2.0 * tl.log(u0))
    radius23 = tl.sqrt_rn(-2.0 * tl.log(u2))
    cos01, sin01 = sincos(u1 * _TWO_PI)  # tensor first: constexpr * tensor stays a constexpr in the interpreter
    cos23, sin23 = sincos(u3 * _TWO_PI)
    return in_element_order(radius01 * cos01, radius01 * sin01, radius23 * cos23, radius23 * sin23)


@triton.jit
def uniform_tile(first_block, seed_lo, seed_hi, member, tensor_id, BLOCK: tl.constexpr):
    """u of elements 4 * first_block + [0, 4 BLOCK), in element order (word i & 3 of block i >> 2)."""
    x0, x1, x2, x3 = philox_tile(first_block, seed_lo, seed_hi, member, tensor_id, BLOCK)
    u0, u1, u2, u3 = uniforms(x0, x1, x2, x3)
    return in_element_order(u0, u1, u2, u3)


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


@triton.jit(do_not_specialize=STREAM_ARGS)
def _normal_rows_kernel(
    out_ptr, members_ptr, n, tiles_per_row, seed_lo, seed_hi, tensor_id, offset_lo, offset_hi, BLOCK: tl.constexpr
):
    """Row r of out [rows, n] gets eps(offset), ..., eps(offset + n - 1) of member members[r]."""
    pid = tl.program_id(0).to(tl.int64)
    row = pid // tiles_per_row
    tile = pid % tiles_per_row
    offset = int64_from_words(offset_lo, offset_hi)
    member = tl.load(members_ptr + row)
    first_block = (offset >> 2) + tile * BLOCK
    local = 4 * first_block + tl.arange(0, 4 * BLOCK).to(tl.int64) - offset
    eps = normal_tile(first_block, seed_lo, seed_hi, member, tensor_id, BLOCK)
    tl.store(out_ptr + row * n + local, eps, mask=(local >= 0) & (local < n))


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
        out, members, n, tiles_per_row, seed_lo, seed_hi, tensor_word, *int64_args(offset), BLOCK=block
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

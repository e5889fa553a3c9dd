"""The Triton helpers the kernel files share beyond the noise (rng.py here): how a float32 result is stored.
The kernel files (perturb, update, lowrank) import from here, rng, _validate and partition, never from
each other; like them, this module loads only when a Triton op first runs (TRITON_INTERPRET is set by then).

    to_storage          float32 -> storage dtype, round to nearest even, the same bits as torch on every backend
    round_stochastic    float32 -> 16-bit storage, unbiased stochastic rounding (jit)
    store_stochastic_   launcher: store float32 values into 16-bit storage with stochastic rounding
    noise_tiles_per_run tile sizes for noise kernels over runs of selected chunks
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from copes_kernels.backends.triton.rng import (
    STREAM_ARGS,
    blocks_spanned,
    int64_args,
    int64_from_words,
    lanes_aligned,
    noise_block,
    stream_args,
    tile_mask,
    uniform_tile,
)
from copes_kernels.rng import ROUNDING_STREAM

# bfloat16 quiet NaN, the pattern torch's scalar path stores for any NaN.
_BF16_NAN: tl.constexpr = tl.constexpr(0x7FC0)
# Triton's CPU interpreter truncates float32 -> bfloat16; GPUs round to nearest even in one instruction per pair
# (decided when the kernels are defined, as triton.jit decides between the interpreter and the compiler).
_TRUNCATING_BF16_CAST: tl.constexpr = tl.constexpr(triton.knobs.runtime.interpret)
ROUNDING_STREAM_WORD: tl.constexpr = tl.constexpr(ROUNDING_STREAM)
# Bit pattern of the smallest negative subnormal (0x8001) as an int16: the neighbour of -0.0 away from zero.
_NEGATIVE_TINY: tl.constexpr = tl.constexpr(-0x7FFF)


@triton.jit
def to_storage(x, DTYPE: tl.constexpr):
    """float32 -> storage dtype with round-to-nearest-even, the same bits as torch for every number.

    Where the cast truncates (the interpreter), bfloat16 is rounded on the bits: add 0x7FFF plus the kept lowest
    bit, drop 16 bits (a NaN, which the add could carry into the sign, is replaced first). A NaN stays a NaN; its
    bits follow the backend (torch's own CPU and CUDA paths differ there too).
    """
    if DTYPE == tl.bfloat16 and _TRUNCATING_BF16_CAST:
        bits = tl.where(x != x, _BF16_NAN << 16, x.to(tl.uint32, bitcast=True))
        return ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True)
    else:
        return x.to(DTYPE)


@triton.jit
def round_stochastic(values, uniforms, DTYPE: tl.constexpr):
    """float32 -> DTYPE (16-bit): the nearest value, or its neighbour towards `values` with probability |error| / gap.

    In the int16 view of a 16-bit float, +1 moves away from zero for either sign, which finds the neighbour.
    """
    nearest = to_storage(values, DTYPE)
    nearest_f = nearest.to(tl.float32)
    error = values - nearest_f
    bits = nearest.to(tl.int16, bitcast=True).to(tl.int32)
    step = tl.where((error > 0) == (nearest_f > 0), 1, -1)
    neighbour_bits = tl.where(nearest_f == 0, tl.where(error > 0, 1, _NEGATIVE_TINY), bits + step)
    neighbour = neighbour_bits.to(tl.int16).to(DTYPE, bitcast=True)
    gap = tl.abs(neighbour.to(tl.float32) - nearest_f)
    take_neighbour = (error != 0) & (uniforms * gap < tl.abs(error))
    return tl.where(take_neighbour, neighbour, nearest)


@triton.jit(do_not_specialize=STREAM_ARGS + ["n"])
def _store_stochastic_kernel(
    dst_ptr, values_ptr, n, seed_lo, seed_hi, tensor_id, offset_lo, offset_hi, ALIGNED: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """dst[i] = round_stochastic(values[i]) with the uniforms of element offset + i; BLOCK counters per program."""
    offset = int64_from_words(offset_lo, offset_hi)
    first_block = (offset >> 2) + tl.program_id(0).to(tl.int64) * BLOCK
    lane, mask = tile_mask(offset, offset + n, 4 * first_block, ALIGNED, 8, BLOCK)  # 8 16-bit elements per access
    base = 4 * first_block - offset
    if ALIGNED:
        base = tl.multiple_of(base, 8)
    rounding_stream = tl.full((), ROUNDING_STREAM_WORD, tl.uint32)
    u = uniform_tile(first_block, seed_lo, seed_hi, rounding_stream, tensor_id, BLOCK, True)
    values = tl.load(values_ptr + base + lane, mask=mask)
    tl.store(dst_ptr + base + lane, round_stochastic(values, u, dst_ptr.dtype.element_ty), mask=mask)


def noise_tiles_per_run(longest: int, *, offset: int, chunk_size: int, device: torch.device) -> tuple[int, int]:
    """(tiles per run, counters per tile) for noise kernels over runs of at most `longest` elements.

    On a GPU the tile is one fixed BLOCK, so no tensor or run size compiles another kernel. The CPU interpreter
    compiles nothing and pays per element, so there short runs get a smaller power-of-two tile (at least the two
    counters a paired 16-bit tile splits into even and odd).
    """
    aligned = offset % 4 == 0 and chunk_size % 4 == 0  # then every run starts on a Philox block boundary
    counters = blocks_spanned(longest, aligned=aligned)
    block = noise_block(device)
    if device.type == "cpu":
        block = min(block, triton.next_power_of_2(max(counters, 2)))
    return triton.cdiv(counters, block), block


def store_stochastic_(
    dst: torch.Tensor, values: torch.Tensor, *, seed: int, tensor_id: int, offset: int = 0
) -> torch.Tensor:
    """Store float32 `values` into 16-bit `dst` (same numel, contiguous) with unbiased stochastic rounding."""
    if values.dtype != torch.float32 or values.numel() != dst.numel() or not values.is_contiguous():
        raise ValueError(
            f"values must be contiguous float32 with {dst.numel()} elements, got {values.dtype} {tuple(values.shape)}"
        )
    n = dst.numel()
    if n:
        seed_lo, seed_hi, _, tensor_word = stream_args(seed, 0, tensor_id)
        block = noise_block(dst.device)
        programs = triton.cdiv(n + offset % 4, 4 * block)  # tiles start on the Philox block of element `offset`
        _store_stochastic_kernel[(programs,)](
            dst, values, n, seed_lo, seed_hi, tensor_word, *int64_args(offset),
            ALIGNED=lanes_aligned(offset, n, element_size=dst.element_size(), block=block), BLOCK=block,
        )
    return dst

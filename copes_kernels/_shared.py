"""The Triton helpers the kernel files share beyond the noise (triton_rng): how a float32 result is stored.
The kernel files (perturb, update, lowrank) import from here, triton_rng, _validate and partition, never from
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

from copes_kernels.rng import ROUNDING_STREAM
from copes_kernels.triton_rng import (
    STREAM_ARGS,
    blocks_spanned,
    int64_args,
    int64_from_words,
    noise_block,
    stream_args,
    uniform_tile,
)

# bfloat16 quiet NaN, the pattern torch stores for any NaN.
_BF16_NAN: tl.constexpr = tl.constexpr(0x7FC0)
ROUNDING_STREAM_WORD: tl.constexpr = tl.constexpr(ROUNDING_STREAM)
# Bit pattern of the smallest negative subnormal (0x8001) as an int16: the neighbour of -0.0 away from zero.
_NEGATIVE_TINY: tl.constexpr = tl.constexpr(-0x7FFF)


@triton.jit
def to_storage(x, DTYPE: tl.constexpr):
    """float32 -> storage dtype with round-to-nearest-even, the same bits as torch on every backend.

    bfloat16 is rounded on the bits (add 0x7FFF plus the kept lowest bit, drop 16 bits): GPUs round this way
    anyway, but Triton's CPU interpreter truncates float32 -> bfloat16.
    """
    if DTYPE == tl.bfloat16:
        bits = x.to(tl.uint32, bitcast=True).to(tl.int64)
        rounded = tl.where(x != x, _BF16_NAN, (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16)
        return rounded.to(tl.uint16).to(tl.bfloat16, bitcast=True)
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


@triton.jit(do_not_specialize=STREAM_ARGS)
def _store_stochastic_kernel(
    dst_ptr, values_ptr, n, seed_lo, seed_hi, tensor_id, offset_lo, offset_hi, BLOCK: tl.constexpr
):
    """dst[i] = round_stochastic(values[i]) with the uniforms of element offset + i."""
    pid = tl.program_id(0).to(tl.int64)
    offset = int64_from_words(offset_lo, offset_hi)
    first_block = (offset >> 2) + pid * (BLOCK // 4)
    local = 4 * first_block + tl.arange(0, BLOCK).to(tl.int64) - offset
    mask = (local >= 0) & (local < n)
    u = uniform_tile(first_block, seed_lo, seed_hi, tl.full((), ROUNDING_STREAM_WORD, tl.uint32), tensor_id, BLOCK // 4)
    values = tl.load(values_ptr + local, mask=mask)
    tl.store(dst_ptr + local, round_stochastic(values, u, dst_ptr.dtype.element_ty), mask=mask)


def noise_tiles_per_run(longest: int, *, offset: int, chunk_size: int, device: torch.device) -> tuple[int, int]:
    """(tiles per run, counters per tile) for noise kernels over runs of at most `longest` elements.

    On a GPU the tile is one fixed BLOCK, so no tensor or run size compiles another kernel. The CPU interpreter
    compiles nothing and pays per element, so there short runs get a smaller power-of-two tile.
    """
    aligned = offset % 4 == 0 and chunk_size % 4 == 0  # then every run starts on a Philox block boundary
    counters = blocks_spanned(longest, aligned=aligned)
    block = noise_block(device)
    if device.type == "cpu":
        block = min(block, triton.next_power_of_2(max(counters, 1)))
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
        block = 4 * noise_block(dst.device)  # elements per program: one noise tile of counters
        programs = triton.cdiv(n + offset % 4, block)  # tiles start on the Philox block of element `offset`
        _store_stochastic_kernel[(programs,)](
            dst, values, n, seed_lo, seed_hi, tensor_word, *int64_args(offset), BLOCK=block
        )
    return dst

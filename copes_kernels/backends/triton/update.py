"""Fused ES update: the reward-weighted sum of regenerated noise, added to the weights in one pass.

    target[i] += sum_j coeffs[j] * [subspace(chunk(i)) == member_subspaces[j]] * eps_j(offset + i)

Members are sorted by subspace, so those of subspace k sit in one segment [lo_k, hi_k). The launch covers the
chunks whose subspace has members (one tile of one chunk per program); a tile loads target once, loops over only
its own segment regenerating each member's noise into a float32 accumulator, and stores once. The noise is never
materialised and a tile never generates noise for a member of another subspace. Each member's noise is keyed by
its own row (member, key word 0, key word 1): one seed per step and one seed per member cost the same.

Stochastic rounding (bfloat16 / float16 targets) rounds the float32 result to one of its two neighbours in the
storage dtype, the far one with probability |error| / gap, driven by uniforms of the ROUNDING_STREAM words
(word i & 3 of block i >> 2, keyed by the rounding seed and tensor_id) -- the same rule and the same uniforms as the
reference's `round_stochastic`, so the expected stored value is the exact float32 sum.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from copes_kernels import _public_ops as ops
from copes_kernels import _validate as v
from copes_kernels.backends.triton.rng import (
    STREAM_ARGS,
    int64_args,
    lanes_aligned,
    normal_tile,
    run_tile,
    stream_args,
    uniform_tile,
)
from copes_kernels.backends.triton.shared import ROUNDING_STREAM_WORD, noise_tiles_per_run, round_stochastic, to_storage
from copes_kernels.partition import chunk_runs, chunk_span


@triton.jit(do_not_specialize=STREAM_ARGS + ["tiles_per_run"])
def _accumulate_kernel(
    target_ptr,
    run_starts_ptr,
    run_stops_ptr,
    run_first_member_ptr,
    run_end_member_ptr,
    streams_ptr,
    coeffs_ptr,
    tiles_per_run,
    seed_lo,
    seed_hi,
    tensor_id,
    offset_lo,
    offset_hi,
    STOCHASTIC: tl.constexpr,
    ALIGNED: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """Program = (run, tile of BLOCK counters); run r adds the members [first_member[r], end_member[r]), member j
    under its own key: streams[j] = (member, key word 0, key word 1). (seed_lo, seed_hi) keys the rounding."""
    lanes: tl.constexpr = 128 // target_ptr.dtype.element_ty.primitive_bitwidth  # elements per 128-bit access
    run, first_block, base, lane, mask = run_tile(
        run_starts_ptr, run_stops_ptr, tiles_per_run, offset_lo, offset_hi, ALIGNED, lanes, BLOCK
    )
    tile_ptr = target_ptr + base
    paired: tl.constexpr = ALIGNED and lanes == 8  # see rng._element_tile
    total = tl.load(tile_ptr + lane, mask=mask).to(tl.float32)
    for j in range(tl.load(run_first_member_ptr + run), tl.load(run_end_member_ptr + run)):
        stream = streams_ptr + 3 * j
        eps = normal_tile(first_block, tl.load(stream + 1), tl.load(stream + 2), tl.load(stream), tensor_id, BLOCK,
                          paired)
        total += tl.load(coeffs_ptr + j) * eps
    if STOCHASTIC:
        rounding_stream = tl.full((), ROUNDING_STREAM_WORD, tl.uint32)
        u = uniform_tile(first_block, seed_lo, seed_hi, rounding_stream, tensor_id, BLOCK, paired)
        tl.store(tile_ptr + lane, round_stochastic(total, u, target_ptr.dtype.element_ty), mask=mask)
    else:
        tl.store(tile_ptr + lane, to_storage(total, target_ptr.dtype.element_ty), mask=mask)


# ----------------------------------------------------------------------------------------------- host side


def _member_segments(
    target: torch.Tensor,
    plan: v.AccumulatePlan,
    *,
    offset: int,
    chunk_subspace: torch.Tensor | None,
    chunk_size: int,
) -> tuple[torch.Tensor, ...]:
    """(run starts, run stops, first member, end member, member streams, coeffs), members sorted by subspace.

    Runs are the chunks of the slice whose subspace owns at least one member (the whole slice without a partition).
    """
    numel, device, count = target.numel(), target.device, plan.streams.shape[0]
    if chunk_subspace is None:
        bounds = torch.tensor([[offset], [offset + numel], [0], [count]], dtype=torch.int64, device=device)
        return (*bounds, plan.streams.contiguous(), plan.coeffs)
    order = torch.argsort(plan.subspaces, stable=True)
    sorted_subspaces = plan.subspaces[order].contiguous()
    first, last = chunk_span(numel, offset=offset, chunk_size=chunk_size)
    chunk_owner = chunk_subspace[first : last + 1].to(torch.int64)
    first_member = torch.searchsorted(sorted_subspaces, chunk_owner, right=False)
    end_member = torch.searchsorted(sorted_subspaces, chunk_owner, right=True)
    updated = torch.nonzero(end_member > first_member).view(-1)  # the host sync that sizes the launch
    starts, stops = chunk_runs(updated + first, numel=numel, offset=offset, chunk_size=chunk_size)
    return (starts, stops, first_member[updated], end_member[updated], plan.streams[order].contiguous(),
            plan.coeffs[order])


@ops.accumulate_op
def accumulate_(target, plan, tensor_id, offset, chunk_subspace, chunk_size, rounding) -> None:
    """a tile regenerates the noise of its subspace's members only, each under its own key."""
    if target.numel() == 0 or plan.streams.shape[0] == 0:
        return
    starts, stops, first_member, end_member, sorted_streams, sorted_coeffs = _member_segments(
        target, plan, offset=offset, chunk_subspace=chunk_subspace, chunk_size=chunk_size,
    )
    longest = target.numel() if chunk_subspace is None else min(chunk_size, target.numel())
    tiles, block = noise_tiles_per_run(longest, offset=offset, chunk_size=chunk_size, device=target.device)
    if starts.numel():
        seed_lo, seed_hi, _, tensor_word = stream_args(plan.rounding_seed, 0, tensor_id)
        _accumulate_kernel[(starts.numel() * tiles,)](
            target, starts, stops, first_member, end_member, sorted_streams, sorted_coeffs, tiles,
            seed_lo, seed_hi, tensor_word, *int64_args(offset), STOCHASTIC=rounding == "stochastic",
            ALIGNED=lanes_aligned(offset, target.numel(), chunk_size, element_size=target.element_size(), block=block),
            BLOCK=block,
        )

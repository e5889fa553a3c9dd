"""Fused ES update: the reward-weighted sum of regenerated noise, added to the weights in one pass.

    target[i] += sum_j coeffs[j] * [subspace(chunk(i)) == member_subspaces[j]] * eps_j(offset + i)

Members are sorted by subspace, so those of subspace k sit in one segment [lo_k, hi_k). The launch covers the
chunks whose subspace has members (one tile of one chunk per program); a tile loads target once, loops over only
its own segment regenerating each member's noise into a float32 accumulator, and stores once. The noise is never
materialised and a tile never generates noise for a member of another subspace.

Stochastic rounding (bfloat16 / float16 targets) rounds the float32 result to one of its two neighbours in the
storage dtype, the far one with probability |error| / gap, driven by uniforms of the ROUNDING_STREAM words
(word i & 3 of block i >> 2, keyed by seed and tensor_id) -- the same rule and the same uniforms as the
reference's `round_stochastic`, so the expected stored value is the exact float32 sum.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import triton
import triton.language as tl

from copes_kernels import _validate as v
from copes_kernels._shared import ROUNDING_STREAM_WORD, noise_tiles_per_run, round_stochastic, to_storage
from copes_kernels.partition import DEFAULT_CHUNK_SIZE, chunk_runs, chunk_span
from copes_kernels.triton_rng import (
    STREAM_ARGS,
    int64_args,
    lanes_aligned,
    normal_tile,
    run_tile,
    stream_args,
    uniform_tile,
)

@triton.jit(do_not_specialize=STREAM_ARGS + ["tiles_per_run"])
def _accumulate_kernel(
    target_ptr,
    run_starts_ptr,
    run_stops_ptr,
    run_first_member_ptr,
    run_end_member_ptr,
    members_ptr,
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
    """Program = (run, tile of BLOCK counters); run r adds the members [first_member[r], end_member[r])."""
    lanes: tl.constexpr = 128 // target_ptr.dtype.element_ty.primitive_bitwidth  # elements per 128-bit access
    run, first_block, base, lane, mask = run_tile(
        run_starts_ptr, run_stops_ptr, tiles_per_run, offset_lo, offset_hi, ALIGNED, lanes, BLOCK
    )
    tile_ptr = target_ptr + base
    paired: tl.constexpr = ALIGNED and lanes == 8  # see triton_rng._element_tile
    total = tl.load(tile_ptr + lane, mask=mask).to(tl.float32)
    for j in range(tl.load(run_first_member_ptr + run), tl.load(run_end_member_ptr + run)):
        eps = normal_tile(first_block, seed_lo, seed_hi, tl.load(members_ptr + j), tensor_id, BLOCK, paired)
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
    members: torch.Tensor,
    coeffs: torch.Tensor,
    *,
    offset: int,
    chunk_subspace: torch.Tensor | None,
    member_subspaces: torch.Tensor | None,
    chunk_size: int,
) -> tuple[torch.Tensor, ...]:
    """(run starts, run stops, first member, end member, members, coeffs), members sorted by subspace.

    Runs are the chunks of the slice whose subspace owns at least one member (the whole slice without a partition).
    """
    numel, device = target.numel(), target.device
    if chunk_subspace is None:
        bounds = torch.tensor([[offset], [offset + numel], [0], [members.numel()]], dtype=torch.int64, device=device)
        return (*bounds, members, coeffs)
    order = torch.argsort(member_subspaces, stable=True)
    sorted_subspaces = member_subspaces[order].contiguous()
    first, last = chunk_span(numel, offset=offset, chunk_size=chunk_size)
    chunk_owner = chunk_subspace[first : last + 1].to(torch.int64)
    first_member = torch.searchsorted(sorted_subspaces, chunk_owner, right=False)
    end_member = torch.searchsorted(sorted_subspaces, chunk_owner, right=True)
    updated = torch.nonzero(end_member > first_member).view(-1)  # the host sync that sizes the launch
    starts, stops = chunk_runs(updated + first, numel=numel, offset=offset, chunk_size=chunk_size)
    return starts, stops, first_member[updated], end_member[updated], members[order], coeffs[order]


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
    starts, stops, first_member, end_member, sorted_members, sorted_coeffs = _member_segments(
        target, members_t, coeffs_t, offset=offset, chunk_subspace=chunk_subspace, member_subspaces=subspaces_t,
        chunk_size=chunk_size,
    )
    longest = target.numel() if chunk_subspace is None else min(chunk_size, target.numel())
    tiles, block = noise_tiles_per_run(longest, offset=offset, chunk_size=chunk_size, device=target.device)
    if starts.numel():
        seed_lo, seed_hi, _, tensor_word = stream_args(seed, 0, tensor_id)
        _accumulate_kernel[(starts.numel() * tiles,)](
            target, starts, stops, first_member, end_member, sorted_members, sorted_coeffs, tiles,
            seed_lo, seed_hi, tensor_word, *int64_args(offset), STOCHASTIC=rounding == "stochastic",
            ALIGNED=lanes_aligned(offset, target.numel(), chunk_size, element_size=target.element_size(), block=block),
            BLOCK=block,
        )
    return target

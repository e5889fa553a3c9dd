"""The reference per-tensor ops, in pure torch: the test oracle of the compiled backends (and the CPU fallback).

The public signatures, docstrings and argument checks are `copes_kernels._public_ops`' (shared with the compiled
backends; `ck.normal` etc. wrap these functions). Tolerances between backends: the Philox words are bit-identical
everywhere; the normals agree within 2e-6 (compiled CPU) and 1e-5 (Triton on a GPU) of this reference, not
bitwise, so a written element is within one storage ulp plus |scale| times that. Within one backend every op is
deterministic to the bit.

Noise is regenerated per run of selected chunks in tiles of at most `NOISE_TILE` elements, so no op ever holds a
full-size noise tensor. All math is float32 with one cast at the store.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from copes_kernels import _public_ops as ops
from copes_kernels import _validate as v
from copes_kernels.partition import selected_runs

# philox4x32_10 is re-exported as the reference twin of the Triton op: the contract itself is the reference.
from copes_kernels.rng import ROUNDING_STREAM, normal_stream, philox4x32_10, philox_blocks, words_to_uniform  # noqa: F401

# 1M elements: the int64 Philox temporaries of one tile stay near 40 MB, and per-tile Python overhead is negligible.
NOISE_TILE = 1 << 20


def _tiles(start: int, stop: int):
    for tile_start in range(start, stop, NOISE_TILE):
        yield tile_start, min(tile_start + NOISE_TILE, stop)


def uniform_stream(n: int, *, seed: int, stream: int, tensor_id: int, offset: int, device) -> torch.Tensor:
    """Per-element float32 uniforms u(offset .. offset + n - 1): word i & 3 of Philox block i >> 2."""
    first, last = offset >> 2, (offset + n - 1) >> 2
    words = philox_blocks(first, last - first + 1, seed=seed, member=stream, tensor_id=tensor_id, device=device)
    start = offset - 4 * first
    return words_to_uniform(words).reshape(-1)[start : start + n]


def round_stochastic(values: torch.Tensor, dtype: torch.dtype, uniforms: torch.Tensor) -> torch.Tensor:
    """Round float32 `values` to a 16-bit float `dtype`, up or down with probabilities that make it unbiased.

    The result is the nearest representable value or its neighbour one ulp towards `values`, the neighbour chosen
    with probability |error| / ulp, so E[result] = values exactly (up to overflow).
    """
    nearest = values.to(dtype)
    nearest_f = nearest.float()
    error = values - nearest_f
    bits = nearest.view(torch.int16).to(torch.int32)
    # In 16-bit sign-magnitude, +1 on the bit pattern moves away from zero for both signs (int16 view).
    step = torch.where((error > 0) == (nearest_f > 0), 1, -1)
    neighbour_bits = torch.where(nearest_f == 0, torch.where(error > 0, 0x0001, -0x7FFF), bits + step)
    neighbour = neighbour_bits.to(torch.int16).view(dtype)
    gap = (neighbour.float() - nearest_f).abs()
    take_neighbour = (error != 0) & (uniforms * gap < error.abs())
    return torch.where(take_neighbour, neighbour, nearest)


def _store(
    dst: torch.Tensor, values: torch.Tensor, *, rounding: str, seed: int, tensor_id: int, offset: int
) -> None:
    if rounding == "stochastic":
        u = uniform_stream(
            values.numel(), seed=seed, stream=ROUNDING_STREAM, tensor_id=tensor_id, offset=offset, device=values.device
        )
        dst.copy_(round_stochastic(values, dst.dtype, u))
    else:
        dst.copy_(values)


def normal(
    n: int, *, seed: int, member: int, tensor_id: int, offset: int = 0, device: torch.device | str | None = None
) -> torch.Tensor:
    """eps(offset), ..., eps(offset + n - 1) of the stream (seed, member, tensor_id): float32 on `device`.

    The noise every op adds, materialised: element i of a parameter gets eps(i) whichever op, backend, rank or
    chunking touches it (docs/noise-contract.md). `seed` is a uint64, `member` and `tensor_id` are uint32.
    """
    v.check_normal_args(n, seed=seed, member=member, tensor_id=tensor_id, offset=offset)
    return normal_stream(n, seed=seed, member=member, tensor_id=tensor_id, offset=offset, device=device)


@ops.perturb_op
def perturb_(dst, src, seed, member, tensor_id, sigma, offset, chunk_subspace, subspace, chunk_size) -> None:
    flat_dst = dst.view(-1)
    flat_src = flat_dst if src is None else src.view(-1)
    runs = selected_runs(dst.numel(), offset=offset, chunk_subspace=chunk_subspace, subspace=subspace,
                         chunk_size=chunk_size)
    for run_start, run_stop in runs:
        for start, stop in _tiles(run_start, run_stop):
            eps = normal_stream(stop - start, seed=seed, member=member, tensor_id=tensor_id, offset=offset + start,
                                device=dst.device)
            flat_dst[start:stop] = flat_src[start:stop].float() + float(sigma) * eps


@ops.accumulate_op
def accumulate_(target, plan, tensor_id, offset, chunk_subspace, chunk_size, rounding) -> None:
    flat = target.view(-1)
    rows = [(member, key0 | key1 << 32, coeff)
            for (member, key0, key1), coeff in zip(plan.streams.tolist(), plan.coeffs.tolist())]
    subspaces = None if plan.subspaces is None else plan.subspaces.tolist()
    groups = [(None, rows)] if subspaces is None else [
        (k, [row for row, owner in zip(rows, subspaces) if owner == k]) for k in sorted(set(subspaces))
    ]
    for subspace, group in groups:
        runs = selected_runs(target.numel(), offset=offset, chunk_subspace=chunk_subspace, subspace=subspace,
                             chunk_size=chunk_size)
        for run_start, run_stop in runs:
            for start, stop in _tiles(run_start, run_stop):
                total = flat[start:stop].float()
                for member, member_seed, coeff in group:
                    eps = normal_stream(stop - start, seed=member_seed, member=member, tensor_id=tensor_id,
                                        offset=offset + start, device=target.device)
                    total.add_(eps, alpha=coeff)
                _store(flat[start:stop], total, rounding=rounding, seed=plan.rounding_seed, tensor_id=tensor_id,
                       offset=offset + start)


@ops.backup_op
def backup_chunks(src, chunk_subspace, subspace, chunk_size, offset) -> torch.Tensor:
    flat = src.view(-1)
    runs = selected_runs(src.numel(), offset=offset, chunk_subspace=chunk_subspace, subspace=subspace,
                         chunk_size=chunk_size)
    if not runs:
        return flat.new_empty(0)
    return torch.cat([flat[start:stop] for start, stop in runs])


@ops.restore_op
def restore_chunks_(dst, backup, chunk_subspace, subspace, chunk_size, offset) -> None:
    runs = selected_runs(dst.numel(), offset=offset, chunk_subspace=chunk_subspace, subspace=subspace,
                         chunk_size=chunk_size)
    v.check_backup_size(backup, expected=sum(stop - start for start, stop in runs), subspace=subspace)
    flat, packed, cursor = dst.view(-1), backup.view(-1).to(dst.device), 0
    for start, stop in runs:
        flat[start:stop] = packed[cursor : cursor + stop - start]
        cursor += stop - start


@ops.lowrank_factors_op
def lowrank_factors(seed, members, tensor_id, out_features, in_features, rank, device) -> tuple[torch.Tensor, ...]:
    a_size, b_size = out_features * rank, in_features * rank
    streams = [normal_stream(a_size + b_size, seed=seed, member=m, tensor_id=tensor_id, device=device) for m in members]
    A = torch.stack([s[:a_size].view(out_features, rank) for s in streams])
    B = torch.stack([s[a_size:].view(in_features, rank) for s in streams])
    return A, B


@ops.lowrank_linear_op
def lowrank_linear(x, weight, bias, A, B, row_member, sigma, rank) -> torch.Tensor:
    """the correction as (x B_m) A_m^T, in float32."""
    base = F.linear(x, weight, bias)
    x_rows = x.reshape(x.shape[0], -1, x.shape[-1]).float()  # [batch, tokens, in]
    projected = torch.bmm(x_rows, B[row_member])  # [batch, tokens, r]
    correction = torch.bmm(projected, A[row_member].transpose(1, 2))  # [batch, tokens, out]
    return (base.float() + (float(sigma) / math.sqrt(rank)) * correction.view(base.shape)).to(base.dtype)


def _store_stochastic(weight: torch.Tensor, updated: torch.Tensor, *, seed: int, tensor_id: int) -> torch.Tensor:
    _store(weight.view(-1), updated.view(-1), rounding="stochastic", seed=seed, tensor_id=tensor_id, offset=0)
    return weight


lowrank_accumulate_ = ops.lowrank_accumulate_op(_store_stochastic)

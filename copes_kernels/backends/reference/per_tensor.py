"""The reference per-tensor ops, in pure torch: the test oracle of the compiled backends (and the CPU fallback).

Their docstrings are the public ops' (`ck.normal` etc. wrap them). The identifiers, as in docs/noise-contract.md:
`seed` (uint64) keys one stream family -- one per ES step, or one per member with `seeds=` --, `member` (uint32)
picks a population member's stream, `tensor_id` (uint32, stable per parameter, distinct within a model: e.g.
`ck.tensor_id_of(name)`) picks the tensor's, and `offset` is the element index of the slice's first element in the
whole parameter. Tolerances between backends: the Philox words are bit-identical everywhere; the normals agree
within 2e-6 (compiled CPU) and 1e-5 (Triton on a GPU) of this reference, not bitwise, so a written element is
within one storage ulp plus |scale| times that. Within one backend every op is deterministic to the bit.

Same signatures as the fused ops. Noise is regenerated per run of selected chunks in tiles of at most
`NOISE_TILE` elements, so no op ever holds a full-size noise tensor. All math is float32 with one cast at the store.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence

import torch
import torch.nn.functional as F

from copes_kernels import _validate as v
from copes_kernels.partition import DEFAULT_CHUNK_SIZE, selected_runs

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
    """dst[i] = src[i] + sigma * eps(offset + i) on the chunks of `subspace`; nothing else is read or written.

    eps is the stream of (seed, member, tensor_id) (see `normal`); float32 math, one rounding to dst's dtype.
    Without a partition (chunk_subspace and subspace None) the whole tensor is perturbed. In place on dst.
    """
    v.check_perturb_args(
        dst, src, seed=seed, member=member, tensor_id=tensor_id, sigma=sigma, offset=offset,
        chunk_subspace=chunk_subspace, subspace=subspace, chunk_size=chunk_size,
    )
    flat_dst = dst.view(-1)
    flat_src = flat_dst if src is None else src.view(-1)
    runs = selected_runs(dst.numel(), offset=offset, chunk_subspace=chunk_subspace, subspace=subspace,
                         chunk_size=chunk_size)
    for run_start, run_stop in runs:
        for start, stop in _tiles(run_start, run_stop):
            eps = normal_stream(stop - start, seed=seed, member=member, tensor_id=tensor_id, offset=offset + start,
                                device=dst.device)
            flat_dst[start:stop] = flat_src[start:stop].float() + float(sigma) * eps
    return dst


def accumulate_(
    target: torch.Tensor,
    *,
    seed: int | None = None,
    members: Iterable[int] | torch.Tensor,
    coeffs: Iterable[float] | torch.Tensor,
    tensor_id: int,
    offset: int = 0,
    chunk_subspace: torch.Tensor | None = None,
    member_subspaces: Iterable[int] | torch.Tensor | None = None,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    rounding: str = "nearest",
    seeds: Iterable[int] | torch.Tensor | None = None,
) -> torch.Tensor:
    """target[i] += sum_j coeffs[j] * [subspace(chunk(i)) == member_subspaces[j]] * eps_j(offset + i), in place.

    eps_j is the noise stream of (seed, members[j], tensor_id) -- or of (seeds[j], members[j], tensor_id) when
    `seeds` gives each member its own seed (one pass over the tensor either way). Without a partition
    (chunk_subspace and member_subspaces None) every member updates the whole tensor. The sum is float32 with one
    store; `rounding="stochastic"` stores bfloat16/float16 targets with unbiased stochastic rounding, keyed by
    `seed` (with `seeds`: seed when given, else seeds[0]) and tensor_id. Each run of chunks only regenerates the
    noise of the members that own its subspace.
    """
    plan = v.accumulate_plan(
        target, seed=seed, seeds=seeds, members=members, coeffs=coeffs, tensor_id=tensor_id, offset=offset,
        chunk_subspace=chunk_subspace, member_subspaces=member_subspaces, chunk_size=chunk_size, rounding=rounding,
    )
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
    return target


def backup_chunks(
    src: torch.Tensor,
    *,
    chunk_subspace: torch.Tensor | None = None,
    subspace: int | None = None,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    offset: int = 0,
) -> torch.Tensor:
    """A packed 1-D copy of the elements in `subspace`'s chunks (1/K of the tensor), in element order; without a
    partition (chunk_subspace and subspace None), of the whole tensor: the full backup of a K=1 loop."""
    v.check_storage("src", src)
    v.check_chunking(src, offset=offset, chunk_subspace=chunk_subspace, subspace=subspace, chunk_size=chunk_size)
    flat = src.view(-1)
    runs = selected_runs(src.numel(), offset=offset, chunk_subspace=chunk_subspace, subspace=subspace,
                         chunk_size=chunk_size)
    if not runs:
        return flat.new_empty(0)
    return torch.cat([flat[start:stop] for start, stop in runs])


def restore_chunks_(
    dst: torch.Tensor,
    backup: torch.Tensor,
    *,
    chunk_subspace: torch.Tensor | None = None,
    subspace: int | None = None,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    offset: int = 0,
) -> torch.Tensor:
    """Write a `backup_chunks` copy back into its chunks: the exact inverse, bit for bit."""
    v.check_restore_args(dst, backup, offset=offset, chunk_subspace=chunk_subspace, subspace=subspace,
                         chunk_size=chunk_size)
    runs = selected_runs(dst.numel(), offset=offset, chunk_subspace=chunk_subspace, subspace=subspace,
                         chunk_size=chunk_size)
    v.check_backup_size(backup, expected=sum(stop - start for start, stop in runs), subspace=subspace)
    flat, packed, cursor = dst.view(-1), backup.view(-1).to(dst.device), 0
    for start, stop in runs:
        flat[start:stop] = packed[cursor : cursor + stop - start]
        cursor += stop - start
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
    a_size, b_size = out_features * rank, in_features * rank
    streams = [
        normal_stream(a_size + b_size, seed=seed, member=m, tensor_id=tensor_id, device=device) for m in member_list
    ]
    A = torch.stack([s[:a_size].view(out_features, rank) for s in streams])
    B = torch.stack([s[a_size:].view(in_features, rank) for s in streams])
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

    One base GEMM for the whole batch plus a rank-r correction per row: (x B_m) A_m^T, in float32.
    """
    rank = v.check_lowrank_linear_args(x, weight, A, B, row_member, sigma, check_rows=check_rows)
    base = F.linear(x, weight, bias)
    x_rows = x.reshape(x.shape[0], -1, x.shape[-1]).float()  # [batch, tokens, in]
    projected = torch.bmm(x_rows, B[row_member])  # [batch, tokens, r]
    correction = torch.bmm(projected, A[row_member].transpose(1, 2))  # [batch, tokens, out]
    return (base.float() + (float(sigma) / math.sqrt(rank)) * correction.view(base.shape)).to(base.dtype)


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

    `seed` and `tensor_id` only key the stochastic rounding stream.
    """
    updated = v.lowrank_updated(weight, A=A, B=B, coeffs=coeffs, scale=scale, rounding=rounding)
    _store(weight.view(-1), updated.view(-1), rounding=rounding, seed=seed, tensor_id=tensor_id, offset=0)
    return weight

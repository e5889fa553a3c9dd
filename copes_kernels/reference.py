"""Pure-torch implementation of every public op: the CPU path and the test oracle for the Triton kernels.

Same signatures as the fused ops. Noise is regenerated per run of selected chunks in tiles of at most
`NOISE_TILE` elements, so no op ever holds a full-size noise tensor. All math is float32 with one cast at the store.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.nn.functional as F

from copes_kernels import _validate as v
from copes_kernels.partition import DEFAULT_CHUNK_SIZE, selected_runs
from copes_kernels.run_tables import RunTable
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
    """dst[i] = src[i] + sigma * eps(offset + i) on the chunks of `subspace`; nothing else is read or written."""
    v.check_perturb_args(
        dst, src, seed=seed, member=member, tensor_id=tensor_id, sigma=sigma, offset=offset,
        chunk_subspace=chunk_subspace, subspace=subspace, chunk_size=chunk_size,
    )
    flat_dst = dst.view(-1)
    flat_src = flat_dst if src is None else src.view(-1)
    runs = selected_runs(dst.numel(), offset=offset, chunk_subspace=chunk_subspace, subspace=subspace, chunk_size=chunk_size)
    for run_start, run_stop in runs:
        for start, stop in _tiles(run_start, run_stop):
            eps = normal_stream(stop - start, seed=seed, member=member, tensor_id=tensor_id, offset=offset + start, device=dst.device)
            flat_dst[start:stop] = flat_src[start:stop].float() + float(sigma) * eps
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

    Each run of chunks only regenerates the noise of the members that own its subspace. `rounding="stochastic"`
    stores bfloat16/float16 targets with unbiased stochastic rounding (keyed by seed and tensor_id).
    """
    members_t, coeffs_t = v.as_members_and_coeffs(target, members, coeffs)
    subspaces_t = v.check_accumulate_args(
        target, seed=seed, members=members_t, tensor_id=tensor_id, offset=offset, chunk_subspace=chunk_subspace,
        member_subspaces=member_subspaces, chunk_size=chunk_size, rounding=rounding,
    )
    flat = target.view(-1)
    groups = [(None, members_t.tolist(), coeffs_t.tolist())] if subspaces_t is None else [
        (k, members_t[subspaces_t == k].tolist(), coeffs_t[subspaces_t == k].tolist())
        for k in torch.unique(subspaces_t).tolist()
    ]
    for subspace, group_members, group_coeffs in groups:
        runs = selected_runs(target.numel(), offset=offset, chunk_subspace=chunk_subspace, subspace=subspace, chunk_size=chunk_size)
        for run_start, run_stop in runs:
            for start, stop in _tiles(run_start, run_stop):
                total = flat[start:stop].float()
                for member, coeff in zip(group_members, group_coeffs):
                    eps = normal_stream(stop - start, seed=seed, member=member, tensor_id=tensor_id, offset=offset + start, device=target.device)
                    total.add_(eps, alpha=coeff)
                _store(flat[start:stop], total, rounding=rounding, seed=seed, tensor_id=tensor_id, offset=offset + start)
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
    flat = src.view(-1)
    runs = selected_runs(src.numel(), offset=offset, chunk_subspace=chunk_subspace, subspace=subspace, chunk_size=chunk_size)
    if not runs:
        return flat.new_empty(0)
    return torch.cat([flat[start:stop] for start, stop in runs])


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
    v.check_restore_args(dst, backup, offset=offset, chunk_subspace=chunk_subspace, subspace=subspace, chunk_size=chunk_size)
    runs = selected_runs(dst.numel(), offset=offset, chunk_subspace=chunk_subspace, subspace=subspace, chunk_size=chunk_size)
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
    v.check_factor_request(seed=seed, tensor_id=tensor_id, out_features=out_features, in_features=in_features, rank=rank)
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


# ------------------------------------------------------------------ multi-tensor twins (over the per-tensor ops)
# They loop over the per-tensor ops through the dispatcher, so on CPU they run whatever per-tensor backend is
# active; imported lazily because the dispatcher imports this module.


def multi_perturb_(table: RunTable, *, seed: int, member: int, sigma: float, backup: torch.Tensor | None = None) -> None:
    """Perturb every tensor of `table` on its subspace's chunks, first packing them into `backup` when given."""
    from copes_kernels import _dispatch as ops

    v.check_multi_perturb_args(table, seed=seed, member=member, sigma=sigma, backup=backup)
    cursor = 0
    for tensor, tensor_id, chunk_subspace in zip(table.tensors, table.tensor_ids, table.chunk_subspaces):
        layout = dict(chunk_subspace=chunk_subspace, subspace=table.subspace, chunk_size=table.chunk_size)
        if backup is not None:
            packed = ops.backup_chunks(tensor, **layout)
            backup[cursor : cursor + packed.numel()].copy_(packed)
            cursor += packed.numel()
        ops.perturb_(tensor, seed=seed, member=member, tensor_id=tensor_id, sigma=sigma, **layout)


def multi_restore_(table: RunTable, backup: torch.Tensor) -> None:
    """Write a `multi_perturb_` backup back into its chunks: the exact inverse, bit for bit."""
    from copes_kernels import _dispatch as ops

    v.check_multi_backup(table, backup)
    cursor = 0
    for tensor, chunk_subspace, size in zip(table.tensors, table.chunk_subspaces, table.backup_sizes):
        ops.restore_chunks_(
            tensor, backup[cursor : cursor + size], chunk_subspace=chunk_subspace, subspace=table.subspace,
            chunk_size=table.chunk_size,
        )
        cursor += size


def multi_accumulate_(
    table: RunTable,
    *,
    seed: int,
    members: Sequence[int] | torch.Tensor,
    coeffs: Sequence[float] | torch.Tensor,
    member_subspaces: Sequence[int] | torch.Tensor,
    rounding: str = "nearest",
) -> torch.Tensor:
    """Add the reward-weighted noise to every tensor of `table`; returns the squared L2 norm of the stored change."""
    from copes_kernels import _dispatch as ops

    members_h, coeffs_h, subspaces_h = v.check_multi_accumulate_args(
        table, seed=seed, members=members, coeffs=coeffs, member_subspaces=member_subspaces, rounding=rounding
    )
    squared = torch.zeros((), dtype=torch.float64, device=table.device)
    for tensor, tensor_id, chunk_subspace in zip(table.tensors, table.tensor_ids, table.chunk_subspaces):
        before = tensor.clone()
        ops.accumulate_(
            tensor, seed=seed, members=members_h, coeffs=coeffs_h, tensor_id=tensor_id, chunk_subspace=chunk_subspace,
            member_subspaces=subspaces_h, chunk_size=table.chunk_size, rounding=rounding,
        )
        norm = torch.linalg.vector_norm(tensor.float() - before.float(), dtype=torch.float64)
        squared += norm * norm
    return squared

"""Argument checks shared by both backends, so a bad call fails the same way, with one clear message, anywhere."""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from copes_kernels.partition import PARTITION_DTYPE
from copes_kernels.rng import MASK32, UINT64_MAX, check_stream_ids
from copes_kernels.run_tables import STORAGE_DTYPES, RunTable

ROUNDING_MODES = ("nearest", "stochastic")


def check_storage(name: str, tensor: torch.Tensor) -> None:
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(tensor).__name__}")
    if tensor.dtype not in STORAGE_DTYPES:
        raise ValueError(f"{name} must be float32, bfloat16 or float16, got {tensor.dtype}")
    if not tensor.is_contiguous():
        raise ValueError(f"{name} must be contiguous (call .contiguous() or pass a contiguous slice)")


def check_writable(name: str, tensor: torch.Tensor) -> None:
    """An op writes `tensor` in place: refuse a tensor autograd would track (an nn.Parameter under grad mode)."""
    check_storage(name, tensor)
    if tensor.requires_grad and torch.is_grad_enabled():
        raise ValueError(f"{name} requires grad and grad mode is on: pass p.data or use torch.no_grad()")


def check_same_device(name: str, tensor: torch.Tensor, reference: torch.Tensor, reference_name: str) -> None:
    if tensor.device != reference.device:
        raise ValueError(f"{name} is on {tensor.device} but {reference_name} is on {reference.device}")


def check_finite(name: str, value: float) -> None:
    if not math.isfinite(float(value)):
        raise ValueError(f"{name} must be finite, got {value}")


def check_normal_args(n: int, *, seed: int, member: int, tensor_id: int, offset: int) -> None:
    if int(n) < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    if int(offset) < 0:
        raise ValueError(f"offset must be >= 0, got {offset}")
    check_stream_ids(seed, member, tensor_id)


def check_rounding(rounding: str, target: torch.Tensor) -> None:
    if rounding not in ROUNDING_MODES:
        raise ValueError(f"rounding must be one of {ROUNDING_MODES}, got {rounding!r}")
    if rounding == "stochastic" and target.dtype == torch.float32:
        raise ValueError("stochastic rounding applies to bfloat16/float16 targets; float32 rounds to nearest")


def check_chunking(
    dst: torch.Tensor,
    *,
    offset: int,
    chunk_subspace: torch.Tensor | None,
    subspace: int | None,
    chunk_size: int,
    subspace_name: str = "subspace",
) -> None:
    """Offsets, chunk size and the partition map (which must cover every chunk this slice touches)."""
    if int(offset) < 0:
        raise ValueError(f"offset must be >= 0, got {offset}")
    if int(chunk_size) <= 0:
        raise ValueError(f"chunk_size must be > 0, got {chunk_size}")
    if chunk_subspace is None:
        if subspace is not None:
            raise ValueError(f"{subspace_name} was given without chunk_subspace: pass chunk_subspace= (this tensor's "
                             "entry of make_partition), or neither for the whole tensor")
        return
    if subspace is None:
        raise ValueError(f"chunk_subspace was given without {subspace_name}: pass {subspace_name}= too, or neither "
                         "for the whole tensor")
    if not isinstance(chunk_subspace, torch.Tensor) or chunk_subspace.dtype != PARTITION_DTYPE:
        raise ValueError("chunk_subspace must be an int16 tensor (from make_partition)")
    if chunk_subspace.dim() != 1 or not chunk_subspace.is_contiguous():
        raise ValueError("chunk_subspace must be a contiguous 1-D tensor")
    check_same_device("chunk_subspace", chunk_subspace, dst, "the data tensor")
    needed = (int(offset) + dst.numel() - 1) // int(chunk_size) + 1 if dst.numel() else 0
    if chunk_subspace.numel() < needed:
        raise ValueError(
            f"chunk_subspace has {chunk_subspace.numel()} entries but elements up to {int(offset) + dst.numel()} "
            f"span {needed} chunks of {chunk_size}: pass the partition of the whole parameter"
        )


def check_perturb_args(
    dst: torch.Tensor,
    src: torch.Tensor | None,
    *,
    seed: int,
    member: int,
    tensor_id: int,
    sigma: float,
    offset: int,
    chunk_subspace: torch.Tensor | None,
    subspace: int | None,
    chunk_size: int,
) -> None:
    check_writable("dst", dst)
    if src is not None:
        check_storage("src", src)
        check_same_device("src", src, dst, "dst")
        if src.numel() != dst.numel():
            raise ValueError(f"src has {src.numel()} elements but dst has {dst.numel()}")
    check_stream_ids(seed, member, tensor_id)
    check_finite("sigma", sigma)
    check_chunking(dst, offset=offset, chunk_subspace=chunk_subspace, subspace=subspace, chunk_size=chunk_size)


# check_restore_args takes the layout keywords of check_perturb_args (the ops' own keyword lists), which is why
# their signatures look alike; the checks differ.
def check_restore_args(
    dst: torch.Tensor,
    backup: torch.Tensor,
    *,
    offset: int,
    chunk_subspace: torch.Tensor | None,
    subspace: int | None,
    chunk_size: int,
) -> None:
    check_writable("dst", dst)
    check_storage("backup", backup)
    check_chunking(dst, offset=offset, chunk_subspace=chunk_subspace, subspace=subspace, chunk_size=chunk_size)
    if backup.dtype != dst.dtype:
        raise ValueError(f"backup is {backup.dtype} but dst is {dst.dtype}")


def check_backup_size(backup: torch.Tensor, *, expected: int, subspace: int | None) -> None:
    if backup.numel() != expected:
        covered = "the slice" if subspace is None else f"subspace {subspace}"
        raise ValueError(f"backup has {backup.numel()} elements but {covered} covers {expected} here")


def iterable_values(values: Iterable | torch.Tensor | np.ndarray, name: str) -> Sequence | torch.Tensor | np.ndarray:
    """Any iterable of numbers (a generator included) as something torch.as_tensor takes."""
    if isinstance(values, (torch.Tensor, np.ndarray, Sequence)):
        return values
    if isinstance(values, Iterable):
        return list(values)
    raise TypeError(f"{name} must be a sequence, an iterable or a tensor, got {type(values).__name__}")


def member_streams(
    members: Iterable[int] | torch.Tensor,
    coeffs: Iterable[float] | torch.Tensor,
    *,
    seed: int | None,
    seeds: Iterable[int] | torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor, int]:
    """On the host: int64 [n, 3] rows (member, key word 0, key word 1) -- the Philox stream of each member, keyed by
    the one `seed` or by its own `seeds[j]` --, float32 coeffs [n], and the seed of the stochastic-rounding stream
    (`seed` when given, else seeds[0])."""
    members_t = torch.as_tensor(iterable_values(members, "members"), dtype=torch.int64).reshape(-1).cpu()
    coeffs_t = torch.as_tensor(iterable_values(coeffs, "coeffs")).reshape(-1).cpu()
    count = members_t.numel()
    if count != coeffs_t.numel():
        raise ValueError(f"members has {count} entries but coeffs has {coeffs_t.numel()}")
    if count and (int(members_t.min()) < 0 or int(members_t.max()) > MASK32):
        raise ValueError("members must be uint32 values")
    if not bool(torch.isfinite(coeffs_t).all()):
        raise ValueError("coeffs must be finite (a NaN reward must be handled before the update)")
    if seeds is None:
        if seed is None:
            raise ValueError("pass seed= (one Philox key for every member) or seeds= (one per member)")
        seed_list, rounding_seed = [int(seed)] * count, int(seed)
        check_stream_ids(seed, 0, 0)
    else:
        seed_list = [int(s) for s in (seeds.tolist() if isinstance(seeds, torch.Tensor)
                                      else iterable_values(seeds, "seeds"))]
        if len(seed_list) != count:
            raise ValueError(f"seeds has {len(seed_list)} entries but members has {count}: pass one seed per member")
        if any(not 0 <= s <= UINT64_MAX for s in seed_list):
            raise ValueError("seeds must be uint64 values (0 <= seed < 2^64)")
        rounding_seed = int(seed) if seed is not None else (seed_list[0] if seed_list else 0)
        check_stream_ids(rounding_seed, 0, 0)
    keys = torch.tensor([[s & MASK32, s >> 32] for s in seed_list], dtype=torch.int64).reshape(count, 2)
    return torch.cat([members_t[:, None], keys], dim=1), coeffs_t.float(), rounding_seed


@dataclass(frozen=True)
class AccumulatePlan:
    """A validated update of one tensor, on its device: who adds noise, under which key, with which weight."""

    streams: torch.Tensor  # int64 [n, 3]: member, key word 0, key word 1
    coeffs: torch.Tensor  # float32 [n]
    subspaces: torch.Tensor | None  # int64 [n]: the subspace of each member (None without a partition)
    rounding_seed: int  # keys the stochastic-rounding stream


def accumulate_plan(
    target: torch.Tensor,
    *,
    seed: int | None,
    seeds: Iterable[int] | torch.Tensor | None,
    members: Iterable[int] | torch.Tensor,
    coeffs: Iterable[float] | torch.Tensor,
    tensor_id: int,
    offset: int,
    chunk_subspace: torch.Tensor | None,
    member_subspaces: Iterable[int] | torch.Tensor | None,
    chunk_size: int,
    rounding: str,
) -> AccumulatePlan:
    """Check every argument of `accumulate_` (the same on every backend) and gather them on target's device."""
    check_writable("target", target)
    streams, coeffs_t, rounding_seed = member_streams(members, coeffs, seed=seed, seeds=seeds)
    check_stream_ids(0, 0, tensor_id)
    check_rounding(rounding, target)
    check_chunking(
        target,
        offset=offset,
        chunk_subspace=chunk_subspace,
        subspace=None if member_subspaces is None else 0,
        chunk_size=chunk_size,
        subspace_name="member_subspaces",
    )
    subspaces_t = None
    if member_subspaces is not None:
        subspaces_t = torch.as_tensor(iterable_values(member_subspaces, "member_subspaces"), dtype=torch.int64)
        subspaces_t = subspaces_t.reshape(-1)
        if subspaces_t.numel() != streams.shape[0]:
            raise ValueError(f"member_subspaces has {subspaces_t.numel()} entries but members has {streams.shape[0]}")
        subspaces_t = subspaces_t.to(target.device)
    device = target.device
    return AccumulatePlan(streams.to(device), coeffs_t.to(device), subspaces_t, rounding_seed)


def check_lowrank_factors(A: torch.Tensor, B: torch.Tensor, out_features: int, in_features: int) -> int:
    """Population factors A [P, m, r], B [P, n, r] (float32); returns the rank."""
    a_shape, b_shape = A.shape, B.shape
    for name, factor, shape, rows in (("A", A, a_shape, out_features), ("B", B, b_shape, in_features)):
        if len(shape) != 3:
            raise ValueError(f"{name} must be [population, {'out' if name == 'A' else 'in'}_features, rank], "
                             f"got {tuple(shape)}")
        if shape[1] != rows:
            raise ValueError(f"{name} has {shape[1]} rows but the weight needs {rows}")
        if factor.dtype != torch.float32:
            raise ValueError(f"{name} must be float32 (from lowrank_factors), got {factor.dtype}")
    if a_shape[0] != b_shape[0] or a_shape[2] != b_shape[2]:
        raise ValueError(f"A {tuple(a_shape)} and B {tuple(b_shape)} disagree on population or rank")
    if a_shape[2] < 1:
        raise ValueError("rank must be >= 1")
    return a_shape[2]


def check_rank(rank: int) -> None:
    if int(rank) < 1:
        raise ValueError(f"rank must be >= 1, got {rank}")


def check_factor_request(*, seed: int, tensor_id: int, out_features: int, in_features: int, rank: int) -> None:
    check_rank(rank)
    if out_features < 1 or in_features < 1:
        raise ValueError(f"out_features and in_features must be >= 1, got {out_features}, {in_features}")
    check_stream_ids(seed, 0, tensor_id)


def as_member_list(member: int | Sequence[int] | torch.Tensor) -> tuple[list[int], bool]:
    """(members, single): an int member means unbatched factors, a sequence batched ones."""
    single = isinstance(member, int)
    members = [member] if single else torch.as_tensor(iterable_values(member, "member")).reshape(-1).tolist()
    for m in members:
        if not 0 <= int(m) <= MASK32:
            raise ValueError(f"member must be a uint32, got {m}")
    return members, single


def check_lowrank_linear_args(
    x: torch.Tensor, weight: torch.Tensor, A: torch.Tensor, B: torch.Tensor, row_member: torch.Tensor, sigma: float,
    *, check_rows: bool = True,
) -> int:
    """Shapes, dtypes and devices of a batched population forward (and row_member's range unless `check_rows` is
    False: the one check that reads device data); returns the rank."""
    # Called once per linear layer per forward (every decode step): each check is one cheap comparison.
    weight_shape, x_shape = weight.shape, x.shape
    if len(weight_shape) != 2:
        raise ValueError(f"weight must be 2-D [out, in], got {tuple(weight_shape)}")
    if len(x_shape) < 2 or x_shape[-1] != weight_shape[1]:
        raise ValueError(f"x must be [batch, ..., {weight_shape[1]}], got {tuple(x_shape)}")
    rank = check_lowrank_factors(A, B, weight_shape[0], weight_shape[1])
    if row_member.dtype != torch.int64 or row_member.shape != (x_shape[0],):
        raise ValueError(f"row_member must be int64 of shape ({x_shape[0]},), "
                         f"got {row_member.dtype} {tuple(row_member.shape)}")
    device = x.device
    if not (A.device == device and B.device == device and row_member.device == device and weight.device == device):
        for name, t in (("A", A), ("B", B), ("row_member", row_member), ("weight", weight)):
            check_same_device(name, t, x, "x")
    if check_rows and row_member.numel() and (int(row_member.min()) < 0 or int(row_member.max()) >= A.shape[0]):
        raise ValueError(f"row_member values must index the population of {A.shape[0]}")
    check_finite("sigma", sigma)
    return rank


def lowrank_updated(
    weight: torch.Tensor, *, A: torch.Tensor, B: torch.Tensor, coeffs: Sequence[float] | torch.Tensor, scale: float,
    rounding: str
) -> torch.Tensor:
    """After checking the arguments of a low-rank update: float32 weight + scale * sum_j coeffs[j] A_j B_j^T, as one
    GEMM over the stacked factors [m, P r] x [P r, n]."""
    check_writable("weight", weight)
    if weight.dim() != 2:
        raise ValueError(f"weight must be 2-D [out, in], got {tuple(weight.shape)}")
    check_rounding(rounding, weight)
    check_finite("scale", scale)
    check_lowrank_factors(A, B, weight.shape[0], weight.shape[1])
    coeffs_t = torch.as_tensor(coeffs, dtype=torch.float32, device=weight.device).reshape(-1)
    if coeffs_t.numel() != A.shape[0]:
        raise ValueError(f"coeffs has {coeffs_t.numel()} entries but the population has {A.shape[0]}")
    if not bool(torch.isfinite(coeffs_t).all()):
        raise ValueError("coeffs must be finite")
    weighted_A = (A * coeffs_t[:, None, None]).permute(1, 0, 2).reshape(A.shape[1], -1)  # [m, P r]
    stacked_B = B.permute(1, 0, 2).reshape(B.shape[1], -1)  # [n, P r]
    return weight.float() + float(scale) * (weighted_A @ stacked_B.T)


def check_run_table(table: RunTable) -> None:
    if not isinstance(table, RunTable):
        raise TypeError(f"expected a copes_kernels.RunTable (build_run_table), got {type(table).__name__}")


def check_table_writable(table: RunTable) -> None:
    check_run_table(table)
    if table.requires_grad and torch.is_grad_enabled():
        raise ValueError("the run table's tensors require grad and grad mode is on: build it with p.data, i.e. "
                         "pass p.data or use torch.no_grad()")


def check_multi_backup(table: RunTable, backup: torch.Tensor) -> None:
    """A backup for `table`: its dtype, backup_numel elements, contiguous."""
    check_table_writable(table)
    if table.subspace is None:
        raise ValueError("backup and restore need the run table of one subspace, not the table of every chunk")
    if not isinstance(backup, torch.Tensor) or backup.dtype != table.dtype or not backup.is_contiguous():
        raise ValueError(f"backup must be a contiguous {table.dtype} tensor")
    if backup.numel() != table.backup_numel:
        raise ValueError(
            f"backup has {backup.numel()} elements but subspace {table.subspace} covers {table.backup_numel} here"
        )


def check_multi_perturb_args(
    table: RunTable, *, seed: int, member: int, sigma: float, backup: torch.Tensor | None
) -> None:
    check_table_writable(table)
    if table.subspace is None:
        raise ValueError("multi_perturb_ needs the run table of one subspace, not the table of every chunk")
    check_stream_ids(seed, member, 0)
    check_finite("sigma", sigma)
    if backup is not None:
        check_multi_backup(table, backup)
        check_same_device("backup", backup, table.runs, "the run table")


def check_multi_accumulate_args(
    table: RunTable,
    *,
    seed: int | None,
    seeds: Iterable[int] | torch.Tensor | None,
    members: Iterable[int] | torch.Tensor,
    coeffs: Iterable[float] | torch.Tensor,
    member_subspaces: Iterable[int] | torch.Tensor | None,
    rounding: str,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """Member streams (int64 [n, 3]), coeffs (float32), member_subspaces (int64) and the rounding seed, validated,
    on the host (one read-back per update when they were on the device). Without member_subspaces every member
    perturbed subspace 0, which only a table of one subspace allows."""
    check_table_writable(table)
    check_rounding(rounding, table.tensors[0])
    streams, coeffs_h, rounding_seed = member_streams(members, coeffs, seed=seed, seeds=seeds)
    if member_subspaces is None:
        if table.num_subspaces != 1:
            raise ValueError(f"the run table has {table.num_subspaces} subspaces: pass member_subspaces= (the "
                             "subspace each member perturbed)")
        subspaces_h = torch.zeros(streams.shape[0], dtype=torch.int64)
    else:
        subspaces_h = torch.as_tensor(iterable_values(member_subspaces, "member_subspaces"), dtype=torch.int64)
        subspaces_h = subspaces_h.reshape(-1).cpu()
    if subspaces_h.numel() != streams.shape[0]:
        raise ValueError(f"member_subspaces has {subspaces_h.numel()} entries but members has {streams.shape[0]}")
    if subspaces_h.numel() and (int(subspaces_h.min()) < 0 or int(subspaces_h.max()) >= table.num_subspaces):
        raise ValueError(f"member_subspaces must be in [0, {table.num_subspaces})")
    return streams, coeffs_h, subspaces_h, rounding_seed

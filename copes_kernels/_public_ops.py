"""The public ops' signatures, docstrings and argument checks, written once for every backend.

A backend writes only what differs, the work on arguments already checked, and decorates it with the op's
template here: the template is the public function (keyword names, defaults, docstring) that checks the arguments
the same way on every backend and then calls the backend's function positionally. The identifiers, as in
docs/noise-contract.md: `seed` (uint64) keys one stream family -- one per ES step, or one per member with
`seeds=` --, `member` (uint32) picks a population member's stream, `tensor_id` (uint32, stable per parameter,
distinct within a model: e.g. `ck.tensor_id_of(name)`) picks the tensor's, and `offset` is the element index of the
slice's first element in the whole parameter.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch

from copes_kernels import _validate as v
from copes_kernels.partition import DEFAULT_CHUNK_SIZE
from copes_kernels.run_tables import RunTable


def _public(work: Callable[..., Any], op: Callable[..., Any], *, note: bool = True) -> Callable[..., Any]:
    """`op` as the backend's own public function: its module, and its docstring followed by the backend's note."""
    op.__module__, op.__qualname__ = work.__module__, op.__name__
    if note and work.__doc__:
        op.__doc__ = f"{inspect.cleandoc(op.__doc__ or '')}\n\nThis backend: {work.__doc__}"
    return op


def perturb_op(work: Callable[..., None]) -> Callable[..., torch.Tensor]:
    """`work(dst, src, seed, member, tensor_id, sigma, offset, chunk_subspace, subspace, chunk_size)` writes."""

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
        work(dst, src, seed, member, tensor_id, sigma, offset, chunk_subspace, subspace, chunk_size)
        return dst

    return _public(work, perturb_)


def accumulate_op(work: Callable[..., None]) -> Callable[..., torch.Tensor]:
    """`work(target, plan, tensor_id, offset, chunk_subspace, chunk_size, rounding)` adds, `plan` a checked
    `_validate.AccumulatePlan`."""

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
        (chunk_subspace and member_subspaces None) every member updates the whole tensor. The sum is float32 with
        one store; `rounding="stochastic"` stores bfloat16/float16 targets with unbiased stochastic rounding, keyed
        by `seed` (with `seeds`: seed when given, else seeds[0]) and tensor_id. Each run of chunks only regenerates
        the noise of the members that own its subspace.
        """
        plan = v.accumulate_plan(
            target, seed=seed, seeds=seeds, members=members, coeffs=coeffs, tensor_id=tensor_id, offset=offset,
            chunk_subspace=chunk_subspace, member_subspaces=member_subspaces, chunk_size=chunk_size, rounding=rounding,
        )
        work(target, plan, tensor_id, offset, chunk_subspace, chunk_size, rounding)
        return target

    return _public(work, accumulate_)


# The templates' keyword lists are the public API, one per op; backup and restore share their layout keywords by
# design (restore takes what backup gave), which is why their signatures look alike.
def backup_op(work: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    """`work(src, chunk_subspace, subspace, chunk_size, offset)` returns the packed copy."""

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
        return work(src, chunk_subspace, subspace, chunk_size, offset)

    return _public(work, backup_chunks)


def restore_op(work: Callable[..., None]) -> Callable[..., torch.Tensor]:
    """`work(dst, backup, chunk_subspace, subspace, chunk_size, offset)` writes back (and checks the backup's
    size, which only it knows)."""

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
        work(dst, backup, chunk_subspace, subspace, chunk_size, offset)
        return dst

    return _public(work, restore_chunks_)


def lowrank_factors_op(work: Callable[..., tuple[torch.Tensor, torch.Tensor]]) -> Callable[..., Any]:
    """`work(seed, members, tensor_id, out_features, in_features, rank, device)` returns A [P, m, r], B [P, n, r]."""

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
        """EGGROLL factors from the eps stream of (seed, member, tensor_id): A = eps[0 : m r] as [m, r], B the next
        n r.

        An int member gives A [m, r], B [n, r]; a sequence of members gives [P, m, r], [P, n, r].
        """
        v.check_factor_request(seed=seed, tensor_id=tensor_id, out_features=out_features, in_features=in_features,
                               rank=rank)
        member_list, single = v.as_member_list(member)
        A, B = work(seed, member_list, tensor_id, out_features, in_features, rank, device)
        return (A[0], B[0]) if single else (A, B)

    return _public(work, lowrank_factors)


def lowrank_linear_op(work: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    """`work(x, weight, bias, A, B, row_member, sigma, rank)` returns the output."""

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

        One base GEMM for the whole batch plus a rank-r correction per row. `check_rows=False` skips the range
        check of row_member (two reads of device data): for callers that validated the rows once for many calls,
        e.g. once per population forward.
        """
        rank = v.check_lowrank_linear_args(x, weight, A, B, row_member, sigma, check_rows=check_rows)
        return work(x, weight, bias, A, B, row_member, sigma, rank)

    return _public(work, lowrank_linear)


def lowrank_accumulate_op(store_stochastic: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    """`store_stochastic(weight, updated, seed=, tensor_id=)` stores the float32 result with stochastic rounding;
    rounding to nearest is a copy on every backend."""

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
        if rounding == "stochastic":
            return store_stochastic(weight, updated, seed=seed, tensor_id=tensor_id)
        return weight.copy_(updated)

    return _public(store_stochastic, lowrank_accumulate_, note=False)


def multi_accumulate_op(work: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    """`work(table, streams, coeffs, member_subspaces, rounding_seed, rounding)` adds, on the checked host tensors
    of `_validate.check_multi_accumulate_args`, and returns the squared norm."""

    def multi_accumulate_(
        table: RunTable,
        *,
        seed: int | None = None,
        members: Iterable[int] | torch.Tensor,
        coeffs: Iterable[float] | torch.Tensor,
        member_subspaces: Iterable[int] | torch.Tensor | None = None,
        rounding: str = "nearest",
        seeds: Iterable[int] | torch.Tensor | None = None,
    ) -> torch.Tensor:
        """`accumulate_` on every tensor of `table` (a table of every chunk; member_subspaces may be left out at
        K=1), each run only the members of its own subspace; returns the squared L2 norm of the stored change
        (float64 0-d)."""
        streams, coeffs_h, subspaces_h, rounding_seed = v.check_multi_accumulate_args(
            table, seed=seed, seeds=seeds, members=members, coeffs=coeffs, member_subspaces=member_subspaces,
            rounding=rounding,
        )
        return work(table, streams, coeffs_h, subspaces_h, rounding_seed, rounding)

    return _public(work, multi_accumulate_)

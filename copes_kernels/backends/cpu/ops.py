"""The compiled CPU backend's per-tensor ops: validate (as every backend does), view the storage, call a kernel.

Same signatures and contract as the reference (the oracle they are tested against). Threads follow
`torch.get_num_threads()` (capped by numba's pool).
"""

from __future__ import annotations

import functools
import math
import threading
from collections.abc import Iterable, Sequence

import numba
import numpy as np
import torch
import torch.nn.functional as F

from copes_kernels import _validate as v
from copes_kernels.backends.cpu.kernels import (
    ROWS_PER_JOB,
    accumulate_kernel,
    backup_kernel,
    lowrank_correction_kernel,
    lowrank_correction_serial,
    normal_rows_kernel,
    perturb_kernel,
    philox_kernel,
    restore_kernel,
    store_stochastic_kernel,
)
from copes_kernels.partition import DEFAULT_CHUNK_SIZE
from copes_kernels.rng import MASK32, check_philox_inputs

# numba cannot hold 16-bit floats: their bits travel as integers, bfloat16 as uint16 and float16 as int16.
_KERNEL_VIEWS = {torch.float32: torch.float32, torch.bfloat16: torch.uint16, torch.float16: torch.int16}


def kernel_array(tensor: torch.Tensor) -> np.ndarray:
    """A numpy view (shared memory) of a contiguous float storage tensor, in the kernels' element type (detached:
    the callers checked that autograd does not track the write)."""
    tensor = tensor.detach()
    if tensor.dtype == torch.float32:
        return tensor.numpy()
    return tensor.view(_KERNEL_VIEWS[tensor.dtype]).numpy()


@functools.cache
def _start_thread_pool() -> None:
    """Start numba's pool once. With the OpenMP layer that resets the OpenMP thread count torch shares, so torch's
    setting (e.g. `--cpu-threads 1`) is put back."""
    torch_threads = torch.get_num_threads()
    numba.set_num_threads(numba.config.NUMBA_NUM_THREADS)
    torch.set_num_threads(torch_threads)


# numba's thread count is per calling thread; remembering the last one set skips numba's (locking) getter.
_calling_thread = threading.local()


def use_torch_threads() -> int:
    """Run the parallel loops on as many threads as torch may use (numba's pool is the cap)."""
    _start_thread_pool()
    threads = max(1, min(torch.get_num_threads(), numba.config.NUMBA_NUM_THREADS))
    if getattr(_calling_thread, "threads", None) != threads:
        numba.set_num_threads(threads)
        _calling_thread.threads = threads
    return threads


def philox_key(seed: int) -> tuple[int, int]:
    """The Philox key words of `seed`. Stream ids reach the kernels as Python ints (cheaper to pass than numpy
    scalars) and become uint64 there (`as_words`)."""
    return int(seed) & MASK32, int(seed) >> 32


_NO_PARTITION = np.empty(0, np.int16)


def _chunk_owner(chunk_subspace: torch.Tensor | None) -> tuple[np.ndarray, bool]:
    """The partition as the kernels take it: (chunk -> subspace array, whether there is one)."""
    return (_NO_PARTITION, False) if chunk_subspace is None else (chunk_subspace.numpy(), True)


def _subspace_word(subspace: int | None) -> int:
    """The kernels' subspace argument (ignored without a partition)."""
    return 0 if subspace is None else int(subspace)


def _touches_nothing(
    numel: int, *, offset: int, chunk_subspace: torch.Tensor | None, subspace: int | None, chunk_size: int
) -> bool:
    """An empty slice, or one inside a single chunk of another subspace: nothing to read or write.

    Most small tensors are one chunk, so most of a member's calls on them end here, before the kernel call's
    fixed cost."""
    if numel == 0:
        return True
    if chunk_subspace is None:
        return False
    first = offset // chunk_size
    return first == (offset + numel - 1) // chunk_size and int(chunk_subspace.numpy()[first]) != int(subspace)


def philox4x32_10(counter: torch.Tensor, key: torch.Tensor) -> torch.Tensor:
    """Philox4x32-10 on int64 tensors holding uint32 values: counter [..., 4], key [..., 2] -> words [..., 4]."""
    check_philox_inputs(counter, key)
    shape = torch.broadcast_shapes(counter.shape[:-1], key.shape[:-1])
    counters = counter.cpu().expand(*shape, 4).reshape(-1, 4).contiguous()
    keys = key.cpu().expand(*shape, 2).reshape(-1, 2).contiguous()
    out = torch.empty(counters.shape[0], 4, dtype=torch.int64)
    if out.numel():
        use_torch_threads()
        philox_kernel(out.numpy(), counters.numpy(), keys.numpy())
    return out.view(*shape, 4).to(counter.device)


def _normal_rows(out: torch.Tensor, members: Sequence[int], *, seed: int, tensor_id: int, offset: int) -> None:
    if out.numel():
        use_torch_threads()
        normal_rows_kernel(out.numpy(), np.asarray(members, np.int64), offset, int(tensor_id), *philox_key(seed))


def normal(
    n: int, *, seed: int, member: int, tensor_id: int, offset: int = 0, device: torch.device | str | None = None
) -> torch.Tensor:
    v.check_normal_args(n, seed=seed, member=member, tensor_id=tensor_id, offset=offset)
    out = torch.empty(1, int(n), dtype=torch.float32)
    _normal_rows(out, [member], seed=seed, tensor_id=tensor_id, offset=int(offset))
    return out.view(-1).to(device)


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
    if _touches_nothing(dst.numel(), offset=offset, chunk_subspace=chunk_subspace, subspace=subspace,
                        chunk_size=chunk_size):
        return dst
    flat_dst = kernel_array(dst.view(-1))
    flat_src = flat_dst if src is None else kernel_array(src.reshape(-1))
    use_torch_threads()
    perturb_kernel(
        flat_dst, flat_src, *_chunk_owner(chunk_subspace), _subspace_word(subspace), chunk_size,
        offset, float(sigma), int(member), int(tensor_id), *philox_key(seed),
    )
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

    A tile only regenerates the noise of the members that own its subspace, each under its own key (`seeds`) or
    the one `seed`. `rounding="stochastic"` stores bfloat16/float16 targets with unbiased stochastic rounding.
    """
    plan = v.accumulate_plan(
        target, seed=seed, seeds=seeds, members=members, coeffs=coeffs, tensor_id=tensor_id, offset=offset,
        chunk_subspace=chunk_subspace, member_subspaces=member_subspaces, chunk_size=chunk_size, rounding=rounding,
    )
    if target.numel() == 0 or plan.streams.shape[0] == 0:
        return target
    subspaces = torch.zeros(plan.streams.shape[0], dtype=torch.int64) if plan.subspaces is None else plan.subspaces
    order = torch.argsort(subspaces, stable=True)  # members of one subspace form one segment
    use_torch_threads()
    accumulate_kernel(
        kernel_array(target.view(-1)), *_chunk_owner(chunk_subspace), chunk_size, subspaces[order].numpy(),
        plan.streams[order].numpy(), plan.coeffs[order].numpy(), offset, rounding == "stochastic", int(tensor_id),
        *philox_key(plan.rounding_seed),
    )
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
    partition, of the whole tensor."""
    v.check_storage("src", src)
    v.check_chunking(src, offset=offset, chunk_subspace=chunk_subspace, subspace=subspace, chunk_size=chunk_size)
    if _touches_nothing(src.numel(), offset=offset, chunk_subspace=chunk_subspace, subspace=subspace,
                        chunk_size=chunk_size):
        return src.new_empty(0)
    use_torch_threads()
    # Slice copies move raw bits, NaN payloads included, in any element type.
    packed = backup_kernel(
        kernel_array(src.view(-1)), *_chunk_owner(chunk_subspace), _subspace_word(subspace), chunk_size, offset
    )
    return torch.from_numpy(packed).view(src.dtype)


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
    if _touches_nothing(dst.numel(), offset=offset, chunk_subspace=chunk_subspace, subspace=subspace,
                        chunk_size=chunk_size):
        v.check_backup_size(backup, expected=0, subspace=subspace)
        return dst
    use_torch_threads()
    needed = restore_kernel(
        kernel_array(dst.view(-1)), kernel_array(backup.view(-1)), *_chunk_owner(chunk_subspace),
        _subspace_word(subspace), chunk_size, offset,
    )
    v.check_backup_size(backup, expected=needed, subspace=subspace)  # the kernel wrote nothing if this fails
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
    population, a_size = len(member_list), out_features * rank
    A = torch.empty(population, a_size, dtype=torch.float32)
    B = torch.empty(population, in_features * rank, dtype=torch.float32)
    _normal_rows(A, member_list, seed=seed, tensor_id=tensor_id, offset=0)
    _normal_rows(B, member_list, seed=seed, tensor_id=tensor_id, offset=a_size)
    A = A.view(population, out_features, rank).to(device)
    B = B.view(population, in_features, rank).to(device)
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

    One base GEMM for the whole batch (torch), then the per-row rank-r correction added in place (one pass).
    `check_rows=False` skips the row_member range check (done once per step by the caller).
    """
    rank = v.check_lowrank_linear_args(x, weight, A, B, row_member, sigma, check_rows=check_rows)
    out = F.linear(x, weight, bias).contiguous()
    if out.numel() == 0:
        return out
    batch, out_features, in_features = x.shape[0], weight.shape[0], weight.shape[1]
    tokens = out.numel() // (batch * out_features)
    # One job of rows (a decode step on a small model) or one thread: no parallel region. Each row is computed
    # the same way by either kernel, so the bits do not depend on the choice.
    serial = out.numel() <= ROWS_PER_JOB * out_features or use_torch_threads() == 1
    (lowrank_correction_serial if serial else lowrank_correction_kernel)(
        kernel_array(out).reshape(-1, out_features), kernel_array(x.contiguous()).reshape(-1, in_features),
        A.contiguous().numpy(), B.contiguous().numpy(), row_member.contiguous().numpy(), tokens,
        float(sigma) / math.sqrt(rank),
    )
    return out


def store_stochastic_(
    dst: torch.Tensor, values: torch.Tensor, *, seed: int, tensor_id: int, offset: int = 0
) -> torch.Tensor:
    """Store float32 `values` into 16-bit `dst` (same numel, contiguous) with unbiased stochastic rounding."""
    if dst.numel():
        use_torch_threads()
        store_stochastic_kernel(
            kernel_array(dst.view(-1)), values.contiguous().view(-1).numpy(), offset, int(tensor_id), *philox_key(seed)
        )
    return dst


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

    `seed` and `tensor_id` only key the stochastic rounding stream (a compiled store loop).
    """
    updated = v.lowrank_updated(weight, A=A, B=B, coeffs=coeffs, scale=scale, rounding=rounding)
    if rounding == "stochastic":
        return store_stochastic_(weight, updated, seed=seed, tensor_id=tensor_id)
    return weight.copy_(updated)



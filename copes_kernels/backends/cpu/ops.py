"""The compiled CPU backend's per-tensor ops: view the storage, call a kernel. The public signatures, docstrings and
argument checks are `copes_kernels._public_ops`' (every backend's); the contract is the reference's (the oracle
they are tested against). Threads follow `torch.get_num_threads()` (capped by numba's pool).
"""

from __future__ import annotations

import functools
import math
import threading
from collections.abc import Sequence

import numba
import numpy as np
import torch
import torch.nn.functional as F

from copes_kernels import _public_ops as ops
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


@ops.perturb_op
def perturb_(dst, src, seed, member, tensor_id, sigma, offset, chunk_subspace, subspace, chunk_size) -> None:
    if _touches_nothing(dst.numel(), offset=offset, chunk_subspace=chunk_subspace, subspace=subspace,
                        chunk_size=chunk_size):
        return
    flat_dst = kernel_array(dst.view(-1))
    flat_src = flat_dst if src is None else kernel_array(src.reshape(-1))
    use_torch_threads()
    perturb_kernel(
        flat_dst, flat_src, *_chunk_owner(chunk_subspace), _subspace_word(subspace), chunk_size,
        offset, float(sigma), int(member), int(tensor_id), *philox_key(seed),
    )


@ops.accumulate_op
def accumulate_(target, plan, tensor_id, offset, chunk_subspace, chunk_size, rounding) -> None:
    """a tile regenerates the noise of its subspace's members only."""
    if target.numel() == 0 or plan.streams.shape[0] == 0:
        return
    subspaces = torch.zeros(plan.streams.shape[0], dtype=torch.int64) if plan.subspaces is None else plan.subspaces
    order = torch.argsort(subspaces, stable=True)  # members of one subspace form one segment
    use_torch_threads()
    accumulate_kernel(
        kernel_array(target.view(-1)), *_chunk_owner(chunk_subspace), chunk_size, subspaces[order].numpy(),
        plan.streams[order].numpy(), plan.coeffs[order].numpy(), offset, rounding == "stochastic", int(tensor_id),
        *philox_key(plan.rounding_seed),
    )


@ops.backup_op
def backup_chunks(src, chunk_subspace, subspace, chunk_size, offset) -> torch.Tensor:
    if _touches_nothing(src.numel(), offset=offset, chunk_subspace=chunk_subspace, subspace=subspace,
                        chunk_size=chunk_size):
        return src.new_empty(0)
    use_torch_threads()
    # Slice copies move raw bits, NaN payloads included, in any element type.
    packed = backup_kernel(
        kernel_array(src.view(-1)), *_chunk_owner(chunk_subspace), _subspace_word(subspace), chunk_size, offset
    )
    return torch.from_numpy(packed).view(src.dtype)


@ops.restore_op
def restore_chunks_(dst, backup, chunk_subspace, subspace, chunk_size, offset) -> None:
    if _touches_nothing(dst.numel(), offset=offset, chunk_subspace=chunk_subspace, subspace=subspace,
                        chunk_size=chunk_size):
        v.check_backup_size(backup, expected=0, subspace=subspace)
        return
    use_torch_threads()
    needed = restore_kernel(
        kernel_array(dst.view(-1)), kernel_array(backup.view(-1)), *_chunk_owner(chunk_subspace),
        _subspace_word(subspace), chunk_size, offset,
    )
    v.check_backup_size(backup, expected=needed, subspace=subspace)  # the kernel wrote nothing if this fails


@ops.lowrank_factors_op
def lowrank_factors(seed, members, tensor_id, out_features, in_features, rank, device) -> tuple[torch.Tensor, ...]:
    population, a_size = len(members), out_features * rank
    A = torch.empty(population, a_size, dtype=torch.float32)
    B = torch.empty(population, in_features * rank, dtype=torch.float32)
    _normal_rows(A, members, seed=seed, tensor_id=tensor_id, offset=0)
    _normal_rows(B, members, seed=seed, tensor_id=tensor_id, offset=a_size)
    return A.view(population, out_features, rank).to(device), B.view(population, in_features, rank).to(device)


@ops.lowrank_linear_op
def lowrank_linear(x, weight, bias, A, B, row_member, sigma, rank) -> torch.Tensor:
    """one base GEMM (torch), then the per-row rank-r correction added in place (one pass)."""
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


lowrank_accumulate_ = ops.lowrank_accumulate_op(store_stochastic_)  # stochastic rounding: a compiled store loop

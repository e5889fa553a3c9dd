"""EGGROLL low-rank ES: factors from the noise stream, the batched population forward, the one-GEMM update.

    A_j = eps_j[0 : m r] as [m, r],  B_j = eps_j[m r : (m + n) r] as [n, r]           (stream of seed, member j, tensor)
    y_b = x_b W^T + bias + sigma / sqrt(r) * (x_b B_j) A_j^T,   j = row_member[b]   (weights never modified)
    W  += scale * sum_j coeffs[j] A_j B_j^T = scale * [A_1 c_1 ... A_P c_P] [B_1 ... B_P]^T   (one GEMM)

The forward runs one base GEMM for the whole batch with torch, then one Triton program per (row, token tile)
projects its tokens onto B_j (a [tokens, r] float32 tile kept in registers) and streams A_j over the output
columns, adding the correction to the base output in place. Two ways to form the two small products:
  tl.dot (USE_DOT)  prefill with rank >= 16: tensor cores, but tl.dot needs >= 16 along every side, so the token
                    tile and the rank are padded to 16 (padded entries load as zeros);
  FMA               decode (fewer than 16 tokens a row) or a small rank: broadcast-multiply and reduce on the fp32
                    units, with the token tile and the rank only padded to their next power of two, so a 1-token
                    row is not a 16-token tile and rank 1 is not rank 16.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from copes_kernels import _public_ops as ops
from copes_kernels.backends.triton.rng import fill_normal_rows_
from copes_kernels.backends.triton.shared import store_stochastic_, to_storage

MIN_DOT = 16  # tl.dot's smallest tile side
# Input columns per step of the projection and output columns per step of the correction: 64 fp32 columns of a
# 16-token tile is a 4 KB operand, small enough to double-buffer and large enough to keep loads coalesced.
BLOCK_IN = 64
BLOCK_OUT = 64
MAX_TOKEN_TILE = 16  # prefill tiles of 16 tokens: 32 and 64 spill on sm_90 (255 registers, 80-200 bytes of stack)
# FMA path: the [tokens, BLOCK_IN, rank] product tile stays at <= 1024 fp32 values (8 per thread at 4 warps).
FMA_TILE_VALUES = 1024 // BLOCK_IN


@triton.jit
def _add(a, b):
    return a + b


@triton.jit
def _lowrank_correction_kernel(
    out_ptr,
    x_ptr,
    a_ptr,
    b_ptr,
    row_member_ptr,
    tokens,
    in_features,
    out_features,
    rank,
    scale,
    BLOCK_T: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_O: tl.constexpr,
    RANK: tl.constexpr,
    USE_DOT: tl.constexpr,
):
    """out[b, t, :] += scale * (x[b, t, :] B_m) A_m^T for one row b (member m) and BLOCK_T of its tokens.

    The FMA path reduces with tl.reduce over our own combine (tl.sum's is jitted at `import triton`, which may
    precede the interpreter, see rng.counter_words)."""
    pid = tl.program_id(0).to(tl.int64)
    token_tiles = (tokens + BLOCK_T - 1) // BLOCK_T  # not tl.cdiv, a @triton.jit helper (see rng.counter_words)
    row = pid // token_tiles
    token = (pid % token_tiles) * BLOCK_T + tl.arange(0, BLOCK_T).to(tl.int64)
    token_mask = token < tokens
    member = tl.load(row_member_ptr + row)
    r = tl.arange(0, RANK)
    rank_mask = r < rank

    x_rows = x_ptr + (row * tokens + token) * in_features
    b_member = b_ptr + member * in_features * rank
    projected = tl.full([BLOCK_T, RANK], 0.0, tl.float32)
    for k_start in range(0, in_features, BLOCK_K):
        k = k_start + tl.arange(0, BLOCK_K)
        k_mask = k < in_features
        x = tl.load(x_rows[:, None] + k[None, :], mask=token_mask[:, None] & k_mask[None, :], other=0.0)
        b = tl.load(b_member + k[:, None] * rank + r[None, :], mask=k_mask[:, None] & rank_mask[None, :], other=0.0)
        if USE_DOT:
            projected += tl.dot(x.to(tl.float32), b, input_precision="ieee")
        else:
            projected += tl.reduce(x.to(tl.float32)[:, :, None] * b[None, :, :], 1, _add)

    out_rows = out_ptr + (row * tokens + token) * out_features
    a_member = a_ptr + member * out_features * rank
    for o_start in range(0, out_features, BLOCK_O):
        o = o_start + tl.arange(0, BLOCK_O)
        o_mask = o < out_features
        a_t = tl.load(a_member + o[None, :] * rank + r[:, None], mask=rank_mask[:, None] & o_mask[None, :], other=0.0)
        if USE_DOT:
            correction = tl.dot(projected, a_t, input_precision="ieee")  # [BLOCK_T, BLOCK_O]
        else:
            correction = tl.reduce(projected[:, :, None] * a_t[None, :, :], 1, _add)
        mask = token_mask[:, None] & o_mask[None, :]
        base = tl.load(out_rows[:, None] + o[None, :], mask=mask).to(tl.float32)
        result = to_storage(base + scale * correction, out_ptr.dtype.element_ty)
        tl.store(out_rows[:, None] + o[None, :], result, mask=mask)


# ----------------------------------------------------------------------------------------------- host side


@ops.lowrank_factors_op
def lowrank_factors(seed, members, tensor_id, out_features, in_features, rank, device) -> tuple[torch.Tensor, ...]:
    """one launch per factor."""
    device = torch.device("cpu") if device is None else torch.device(device)
    member_rows = torch.tensor(members, dtype=torch.int64, device=device)
    population = len(members)
    A = torch.empty(population, out_features * rank, dtype=torch.float32, device=device)
    B = torch.empty(population, in_features * rank, dtype=torch.float32, device=device)
    fill_normal_rows_(A, member_rows, seed=seed, tensor_id=tensor_id, offset=0)
    fill_normal_rows_(B, member_rows, seed=seed, tensor_id=tensor_id, offset=out_features * rank)
    return A.view(population, out_features, rank), B.view(population, in_features, rank)


@ops.lowrank_linear_op
def lowrank_linear(x, weight, bias, A, B, row_member, sigma, rank) -> torch.Tensor:
    """one base GEMM (torch) plus the per-row rank-r correction (one Triton launch)."""
    out = F.linear(x, weight, bias).contiguous()
    batch, out_features, in_features = x.shape[0], weight.shape[0], weight.shape[1]
    tokens = out.numel() // max(batch * out_features, 1)
    if out.numel() == 0:
        return out
    use_dot = tokens >= MIN_DOT and rank >= MIN_DOT
    if use_dot:
        token_tile, rank_tile = min(MAX_TOKEN_TILE, triton.next_power_of_2(tokens)), triton.next_power_of_2(rank)
    else:
        rank_tile = triton.next_power_of_2(rank)
        token_tile = max(1, min(triton.next_power_of_2(tokens), FMA_TILE_VALUES // rank_tile))
    _lowrank_correction_kernel[(batch * triton.cdiv(tokens, token_tile),)](
        out, x.contiguous(), A.contiguous(), B.contiguous(), row_member.contiguous(), tokens, in_features, out_features,
        rank, float(sigma) / math.sqrt(rank), BLOCK_T=token_tile, BLOCK_K=BLOCK_IN, BLOCK_O=BLOCK_OUT,
        RANK=rank_tile, USE_DOT=use_dot,
    )
    return out


lowrank_accumulate_ = ops.lowrank_accumulate_op(store_stochastic_)  # stochastic rounding: a Triton store kernel

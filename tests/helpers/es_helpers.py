"""Helpers the strategy and parameter-space tests share: the dtypes ES supports, a toy MLP, flat weight snapshots,
and `dense_member_noise`, the dense reference that materialises one member's noise on one subspace with ck.normal,
independently of the chunked kernels."""

from __future__ import annotations

import torch
from torch import nn

import copes_kernels as ck
from copes.es.params import ParameterSpace

DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def dense_member_noise(
    numel: int, chunk_subspace: torch.Tensor, *, chunk_size: int, subspace: int, seed: int, member: int, tensor_id: int
) -> torch.Tensor:
    """eps_member of one parameter (flat, float32), zeroed outside `subspace`'s chunks."""
    eps = ck.normal(numel, seed=seed, member=member, tensor_id=tensor_id)
    in_subspace = chunk_subspace.to(torch.int64).repeat_interleave(chunk_size)[:numel] == subspace
    return torch.where(in_subspace, eps, torch.zeros_like(eps))


def toy_mlp(dtype: torch.dtype = torch.float32, seed: int = 0) -> nn.Module:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return nn.Sequential(nn.Linear(5, 17), nn.Tanh(), nn.Linear(17, 3)).to(dtype)


def flat_weights(space: ParameterSpace) -> list[torch.Tensor]:
    return [p.data.detach().reshape(-1).clone() for p in space.parameters]

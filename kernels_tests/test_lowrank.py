"""EGGROLL ops: factors from the noise stream, the batched population forward and the one-GEMM update."""

from __future__ import annotations

import math

import pytest
import torch

import copes_kernels as ck
from kernels_tests.helpers import assert_close_in_ulps, bits, ops

SEED, TENSOR_ID = 99, 7
OUT_FEATURES, IN_FEATURES = 29, 37  # odd, and not multiples of the kernel's 64-column tiles
MEMBERS = [4, 0, 9]


def factors(rank: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    return ck.lowrank_factors(
        seed=SEED, member=MEMBERS, tensor_id=TENSOR_ID, out_features=OUT_FEATURES, in_features=IN_FEATURES, rank=rank,
        device=device,
    )


@pytest.mark.parametrize("rank", [1, 4])
def test_factors_are_the_members_noise_streams(backend: str, device: torch.device, rank: int) -> None:
    A, B = factors(rank, device)
    assert A.shape == (len(MEMBERS), OUT_FEATURES, rank) and B.shape == (len(MEMBERS), IN_FEATURES, rank)
    for j, member in enumerate(MEMBERS):
        length = (OUT_FEATURES + IN_FEATURES) * rank
        stream = ops("reference").normal(length, seed=SEED, member=member, tensor_id=TENSOR_ID)
        torch.testing.assert_close(A[j].cpu().reshape(-1), stream[: OUT_FEATURES * rank], rtol=0, atol=1e-5)
        torch.testing.assert_close(B[j].cpu().reshape(-1), stream[OUT_FEATURES * rank :], rtol=0, atol=1e-5)
    single_A, single_B = ck.lowrank_factors(
        seed=SEED, member=MEMBERS[1], tensor_id=TENSOR_ID, out_features=OUT_FEATURES, in_features=IN_FEATURES,
        rank=rank, device=device,
    )
    assert torch.equal(single_A, A[1]) and torch.equal(single_B, B[1])


def dense_population_forward(x, weight, bias, A, B, row_member, sigma) -> torch.Tensor:
    """Row b: x_b (W + sigma A_m B_m^T / sqrt(r))^T + bias, every perturbed matrix materialised, in float64."""
    rank = A.shape[-1]
    rows = []
    for b in range(x.shape[0]):
        m = int(row_member[b])
        perturbed = weight.double() + sigma / math.sqrt(rank) * (A[m].double() @ B[m].double().T)
        rows.append(x[b].double() @ perturbed.T + (0 if bias is None else bias.double()))
    return torch.stack(rows)


@pytest.mark.parametrize("rank", [1, 2, 3, 7, 16])
@pytest.mark.parametrize(
    "x_shape", [(5, IN_FEATURES), (4, 3, IN_FEATURES), (2, 70, IN_FEATURES)], ids=["rows", "tokens", "prefill"]
)
def test_lowrank_linear_equals_the_perturbed_weight_per_row(
    backend: str, device: torch.device, rank: int, x_shape: tuple[int, ...]
) -> None:
    generator = torch.Generator().manual_seed(rank)
    x = torch.randn(x_shape, generator=generator).to(device)
    weight = torch.randn(OUT_FEATURES, IN_FEATURES, generator=generator).to(device)
    bias = torch.randn(OUT_FEATURES, generator=generator).to(device)
    A, B = factors(rank, device)
    row_member = torch.tensor([2, 0, 2, 1, 0][: x_shape[0]], device=device)  # repeated and out-of-order members
    y = ck.lowrank_linear(x, weight, bias, A=A, B=B, row_member=row_member, sigma=0.3)
    expected = dense_population_forward(x.cpu(), weight.cpu(), bias.cpu(), A.cpu(), B.cpu(), row_member.cpu(), 0.3)
    assert y.shape == (*x_shape[:-1], OUT_FEATURES) and y.dtype == torch.float32
    torch.testing.assert_close(y.cpu().double(), expected, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_lowrank_linear_in_half_precision(backend: str, device: torch.device, dtype: torch.dtype) -> None:
    """The half-precision base GEMM is torch's; the float32 correction on top of it is ours, rounded once."""
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(3, 4, IN_FEATURES, generator=generator).to(dtype).to(device)
    weight = (torch.randn(OUT_FEATURES, IN_FEATURES, generator=generator) / 6).to(dtype).to(device)
    A, B = factors(3, device)
    row_member = torch.tensor([1, 2, 0], device=device)
    y = ck.lowrank_linear(x, weight, None, A=A, B=B, row_member=row_member, sigma=0.1)
    base = torch.nn.functional.linear(x, weight).cpu().double()
    zero_weight = torch.zeros(OUT_FEATURES, IN_FEATURES)
    correction = dense_population_forward(x.cpu(), zero_weight, None, A.cpu(), B.cpu(), row_member.cpu(), 0.1)
    assert y.dtype == dtype
    assert_close_in_ulps(y.cpu().reshape(-1), (base + correction).reshape(-1), ulps=1, atol=1e-5)


def test_lowrank_accumulate_equals_sum_of_outer_products(backend: str, device: torch.device) -> None:
    A, B = factors(5, device)
    weight = torch.randn(OUT_FEATURES, IN_FEATURES, generator=torch.Generator().manual_seed(1)).to(device)
    coeffs, scale = [0.5, -1.5, 2.0], 0.01
    expected = weight.cpu().double() + scale * sum(
        c * (A[j].cpu().double() @ B[j].cpu().double().T) for j, c in enumerate(coeffs)
    )
    ck.lowrank_accumulate_(weight, A=A, B=B, coeffs=coeffs, scale=scale)
    torch.testing.assert_close(weight.cpu().double(), expected, rtol=1e-6, atol=1e-6)


def test_lowrank_accumulate_stochastic_rounding_matches_reference_bits(device: torch.device) -> None:
    """Both backends form the same float32 GEMM result on one device and round it with the same uniforms."""
    A, B = factors(2, device)
    start = torch.randn(OUT_FEATURES, IN_FEATURES, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
    start = start.to(device)
    results = {}
    for backend_name in ("reference", "triton"):
        weight = start.clone()
        ops(backend_name).lowrank_accumulate_(
            weight, A=A, B=B, coeffs=[1.0, -1.0, 0.5], scale=1e-3, rounding="stochastic", seed=5, tensor_id=TENSOR_ID
        )
        results[backend_name] = weight
    assert torch.equal(bits(results["triton"]), bits(results["reference"]))
    assert not torch.equal(results["triton"], start)

"""accumulate_: equals a dense reference that materialises the noise; slicing; stochastic rounding."""

from __future__ import annotations

import pytest
import torch

import copes_kernels as ck
from copes_kernels.backends import reference
from copes_kernels.backends.triton import shared as _shared
from copes_kernels.rng import ROUNDING_STREAM
from kernels_tests.helpers import BIG_OFFSET, DTYPES, ODD_SIZES, assert_close_in_ulps, bits, ops
from kernels_tests.test_perturb import random_partition, random_values, selected_mask

SEED = 0xFEEDFACE12345
TENSOR_ID = 42
MEMBERS = [0, 5, 9, 2, 7, 11, 3, 1]
COEFFS = [0.3, -0.2, 0.25, 0.5, -1.0, 0.125, -0.4, 0.2]
MEMBER_SUBSPACES = [0, 2, 2, 0, 2, 0, 0, 2]  # subspace 1 (of 3) has no members: its chunks must stay untouched


def dense_expected(
    target: torch.Tensor,
    *,
    offset: int,
    chunk_size: int,
    chunk_subspace: torch.Tensor | None,
    members: list[int],
    coeffs: list[float],
    member_subspaces: list[int],
) -> torch.Tensor:
    """float64 target + sum_j c_j [subspace(chunk(i)) == s_j] eps_j(i), with every eps_j materialised in full."""
    numel = target.numel()
    expected = target.cpu().double()
    for j, (member, coeff) in enumerate(zip(members, coeffs)):
        eps = reference.normal(numel, seed=SEED, member=member, tensor_id=TENSOR_ID, offset=offset).double()
        owned = (
            torch.ones(numel, dtype=torch.bool)
            if chunk_subspace is None
            else selected_mask(numel, offset, chunk_size, chunk_subspace, member_subspaces[j])
        )
        expected += coeff * eps * owned
    return expected


CASES = [(n, BIG_OFFSET, 1000) for n in ODD_SIZES[:3]] + [(ODD_SIZES[3], 3, ck.DEFAULT_CHUNK_SIZE)]


@pytest.mark.parametrize("numel, offset, chunk_size", CASES)
@pytest.mark.parametrize("partitioned", [False, True], ids=["whole", "subspaces"])
def test_accumulate_fp32_equals_dense_reference(
    backend: str, device: torch.device, numel: int, offset: int, chunk_size: int, partitioned: bool
) -> None:
    # The 2^20 + 3 case keeps three members so the interpreter stays quick; small cases use all eight.
    count = 3 if numel > 1 << 16 else len(MEMBERS)
    members, coeffs, member_subspaces = MEMBERS[:count], COEFFS[:count], MEMBER_SUBSPACES[:count]
    target = random_values(numel, torch.float32, device)
    chunk_subspace = random_partition(numel, offset, chunk_size, device) if partitioned else None
    expected = dense_expected(
        target, offset=offset, chunk_size=chunk_size, chunk_subspace=chunk_subspace, members=members, coeffs=coeffs,
        member_subspaces=member_subspaces,
    )
    ck.accumulate_(
        target, seed=SEED, members=members, coeffs=coeffs, tensor_id=TENSOR_ID, offset=offset,
        chunk_subspace=chunk_subspace, member_subspaces=member_subspaces if partitioned else None,
        chunk_size=chunk_size,
    )
    update_norm = (expected - random_values(numel, torch.float32, "cpu").double()).norm()
    error_norm = (target.cpu().double() - expected).norm()
    assert error_norm <= 1e-5 * update_norm  # relative to the update; exact when no member owns the elements


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_accumulate_touches_only_chunks_whose_subspace_has_members(
    backend: str, device: torch.device, dtype: torch.dtype
) -> None:
    numel, offset, chunk_size = 6007, 11, 128
    target = random_values(numel, dtype, device)
    chunk_subspace = random_partition(numel, offset, chunk_size, device)
    memberless = selected_mask(numel, offset, chunk_size, chunk_subspace, 1)
    target[memberless.to(device)] = float("nan")  # chunks no member owns: must come back as the same NaN bits
    before = target.clone()
    expected = dense_expected(
        target, offset=offset, chunk_size=chunk_size, chunk_subspace=chunk_subspace, members=MEMBERS, coeffs=COEFFS,
        member_subspaces=MEMBER_SUBSPACES,
    )
    ck.accumulate_(
        target, seed=SEED, members=MEMBERS, coeffs=COEFFS, tensor_id=TENSOR_ID, offset=offset,
        chunk_subspace=chunk_subspace, member_subspaces=MEMBER_SUBSPACES, chunk_size=chunk_size,
    )
    assert torch.equal(bits(target.cpu())[memberless], bits(before.cpu())[memberless])
    assert_close_in_ulps(target.cpu()[~memberless], expected[~memberless], ulps=1, atol=1e-5)


@pytest.mark.parametrize("rounding", ["nearest", "stochastic"])
def test_accumulate_in_slices_equals_whole(backend: str, device: torch.device, rounding: str) -> None:
    numel, offset, chunk_size = 9001, BIG_OFFSET - 2, 700
    original = random_values(numel, torch.bfloat16, device)
    chunk_subspace = random_partition(numel, offset, chunk_size, device)
    args = dict(
        seed=SEED, members=MEMBERS, coeffs=COEFFS, tensor_id=TENSOR_ID, chunk_subspace=chunk_subspace,
        member_subspaces=MEMBER_SUBSPACES, chunk_size=chunk_size, rounding=rounding,
    )
    whole = ck.accumulate_(original.clone(), offset=offset, **args)
    sliced = original.clone()
    for start, stop in [(0, 3), (3, 5000), (5000, numel)]:
        ck.accumulate_(sliced[start:stop], offset=offset + start, **args)
    assert torch.equal(bits(sliced), bits(whole))


@pytest.mark.parametrize("rounding", ["nearest", "stochastic"])
def test_zero_coefficients_leave_the_target_bit_identical(backend: str, device: torch.device, rounding: str) -> None:
    """x + 0 is representable, so neither rounding mode may move it (stochastic rounding only acts on an error)."""
    target = random_values(5000, torch.float16, device)
    before = target.clone()
    ck.accumulate_(target, seed=SEED, members=[1, 2], coeffs=[0.0, 0.0], tensor_id=TENSOR_ID, rounding=rounding)
    assert torch.equal(bits(target), bits(before))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("offset", [0, 3, BIG_OFFSET])
def test_stochastic_store_kernel_matches_reference_bits(device: torch.device, dtype: torch.dtype, offset: int) -> None:
    """Same float32 values and the same ROUNDING_STREAM uniforms: the kernel and the reference round identically."""
    values = torch.randn(5003, generator=torch.Generator().manual_seed(3)) * 3
    values[:6] = torch.tensor([0.0, -0.0, 1e-9, -1e-9, 1.0, -2.5])  # zeros, below the smallest subnormal, exact values
    values[6] = torch.finfo(dtype).max * 0.9999  # next to the largest finite value
    kernel = torch.full(values.shape, float("nan"), dtype=dtype, device=device)
    _shared.store_stochastic_(kernel, values.to(device), seed=SEED, tensor_id=TENSOR_ID, offset=offset)
    uniforms = reference.uniform_stream(
        values.numel(), seed=SEED, stream=ROUNDING_STREAM, tensor_id=TENSOR_ID, offset=offset, device="cpu"
    )
    assert torch.equal(bits(kernel.cpu()), bits(reference.round_stochastic(values, dtype, uniforms)))


@pytest.mark.slow  # 200 seeded roundings of 64K values per backend: tens of seconds on 2 cores; CI runs it
@pytest.mark.parametrize("backend_name", ["reference", "triton"])
def test_stochastic_rounding_is_unbiased_where_nearest_is_not(backend_name: str, device: torch.device) -> None:
    """Values 0.3 ulp above a bfloat16 number: the mean of 200 independently seeded roundings recovers them."""
    draws, numel = 200, 1000
    base = torch.linspace(-4, 4, numel).to(torch.bfloat16)
    gap = torch.exp2(torch.floor(torch.log2(base.float().abs())) - 7)  # bfloat16 spacing in each value's binade
    values = base.float() + 0.3 * gap * torch.sign(base.float())  # away from zero: stays inside the binade
    total = torch.zeros(numel, dtype=torch.float64)
    for draw in range(draws):
        if backend_name == "reference":
            u = reference.uniform_stream(numel, seed=draw, stream=ROUNDING_STREAM, tensor_id=1, offset=0, device="cpu")
            rounded = reference.round_stochastic(values, torch.bfloat16, u)
        else:
            rounded = _shared.store_stochastic_(
                torch.empty(numel, dtype=torch.bfloat16, device=device), values.to(device), seed=draw, tensor_id=1
            ).cpu()
        total += rounded.double()
    mean_error = (total / draws - values.double()).abs()
    assert bool((mean_error < gap.double() / 5).all())  # > 5 standard errors of the mean; nearest is off by 0.3 gap
    nearest_error = (values.to(torch.bfloat16).double() - values.double()).abs()
    assert bool((nearest_error > gap.double() / 5).all())


def test_stochastic_update_keeps_sub_ulp_steps(backend: str, device: torch.device) -> None:
    """An update 8x smaller than a bfloat16 ulp: nearest rounding drops it, stochastic rounding keeps it on average.

    Weights sit at 1.5 (bfloat16 spacing 2^-7 on both sides). The regression slope of the stored change on the
    exact step is ~0 for nearest and 1 +- 4/sqrt(n) for stochastic rounding.
    """
    numel, start, coeff = 1 << 16, 1.5, 2.0**-7 / 8
    steps = coeff * ops("reference").normal(numel, seed=SEED, member=4, tensor_id=TENSOR_ID).double()
    slopes = {}
    for rounding in ("nearest", "stochastic"):
        target = torch.full((numel,), start, dtype=torch.bfloat16, device=device)
        ck.accumulate_(target, seed=SEED, members=[4], coeffs=[coeff], tensor_id=TENSOR_ID, rounding=rounding)
        moved = target.cpu().double() - start
        slopes[rounding] = float((moved * steps).sum() / (steps * steps).sum())
    assert abs(slopes["stochastic"] - 1) < 0.1
    assert abs(slopes["nearest"]) < 0.1


def test_no_members_is_a_no_op(backend: str, device: torch.device) -> None:
    target = random_values(100, torch.float32, device)
    before = target.clone()
    ck.accumulate_(target, seed=SEED, members=[], coeffs=[], tensor_id=TENSOR_ID)
    assert torch.equal(target, before)

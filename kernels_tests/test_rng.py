"""The noise contract: Philox words, uniforms, normals, stream statistics, and no recompiles per seed."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import triton

import copes_kernels as ck
from copes_kernels.backends import reference
from copes_kernels.backends.triton import perturb, update
from copes_kernels.backends.triton import rng as triton_rng
from copes_kernels.backends.triton import shared as _shared
from copes_kernels.rng import MASK32, words_to_normal, words_to_uniform
from kernels_tests.helpers import BIG_OFFSET, ODD_SIZES, ops

# Random123's known-answer vectors for Philox4x32-10 (kat_vectors): counter, key -> words.
KAT_VECTORS = [
    ((0, 0, 0, 0), (0, 0), (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
    ((MASK32,) * 4, (MASK32, MASK32), (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)),
    (
        (0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344),
        (0xA4093822, 0x299F31D0),
        (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1),
    ),
]
STATS_SAMPLES = 1 << 16


@pytest.mark.parametrize("backend_name", ["reference", "triton"])
def test_philox_matches_random123_known_answers(backend_name: str, device: torch.device) -> None:
    counters = torch.tensor([c for c, _, _ in KAT_VECTORS], dtype=torch.int64, device=device)
    keys = torch.tensor([k for _, k, _ in KAT_VECTORS], dtype=torch.int64, device=device)
    expected = torch.tensor([w for _, _, w in KAT_VECTORS], dtype=torch.int64)
    assert torch.equal(ops(backend_name).philox4x32_10(counters, keys).cpu(), expected)


def test_philox_words_bit_identical_across_backends(device: torch.device) -> None:
    generator = torch.Generator().manual_seed(0)
    counters = torch.randint(0, 1 << 32, (3, 1000, 4), generator=generator, dtype=torch.int64)
    counters[0, :, 1] = torch.arange(1000) + 1  # q past 2^32: the counter's high word in use
    keys = torch.randint(0, 1 << 32, (1000, 2), generator=generator, dtype=torch.int64)  # broadcast over dim 0
    words = triton_rng.philox4x32_10(counters.to(device), keys.to(device))
    assert words.shape == (3, 1000, 4)
    assert torch.equal(words.cpu(), reference.philox4x32_10(counters, keys))


@pytest.mark.parametrize("n", ODD_SIZES)
@pytest.mark.parametrize("offset", [0, 3, BIG_OFFSET])
def test_normals_agree_across_backends(n: int, offset: int, device: torch.device) -> None:
    ids = dict(seed=(1 << 63) + 17, member=MASK32 - 2, tensor_id=0xDEADBEEF, offset=offset)
    kernel = triton_rng.normal(n, device=device, **ids)
    expected = reference.normal(n, **ids)
    assert kernel.dtype == torch.float32 and kernel.shape == (n,)
    torch.testing.assert_close(kernel.cpu(), expected, rtol=0, atol=1e-5)


def test_normals_follow_the_written_contract() -> None:
    """eps(i) is word i & 3 of block i >> 2 through the documented uniform and Box-Muller formulas (float64 here)."""
    seed, member, tensor_id, offset, n = 0x0123456789ABCDEF, 9, 77, BIG_OFFSET - 2, 11
    counters = torch.tensor(
        [[q & MASK32, q >> 32, member, tensor_id] for q in range(offset >> 2, ((offset + n - 1) >> 2) + 1)]
    )
    words = reference.philox4x32_10(counters, torch.tensor([seed & MASK32, seed >> 32])).double()
    u = torch.floor(words / 256) * 2.0**-24 + 2.0**-25
    radius, angle = torch.sqrt(-2 * torch.log(u[:, 0::2])), 2 * np.pi * u[:, 1::2]
    blocks = torch.stack([radius[:, 0] * torch.cos(angle[:, 0]), radius[:, 0] * torch.sin(angle[:, 0]),
                          radius[:, 1] * torch.cos(angle[:, 1]), radius[:, 1] * torch.sin(angle[:, 1])], dim=-1)
    expected = blocks.reshape(-1)[offset % 4 : offset % 4 + n]
    actual = ck.normal(n, seed=seed, member=member, tensor_id=tensor_id, offset=offset).double()
    torch.testing.assert_close(actual, expected, rtol=0, atol=1e-5)


def test_triton_normals_stay_within_2e_6_of_the_exact_contract(device: torch.device) -> None:
    """The kernels' own ln / sincos polynomials (no libdevice) against the contract in float64, over 2^16 draws."""
    seed, member, tensor_id, n = 0xFEEDFACE12345678, 3, 0x51ED, STATS_SAMPLES
    q = torch.arange(n // 4)
    counters = torch.stack([q, torch.zeros_like(q), torch.full_like(q, member), torch.full_like(q, tensor_id)], -1)
    words = reference.philox4x32_10(counters, torch.tensor([seed & MASK32, seed >> 32])).double()
    u = (torch.floor(words / 256) * 2.0**-24 + 2.0**-25).float().double()  # the contract's u: rounded to float32
    radius, angle = torch.sqrt(-2 * torch.log(u[:, 0::2])), 2 * np.pi * u[:, 1::2]
    exact = torch.stack([radius[:, 0] * torch.cos(angle[:, 0]), radius[:, 0] * torch.sin(angle[:, 0]),
                         radius[:, 1] * torch.cos(angle[:, 1]), radius[:, 1] * torch.sin(angle[:, 1])], -1)
    # On the suite's device: compiled Triton (a CUDA machine) takes CUDA tensors only.
    kernel = triton_rng.normal(n, seed=seed, member=member, tensor_id=tensor_id, device=device).double().cpu()
    torch.testing.assert_close(kernel, exact.reshape(-1), rtol=0, atol=2e-6)


def test_extreme_words_give_finite_uniforms_and_normals() -> None:
    words = torch.tensor([[0, 0, MASK32, MASK32]], dtype=torch.int64)
    u = words_to_uniform(words)
    assert u[0, 0].item() == 2.0**-25 and u[0, 2].item() == 1.0  # never 0; the top word rounds to exactly 1
    assert torch.isfinite(words_to_normal(words)).all()


@pytest.mark.parametrize("backend_name", ["reference", "triton"])
def test_stream_is_chunking_invariant(backend_name: str, device: torch.device) -> None:
    """A slice generated at an offset is bit-identical to the same elements of the whole stream."""
    normal = ops(backend_name).normal
    ids = dict(seed=5, member=1, tensor_id=2, device=device)
    whole = normal(4097, offset=BIG_OFFSET, **ids)
    for start, stop in [(0, 1), (1, 7), (3, 4097), (2048, 2051)]:
        part = normal(stop - start, offset=BIG_OFFSET + start, **ids)
        assert torch.equal(part, whole[start:stop])


@pytest.mark.parametrize("backend_name", ["reference", "triton"])
def test_stream_statistics(backend_name: str, device: torch.device) -> None:
    import scipy.stats  # here, not at the top: the other contract tests run without scipy

    samples = ops(backend_name).normal(STATS_SAMPLES, seed=2024, member=3, tensor_id=11, device=device).double().cpu()
    tolerance = 5 / np.sqrt(STATS_SAMPLES)  # five standard errors
    assert abs(samples.mean().item()) < tolerance
    assert abs(samples.var().item() - 1) < 5 * np.sqrt(2 / STATS_SAMPLES)
    assert scipy.stats.kstest(samples.numpy(), "norm").pvalue > 1e-3
    # Each of the four Box-Muller outputs is itself standard normal (no lane is biased).
    for lane in range(4):
        assert scipy.stats.kstest(samples[lane::4].numpy(), "norm").pvalue > 1e-3


@pytest.mark.parametrize(
    "changed",
    [{"seed": 2025}, {"member": 4}, {"tensor_id": 12}, {"offset": 1}, {"offset": 4}, {"offset": 1 << 32}],
)
def test_streams_are_independent(changed: dict) -> None:
    base = dict(seed=2024, member=3, tensor_id=11, offset=0)
    first = ck.normal(STATS_SAMPLES, **base).double()
    second = ck.normal(STATS_SAMPLES, **{**base, **changed}).double()
    assert not torch.equal(first, second)
    correlation = torch.corrcoef(torch.stack([first, second]))[0, 1].item()
    assert abs(correlation) < 5 / np.sqrt(STATS_SAMPLES)


def test_stream_ids_reach_kernels_as_int32() -> None:
    """Triton types an int argument by value; every id (and offset) is passed as an i32 so seeds never recompile."""
    mangle = triton.runtime.jit.mangle_type
    for seed in (0, 1, 16, (1 << 31), (1 << 32) + 1, (1 << 63) + 5, (1 << 64) - 1):
        for member, tensor_id in ((0, 1), (MASK32, MASK32 - 1)):
            args = (*triton_rng.stream_args(seed, member, tensor_id), *triton_rng.int64_args(BIG_OFFSET + seed % 97))
            assert all(mangle(arg) == "i32" for arg in args), (seed, member, tensor_id, args)


def _do_not_specialize(kernel) -> list:
    """The do_not_specialize list of a compiled (JITFunction) or interpreted kernel."""
    return list(getattr(kernel, "do_not_specialize", None) or kernel.kwargs["do_not_specialize"])


@pytest.mark.parametrize(
    "kernel",
    [
        triton_rng._normal_rows_kernel,
        perturb._perturb_kernel,
        update._accumulate_kernel,
        _shared._store_stochastic_kernel,
    ],
    ids=lambda kernel: kernel.fn.__name__,
)
def test_stream_arguments_are_not_specialised(kernel) -> None:
    stream_params = set(triton_rng.STREAM_ARGS) & set(kernel.arg_names)
    assert {"seed_lo", "seed_hi", "tensor_id"} <= stream_params
    assert stream_params <= set(_do_not_specialize(kernel))


@pytest.mark.gpu
def test_new_seed_does_not_recompile() -> None:
    """Two seeds (one past 2^31, one past 2^63), two members, two offsets: one compiled perturb kernel."""
    device = torch.device("cuda")
    x = torch.zeros(1 << 16, device=device)
    cache = perturb._perturb_kernel.device_caches[device.index or 0][0]
    for seed, member, offset in ((1, 0, 0), ((1 << 31) + 3, 7, 1 << 20), ((1 << 63) + 9, MASK32, BIG_OFFSET - 1)):
        perturb.perturb_(x, seed=seed, member=member, tensor_id=seed % 1000, sigma=0.1, offset=offset)
        torch.cuda.synchronize()
        if seed == 1:
            compiled = len(cache)
    assert len(cache) == compiled

"""perturb_, backup_chunks and restore_chunks_: contract values, selectivity, slicing, exact restore."""

from __future__ import annotations

import pytest
import torch

import copes_kernels as ck
from kernels_tests.helpers import BIG_OFFSET, DTYPES, ODD_SIZES, assert_close_in_ulps, bits, ops, poisoned

SIGMA = 0.5
NUM_SUBSPACES = 3
IDS = dict(seed=(1 << 40) + 3, member=6, tensor_id=0xC0FFEE)


def random_partition(numel: int, offset: int, chunk_size: int, device: torch.device, seed: int = 0) -> torch.Tensor:
    """chunk -> subspace for every chunk up to element offset + numel (a random, not balanced, assignment)."""
    generator = torch.Generator().manual_seed(seed)
    chunks = ck.num_chunks(offset + numel, chunk_size)
    return torch.randint(0, NUM_SUBSPACES, (chunks,), generator=generator).to(torch.int16).to(device)


def selected_mask(
    numel: int, offset: int, chunk_size: int, chunk_subspace: torch.Tensor, subspace: int
) -> torch.Tensor:
    chunk_of = (torch.arange(numel) + offset) // chunk_size
    return chunk_subspace.cpu()[chunk_of] == subspace


def random_values(numel: int, dtype: torch.dtype, device: torch.device, seed: int = 1) -> torch.Tensor:
    return torch.randn(numel, generator=torch.Generator().manual_seed(seed)).to(dtype).to(device)


# Chunks of 1000 elements (not a multiple of 4: runs start mid Philox block) at an offset past 2^32 for the
# small sizes; the 2^20 + 3 case uses the default 64K chunks from an unaligned offset.
CASES = [(n, BIG_OFFSET, 1000) for n in ODD_SIZES[:3]] + [(ODD_SIZES[3], 3, ck.DEFAULT_CHUNK_SIZE)]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("numel, offset, chunk_size", CASES)
@pytest.mark.parametrize("partitioned", [False, True], ids=["whole", "subspace"])
def test_perturb_writes_src_plus_sigma_eps_only_in_its_subspace(
    backend: str, device: torch.device, dtype: torch.dtype, numel: int, offset: int, chunk_size: int, partitioned: bool
) -> None:
    src = random_values(numel, dtype, device)
    chunk_subspace = random_partition(numel, offset, chunk_size, device) if partitioned else None
    subspace = 1 if partitioned else None
    dst = poisoned(numel, dtype, device)
    out = ck.perturb_(
        dst, src=src, sigma=SIGMA, offset=offset, chunk_subspace=chunk_subspace, subspace=subspace,
        chunk_size=chunk_size, **IDS,
    )
    assert out is dst
    written = torch.ones(numel, dtype=torch.bool)
    if partitioned:
        written = selected_mask(numel, offset, chunk_size, chunk_subspace, subspace)
    eps = ops("reference").normal(numel, offset=offset, **IDS)
    expected = src.cpu().double() + SIGMA * eps.double()
    # One rounding to storage, plus the backends' ~1e-6 disagreement on eps.
    assert_close_in_ulps(dst.cpu()[written], expected[written], ulps=1, atol=SIGMA * 2e-6)
    assert torch.isnan(dst.cpu()[~written]).all(), "an element outside the subspace was written"


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_perturb_in_place_leaves_other_chunks_bit_identical(
    backend: str, device: torch.device, dtype: torch.dtype
) -> None:
    numel, chunk_size = 9001, 256
    original = random_values(numel, dtype, device)
    original[::97] = float("nan")  # NaN payloads in untouched chunks must survive as is
    chunk_subspace = random_partition(numel, 0, chunk_size, device)
    x = original.clone()
    ck.perturb_(x, sigma=SIGMA, chunk_subspace=chunk_subspace, subspace=2, chunk_size=chunk_size, **IDS)
    written = selected_mask(numel, 0, chunk_size, chunk_subspace, 2)
    assert torch.equal(bits(x.cpu())[~written], bits(original.cpu())[~written])
    changed = (bits(x.cpu()) != bits(original.cpu()))[written]
    assert changed.float().mean() > 0.9  # sigma = 0.5 moves almost every value by more than an ulp


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_perturb_in_slices_equals_whole(backend: str, device: torch.device, dtype: torch.dtype) -> None:
    """A parameter processed in slices (shards, chunked processing) gets exactly the noise it gets whole."""
    numel, offset, chunk_size = 10_007, BIG_OFFSET, 999
    src = random_values(numel, dtype, device)
    chunk_subspace = random_partition(numel, offset, chunk_size, device)
    whole = src.clone()
    chunking = dict(chunk_subspace=chunk_subspace, subspace=0, chunk_size=chunk_size)
    ck.perturb_(whole, sigma=SIGMA, offset=offset, **chunking, **IDS)
    sliced = src.clone()
    for start, stop in [(0, 1), (1, 4003), (4003, 4005), (4005, numel)]:
        ck.perturb_(sliced[start:stop], sigma=SIGMA, offset=offset + start, **chunking, **IDS)
    assert torch.equal(bits(sliced), bits(whole))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_backup_packs_the_subspace_like_the_reference(device: torch.device, dtype: torch.dtype) -> None:
    numel, offset, chunk_size = 5003, 7, 100
    src = random_values(numel, dtype, device)
    src[::13] = float("nan")
    chunk_subspace = random_partition(numel, offset, chunk_size, device)
    args = dict(chunk_subspace=chunk_subspace, subspace=1, chunk_size=chunk_size, offset=offset)
    packed = ops("triton").backup_chunks(src, **args)
    expected = ops("reference").backup_chunks(src.cpu(), **{**args, "chunk_subspace": chunk_subspace.cpu()})
    assert packed.dtype == dtype and packed.dim() == 1
    assert torch.equal(bits(packed.cpu()), bits(expected))
    assert packed.numel() == int(selected_mask(numel, offset, chunk_size, chunk_subspace, 1).sum())


def special_values(numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Random values salted with the bit patterns a float round trip could lose: NaN payloads, -0, inf, subnormals."""
    x = random_values(numel, dtype, device)
    raw = bits(x)
    nan_payload = 0x7FC00123 if dtype == torch.float32 else 0x7E01 if dtype == torch.float16 else 0x7FC1
    raw[0::11] = nan_payload
    raw[1::11] = -(1 << (8 * x.element_size() - 1))  # -0.0
    x[2::11] = float("-inf")
    x[3::11] = torch.finfo(dtype).tiny / 4  # subnormal
    return x


@pytest.mark.slow  # 20-48 s in the default lane on 2 cores (interpreter-mode Triton); CI runs it
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_restore_is_bit_exact_after_many_cycles(backend: str, device: torch.device, dtype: torch.dtype) -> None:
    # 1000 cycles wherever kernels run at speed; Triton's CPU interpreter pays ~20 ms per program, so it runs 25
    # cycles of the very same bit-copy kernel.
    cycles = 25 if backend == "triton" and device.type == "cpu" else 1000
    numel, offset, chunk_size = 4097, 5, 500
    original = special_values(numel, dtype, device)
    chunk_subspace = random_partition(numel, offset, chunk_size, device)
    chunking = dict(chunk_subspace=chunk_subspace, chunk_size=chunk_size, offset=offset)
    backups = [ck.backup_chunks(original, subspace=k, **chunking) for k in range(NUM_SUBSPACES)]
    x = original.clone()
    for cycle in range(cycles):
        subspace = cycle % NUM_SUBSPACES
        ck.perturb_(x, seed=cycle, member=cycle, tensor_id=3, sigma=SIGMA, subspace=subspace, **chunking)
        ck.restore_chunks_(x, backups[subspace], subspace=subspace, **chunking)
    assert torch.equal(bits(x), bits(original))


def test_restore_accepts_a_backup_kept_on_the_host(backend: str, device: torch.device) -> None:
    """The backup may be offloaded to CPU memory; restore copies it back to the parameter's device on the way in."""
    numel, chunk_size = 1000, 64
    x = random_values(numel, torch.bfloat16, device)
    chunk_subspace = random_partition(numel, 0, chunk_size, device)
    backup = ck.backup_chunks(x, chunk_subspace=chunk_subspace, subspace=0, chunk_size=chunk_size).cpu()
    original = x.clone()
    ck.perturb_(x, sigma=1.0, chunk_subspace=chunk_subspace, subspace=0, chunk_size=chunk_size, **IDS)
    ck.restore_chunks_(x, backup, chunk_subspace=chunk_subspace, subspace=0, chunk_size=chunk_size)
    assert torch.equal(bits(x), bits(original))


def test_empty_subspace_and_empty_tensor_are_no_ops(backend: str, device: torch.device) -> None:
    x = random_values(300, torch.float32, device)
    nowhere = torch.zeros(ck.num_chunks(300, 100), dtype=torch.int16, device=device)  # every chunk in subspace 0
    before = x.clone()
    ck.perturb_(x, sigma=1.0, chunk_subspace=nowhere, subspace=1, chunk_size=100, **IDS)
    assert torch.equal(x, before)
    assert ck.backup_chunks(x, chunk_subspace=nowhere, subspace=1, chunk_size=100).numel() == 0
    empty = torch.empty(0, device=device)
    assert ck.perturb_(empty, sigma=1.0, **IDS).numel() == 0

"""multi_perturb_ / multi_restore_ / multi_accumulate_ over run tables: bit for bit the per-tensor ops' weights."""

from __future__ import annotations

import pytest
import torch

import copes_kernels as ck
from kernels_tests.helpers import DTYPES, bits

SEED = (1 << 40) + 7
NUM_SUBSPACES = 3
# Odd sizes around a chunk of 1000 elements (not a multiple of 4: rows start mid Philox block), and a tensor with
# fewer chunks than subspaces, so some subspaces own none of it.
CHUNKED_SIZES = (1, 7, 999, 4097, 2500)
# Default 64K chunks: a tensor of one partial chunk and one of several.
DEFAULT_SIZES = (5, 3 * ck.DEFAULT_CHUNK_SIZE + 11)
LAYOUTS = [(CHUNKED_SIZES, 1000), (DEFAULT_SIZES, ck.DEFAULT_CHUNK_SIZE)]


def make_group(sizes: tuple[int, ...], dtype: torch.dtype, device: torch.device, chunk_size: int):
    generator = torch.Generator().manual_seed(len(sizes))
    tensors = [torch.randn(n, generator=generator).to(dtype).to(device) for n in sizes]
    host = ck.make_partition([ck.num_chunks(n, chunk_size) for n in sizes], num_subspaces=NUM_SUBSPACES, seed=SEED)
    ids = [0xC0FFEE + 17 * k for k in range(len(sizes))]
    return tensors, ids, host


def table_for(tensors, ids, host, subspace, chunk_size) -> ck.RunTable:
    return ck.build_run_table(
        tensors, tensor_ids=ids, chunk_subspaces=[h.to(tensors[0].device) for h in host], host_chunk_subspaces=host,
        subspace=subspace, num_subspaces=NUM_SUBSPACES, chunk_size=chunk_size,
    )


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("sizes, chunk_size", LAYOUTS, ids=["chunks-1000", "chunks-64K"])
def test_perturb_and_restore_match_per_tensor_ops(backend: str, device, dtype, sizes, chunk_size) -> None:
    tensors, ids, host = make_group(sizes, dtype, device, chunk_size)
    original = [t.clone() for t in tensors]
    expected = [t.clone() for t in tensors]
    subspace = 1
    for tensor, tensor_id, part in zip(expected, ids, host):
        ck.perturb_(tensor, seed=SEED, member=5, tensor_id=tensor_id, sigma=0.25, chunk_subspace=part.to(device),
                    subspace=subspace, chunk_size=chunk_size)
    table = table_for(tensors, ids, host, subspace, chunk_size)
    backup = torch.full((table.backup_numel,), float("nan"), dtype=dtype, device=device)
    ck.multi_perturb_(table, seed=SEED, member=5, sigma=0.25, backup=backup)
    for got, want in zip(tensors, expected):
        assert torch.equal(bits(got), bits(want))
    packed = [ck.backup_chunks(t, chunk_subspace=p.to(device), subspace=subspace, chunk_size=chunk_size)
              for t, p in zip(original, host)]
    assert torch.equal(bits(backup), bits(torch.cat(packed)))
    ck.multi_restore_(table, backup)
    for got, want in zip(tensors, original):
        assert torch.equal(bits(got), bits(want))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("sizes, chunk_size", [  # the 64K-chunk layout takes 20-48 s per case on 2 cores: CI only
    pytest.param(*LAYOUTS[0], id="chunks-1000"), pytest.param(*LAYOUTS[1], id="chunks-64K", marks=pytest.mark.slow)])
def test_accumulate_matches_per_tensor_op_and_measures_the_norm(backend: str, device, dtype, sizes, chunk_size) -> None:
    tensors, ids, host = make_group(sizes, dtype, device, chunk_size)
    # Subspace 2 has no members: its chunks must stay untouched.
    members, coeffs, member_subspaces = [3, 0, 8, 4], [0.5, -1.25, 0.75, 2.0], [1, 0, 0, 1]
    rounding = "nearest" if dtype == torch.float32 else "stochastic"
    before = [t.clone() for t in tensors]
    expected = [t.clone() for t in tensors]
    for tensor, tensor_id, part in zip(expected, ids, host):
        ck.accumulate_(tensor, seed=SEED, members=members, coeffs=coeffs, tensor_id=tensor_id,
                       chunk_subspace=part.to(device), member_subspaces=member_subspaces, chunk_size=chunk_size,
                       rounding=rounding)
    table = table_for(tensors, ids, host, None, chunk_size)
    squared = ck.multi_accumulate_(table, seed=SEED, members=members, coeffs=coeffs, member_subspaces=member_subspaces,
                                   rounding=rounding)
    for got, want in zip(tensors, expected):
        assert torch.equal(bits(got), bits(want))
    exact = sum(float(torch.sum((a.double() - b.double()) ** 2)) for a, b in zip(tensors, before))
    assert squared.dtype == torch.float64 and squared.device == torch.device(device)
    assert float(squared) == pytest.approx(exact, rel=1e-5)


def test_table_layout_and_errors(device) -> None:
    tensors, ids, host = make_group(CHUNKED_SIZES, torch.float32, device, 1000)
    table = table_for(tensors, ids, host, 0, 1000)
    runs = table.runs.cpu()
    assert table.backup_numel == int((runs[:, 2] - runs[:, 1]).sum()) == sum(table.backup_sizes)
    assert bool((runs[:, 4] == 0).all()) and table.pointers.numel() == len(CHUNKED_SIZES)
    with pytest.raises(ValueError, match="backup has 3 elements"):
        ck.multi_restore_(table, torch.zeros(3, device=device))
    with pytest.raises(ValueError, match="one subspace"):
        ck.multi_perturb_(table_for(tensors, ids, host, None, 1000), seed=1, member=0, sigma=0.1)
    with pytest.raises(ValueError, match="share one device and dtype"):
        ck.build_run_table([tensors[0], tensors[1].double()], tensor_ids=ids[:2], chunk_subspaces=host[:2],
                           host_chunk_subspaces=host[:2], subspace=0, num_subspaces=NUM_SUBSPACES, chunk_size=1000)
    with pytest.raises(ValueError, match=r"member_subspaces must be in \[0, 3\)"):
        ck.multi_accumulate_(table_for(tensors, ids, host, None, 1000), seed=1, members=[0], coeffs=[1.0],
                             member_subspaces=[3])
    with pytest.raises(TypeError, match="RunTable"):
        ck.multi_restore_(tensors[0], tensors[0])

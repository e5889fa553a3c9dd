"""make_partition: balanced to within one chunk, deterministic from the seed, fresh for every seed."""

from __future__ import annotations

import pytest
import torch

import copes_kernels as ck
from copes_kernels.partition import PARTITION_DTYPE

CHUNK_COUNTS = [0, 1, 7, 4097, 33]  # odd counts, and a parameter too small to own a chunk


@pytest.mark.parametrize("num_subspaces", [1, 2, 3, 4, 7])
@pytest.mark.parametrize("seed", [0, 1, (1 << 64) - 1])
def test_partition_is_balanced_within_one_chunk(num_subspaces: int, seed: int) -> None:
    parts = ck.make_partition(CHUNK_COUNTS, num_subspaces=num_subspaces, seed=seed)
    assert [p.numel() for p in parts] == CHUNK_COUNTS
    assert all(p.dtype == PARTITION_DTYPE for p in parts)
    owners = torch.cat(parts).long()
    assert int(owners.min()) >= 0 and int(owners.max()) < num_subspaces
    sizes = torch.bincount(owners, minlength=num_subspaces)
    assert int(sizes.max() - sizes.min()) <= 1


def test_partition_is_deterministic_and_fresh_per_seed() -> None:
    first = torch.cat(ck.make_partition(CHUNK_COUNTS, num_subspaces=4, seed=123))
    again = torch.cat(ck.make_partition(CHUNK_COUNTS, num_subspaces=4, seed=123))
    assert torch.equal(first, again)
    agreements = [
        (torch.cat(ck.make_partition(CHUNK_COUNTS, num_subspaces=4, seed=seed)) == first).float().mean().item()
        for seed in range(124, 134)
    ]
    # Independent partitions agree on a chunk with probability 1/K = 0.25 (4138 chunks: std ~0.007).
    assert all(abs(agreement - 0.25) < 0.05 for agreement in agreements)


def test_partition_mixes_every_parameter() -> None:
    """No parameter is left to one subspace: within a big tensor every subspace gets about its share."""
    parts = ck.make_partition([4097, 4097], num_subspaces=4, seed=9)
    for part in parts:
        share = torch.bincount(part.long(), minlength=4).double() / part.numel()
        assert bool(((share - 0.25).abs() < 0.05).all())


def test_partition_lands_on_the_requested_device(device: torch.device) -> None:
    parts = ck.make_partition([5, 6], num_subspaces=2, seed=0, device=device)
    assert all(p.device.type == device.type for p in parts)


@pytest.mark.parametrize(
    "counts, num_subspaces, message",
    [([4], 0, "num_subspaces must be in"), ([4], 40000, "num_subspaces must be in"), ([2, 1], 4, "cannot be split"),
     ([3, -1], 2, "chunk_counts must be >= 0")],
)
def test_partition_rejects_bad_arguments(counts: list[int], num_subspaces: int, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        ck.make_partition(counts, num_subspaces=num_subspaces, seed=0)

"""copes.es.selection's sub-ulp test: the per-bit-pattern count gives the per-element formula's fraction."""

from __future__ import annotations

import math

import pytest
import torch

from copes.es.selection import rounds_away_fraction


def reference_rounds_away_fraction(tensor: torch.Tensor, sigma: float) -> float:
    """The plain twin: per element, the probability that N(0, sigma^2) noise stays within half the gap to each
    neighbour, averaged."""
    values = tensor.reshape(-1)
    gaps = [(torch.nextafter(values, torch.full_like(values, bound)) - values).double().abs()
            for bound in (math.inf, -math.inf)]
    scale = 2 * math.sqrt(2) * sigma
    return float(((torch.erf(gaps[0] / scale) + torch.erf(gaps[1] / scale)) / 2).mean())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("sigma", [1e-3, 2e-3, 1e-1])
def test_counting_bit_patterns_gives_the_per_element_fraction(dtype, sigma):
    generator = torch.Generator().manual_seed(0)
    # Weights near 1 (norms: most round away), small ones (most do not), negatives, zeros, an odd length.
    tensor = torch.cat([1 + 0.01 * torch.randn(1001, generator=generator),
                        0.02 * torch.randn(3001, generator=generator), -torch.rand(257, generator=generator),
                        torch.zeros(5)]).to(dtype)
    assert rounds_away_fraction(tensor, sigma) == pytest.approx(reference_rounds_away_fraction(tensor, sigma),
                                                                rel=1e-12, abs=1e-12)
    # Sliced counting adds up to the whole.
    assert rounds_away_fraction(tensor, sigma, slice_elements=100) == pytest.approx(
        rounds_away_fraction(tensor, sigma), rel=1e-12)


def test_only_16_bit_tensors_are_taken():
    with pytest.raises(ValueError, match="16-bit"):
        rounds_away_fraction(torch.ones(4), 1e-3)

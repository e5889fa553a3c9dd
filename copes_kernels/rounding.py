"""Stochastic rounding's public stream: what `update(..., rounding="stochastic")` draws, so a loop written densely
(docs/embedding.md, "A dense loop, bit for bit") can store its float32 sum exactly as the fused ops do."""

from __future__ import annotations

import torch

from copes_kernels.backends.reference import round_stochastic
from copes_kernels.backends.reference import uniform_stream as _uniform_stream
from copes_kernels.rng import ROUNDING_STREAM


def rounding_uniforms(n: int, *, seed: int, tensor_id: int, offset: int = 0, device: str | torch.device = "cpu"
                      ) -> torch.Tensor:
    """The float32 uniforms that stochastic rounding of elements offset .. offset + n - 1 of tensor `tensor_id`
    uses in an update keyed by `seed` (the update's `seed`, or its first member's seed with `seeds=`)."""
    return _uniform_stream(n, seed=seed, stream=ROUNDING_STREAM, tensor_id=tensor_id, offset=offset, device=device)


__all__ = ["ROUNDING_STREAM", "round_stochastic", "rounding_uniforms"]

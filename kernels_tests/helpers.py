"""Shared test utilities: both backends' ops side by side, poisoned buffers, tolerances in storage ulps."""

from __future__ import annotations

import importlib
from types import ModuleType, SimpleNamespace

import torch

from copes_kernels.backends import reference
from copes_kernels.backends.triton import lowrank, perturb, update
from copes_kernels.backends.triton import rng as triton_rng

DTYPES = (torch.float32, torch.bfloat16, torch.float16)
ODD_SIZES = (1, 7, 4097, (1 << 20) + 3)
BIG_OFFSET = (1 << 32) + 5  # element index past 2^32: the counter's high word is non-zero

# The Triton launchers, by public name (the dispatcher's own table would hide which backend ran).
TRITON_OPS = {
    "philox4x32_10": triton_rng.philox4x32_10,
    "normal": triton_rng.normal,
    "perturb_": perturb.perturb_,
    "backup_chunks": perturb.backup_chunks,
    "restore_chunks_": perturb.restore_chunks_,
    "accumulate_": update.accumulate_,
    "lowrank_factors": lowrank.lowrank_factors,
    "lowrank_linear": lowrank.lowrank_linear,
    "lowrank_accumulate_": lowrank.lowrank_accumulate_,
}


def ops(backend: str) -> ModuleType | SimpleNamespace:
    """The op table of one backend: the reference module, the compiled CPU module or the Triton launchers."""
    if backend == "cpu":  # imported here: it is numba, which a bare GPU image may lack
        return importlib.import_module("copes_kernels.backends.cpu")
    return reference if backend == "reference" else SimpleNamespace(**TRITON_OPS)


def poisoned(n: int, dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """A NaN-filled buffer: any element an op should write but does not stays NaN."""
    return torch.full((n,), float("nan"), dtype=dtype, device=device)


def storage_ulp(values: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Spacing of `dtype` at each |value| (float32 result): the tolerance for a single rounding step."""
    mantissa_bits = {torch.float32: 23, torch.bfloat16: 7, torch.float16: 10}[dtype]
    tiny = torch.finfo(dtype).tiny
    magnitude = values.float().abs().clamp_min(tiny)
    return torch.exp2(torch.floor(torch.log2(magnitude)) - mantissa_bits)


def assert_close_in_ulps(actual: torch.Tensor, expected: torch.Tensor, *, ulps: float, atol: float = 0.0) -> None:
    """|actual - expected| <= ulps * ulp(expected in actual's dtype) + atol, elementwise, no NaN anywhere."""
    assert not torch.isnan(actual).any(), "NaN in result: an element was not written"
    error = (actual.double() - expected.double()).abs()
    bound = ulps * storage_ulp(expected, actual.dtype).double() + atol
    worst = int(torch.argmax(error - bound))
    assert bool((error <= bound).all()), (
        f"element {worst}: {actual[worst].item()} vs {expected[worst].item()} "
        f"(error {error[worst].item():.3g}, bound {bound[worst].item():.3g})"
    )


def bits(t: torch.Tensor) -> torch.Tensor:
    """Integer view for bit-exact comparisons (NaN payloads and signed zeros included)."""
    return t.view({2: torch.int16, 4: torch.int32}[t.element_size()])

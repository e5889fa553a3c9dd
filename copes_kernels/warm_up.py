"""Compile the compiled CPU backend ahead of a run, and say how long it took.

numba compiles a kernel on its first call (10-20 s for the whole backend in a fresh install; then it loads from
its on-disk cache in well under a second). A trainer calls `warm_up` before its first step and reports the seconds
as their own phase, so a first run's compile is neither charged to its perturb and update phases nor unnoticed.
"""

from __future__ import annotations

import importlib
import time
from collections.abc import Iterable

import torch

from copes_kernels.dispatch import backend_for


def warm_up(dtypes: Iterable[torch.dtype] = (torch.float32,), *, device: torch.device | str = "cpu") -> float:
    """Compile (or load from the on-disk cache) every compiled-CPU kernel for the storage `dtypes`; returns the
    seconds taken. 0.0 where data on `device` does not run the compiled CPU backend (CUDA, COPES_BACKEND=reference,
    numba missing): nothing to compile there (Triton compiles per launch shape, on the GPU)."""
    if backend_for(device) != "cpu":
        return 0.0
    start = time.perf_counter()
    importlib.import_module("copes_kernels.backends.cpu.warm").compile_kernels(tuple(dtypes))
    return time.perf_counter() - start

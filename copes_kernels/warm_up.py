"""Compile the compiled CPU backend ahead of a run, and say how long it took.

numba compiles a kernel on its first call (10-20 s for the whole backend in a fresh install; then it loads from
its on-disk cache in well under a second). A trainer calls `warm_up` before its first step and reports the seconds
as their own phase, so a first run's compile is neither charged to its perturb and update phases nor unnoticed.
"""

from __future__ import annotations

import importlib
import subprocess
import sys
import time
from collections.abc import Iterable

import torch

from copes_kernels.dispatch import backend_for


def warm_up(dtypes: Iterable[torch.dtype] = (torch.float32,), *, device: torch.device | str = "cpu",
            in_child: bool = False) -> float:
    """Compile (or load from the on-disk cache) every compiled-CPU kernel for the storage `dtypes`; returns the
    seconds taken. 0.0 where data on `device` does not run the compiled CPU backend (CUDA, COPES_BACKEND=reference,
    numba missing): nothing to compile there (Triton compiles per launch shape, on the GPU).

    `in_child`: compile in a child process first, then load the cache here. A process that compiles keeps numba's
    LLVM state for its life (measured: +0.11 GiB of RSS against loading the cache; at 4B a first run peaked at 10.93
    GiB against 10.79 with a warm cache), while the child costs a few seconds of start-up: for large processes. If
    the child cannot fill the cache (no writable cache folder), the kernels compile here as without it."""
    if backend_for(device) != "cpu":
        return 0.0
    start = time.perf_counter()
    dtypes = tuple(dtypes)
    if in_child:
        names = [str(dtype).removeprefix("torch.") for dtype in dtypes]
        script = ("import sys, torch; from copes_kernels.backends.cpu.warm import compile_kernels; "
                  "compile_kernels(tuple(getattr(torch, name) for name in sys.argv[1:]))")
        subprocess.run([sys.executable, "-c", script, *names], check=False, capture_output=True)
    importlib.import_module("copes_kernels.backends.cpu.warm").compile_kernels(dtypes)
    return time.perf_counter() - start

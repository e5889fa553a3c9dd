"""Memory and exactness probes of the benchmarks: the resident-set / CUDA peak of a block, and bit-exact checks
that a perturb -> restore cycle gave the weights back."""

from __future__ import annotations

import ctypes
import re
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from copes.es.params import ParameterSpace

from .harness import DEVICE, synchronize

# glibc's mallopt parameter number for the mmap threshold (malloc.h: M_MMAP_THRESHOLD).
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD_BYTES = 64 * 1024


def _proc_status_bytes(field: str) -> int:
    status = Path("/proc/self/status").read_text()
    match = re.search(rf"^{field}:\s+(\d+) kB", status, flags=re.MULTILINE)
    if match is None:
        raise RuntimeError(f"/proc/self/status has no {field} line")
    return int(match.group(1)) * 1024


class PeakMemory:
    """Peak extra memory of a block over what was in use when it began; `held()` is the extra right now.

    CUDA: `torch.cuda.max_memory_allocated` (live tensor bytes, the allocator's own count).
    CPU (Linux): the resident-set high-water mark (VmHWM, reset through /proc/self/clear_refs) over the resident
    size at the start. Two glibc settings make the resident set follow the live tensors: `malloc_trim(0)` first
    returns the free heap pages earlier work left resident (reusing them would not show), and the mmap threshold
    is pinned to 64 KiB, so every tensor buffer is its own mapping and a freed one leaves the resident set at
    once. Pinning is process-wide and makes allocations a little slower: measure time before memory.

        with PeakMemory() as memory:
            work()
        memory.peak_bytes
    """

    _mmap_pinned = False

    def __init__(self) -> None:
        self.peak_bytes = 0
        self._start = 0

    @classmethod
    def _settle_host_allocator(cls) -> None:
        if not sys.platform.startswith("linux"):
            raise RuntimeError("CPU peak-memory measurement needs Linux (/proc/self/clear_refs and glibc)")
        libc = ctypes.CDLL("libc.so.6")
        if not cls._mmap_pinned:
            if libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES) != 1:
                raise RuntimeError("glibc refused mallopt(M_MMAP_THRESHOLD); CPU peak memory cannot be measured")
            cls._mmap_pinned = True
        libc.malloc_trim(0)

    def _current(self) -> int:
        if DEVICE.type == "cuda":
            return torch.cuda.memory_allocated(DEVICE)
        return _proc_status_bytes("VmRSS")

    def __enter__(self) -> PeakMemory:  # noqa: PYI034  (typing.Self needs Python 3.11; setup.py allows 3.10)
        synchronize()
        if DEVICE.type == "cuda":
            torch.cuda.reset_peak_memory_stats(DEVICE)
        else:
            self._settle_host_allocator()
            Path("/proc/self/clear_refs").write_text("5")  # 5: reset the peak resident set size to the current one
        self._start = self._current()
        return self

    def held(self) -> int:
        synchronize()
        if DEVICE.type != "cuda":
            ctypes.CDLL("libc.so.6").malloc_trim(0)  # freed small blocks would otherwise still count as resident
        return self._current() - self._start

    def __exit__(self, *exc_info: object) -> None:
        synchronize()
        peak = torch.cuda.max_memory_allocated(DEVICE) if DEVICE.type == "cuda" else _proc_status_bytes("VmHWM")
        self.peak_bytes = max(peak - self._start, 0)


@dataclass
class RestoreCheck:
    """How far the weights are from their saved copy after a perturb + restore."""

    mismatched: int  # elements that differ
    max_abs_error: float

    @property
    def exact(self) -> bool:
        return self.mismatched == 0


def snapshot(space: ParameterSpace) -> list[torch.Tensor]:
    """A copy of every trainable tensor (to check restores against)."""
    return [param.data.clone() for param in space.parameters]


def compare_weights(space: ParameterSpace, original: Sequence[torch.Tensor]) -> RestoreCheck:
    mismatched, max_error = 0, 0.0
    for param, before in zip(space.parameters, original):
        differs = param.data != before
        if differs.any():
            mismatched += int(differs.sum())
            max_error = max(max_error, float((param.data.float() - before.float()).abs().max()))
    return RestoreCheck(mismatched, max_error)


def reset_weights(space: ParameterSpace, original: Sequence[torch.Tensor]) -> None:
    for param, before in zip(space.parameters, original):
        param.data.copy_(before)



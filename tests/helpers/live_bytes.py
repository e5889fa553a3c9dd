"""Measured peak memory of torch code on any device, without an allocator's statistics: a dispatch mode that sees
every tensor an operator returns, counts its storage's bytes while any tensor on it lives, and keeps the high-water
mark. Storages that exist before (weights, inputs) are not counted, so the peak is what the code allocates."""

from __future__ import annotations

import weakref
from collections.abc import Iterable

import torch
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode


class LiveBytes(TorchDispatchMode):
    """`with LiveBytes(existing) as live: ...` then `live.peak` (bytes); `existing` are tensors not to count."""

    def __init__(self, existing: Iterable[torch.Tensor] = ()) -> None:
        super().__init__()
        self.skip = {tensor.untyped_storage()._cdata for tensor in existing}
        self.refs: dict[int, list[int]] = {}  # storage -> [live tensors on it, its bytes]
        self.live = self.peak = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for leaf in pytree.tree_leaves(out):
            if isinstance(leaf, torch.Tensor):
                self._track(leaf)
        return out

    def _track(self, tensor: torch.Tensor) -> None:
        storage = tensor.untyped_storage()
        key = storage._cdata
        if key in self.skip:
            return
        entry = self.refs.get(key)
        if entry is None:
            entry = self.refs[key] = [0, storage.nbytes()]
            self.live += entry[1]
            self.peak = max(self.peak, self.live)
        entry[0] += 1
        weakref.finalize(tensor, self._release, key)

    def _release(self, key: int) -> None:
        entry = self.refs.get(key)
        if entry is None:
            return
        entry[0] -= 1
        if entry[0] == 0:
            self.live -= entry[1]
            del self.refs[key]

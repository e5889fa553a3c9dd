"""The fast path for an OpenAI-ES loop: a fixed set of weight tensors perturbed, restored and updated in place.

    weights = WeightSet(tensors, tensor_ids)          # or WeightSet.from_named(model.named_parameters())
    weights.perturb(seed=s, member=j, sigma=sigma)    # w += sigma * eps_(s, j); the touched bits are backed up
    ...evaluate...
    weights.restore()                                 # w back, bit for bit (no subtract-restore drift in bf16)
    weights.update(coeffs, members=members, seeds=seeds, lr=lr, rounding="stochastic")
                                                      # w += lr * sum_j coeffs[j] * eps_(seeds[j], members[j])

eps_(seed, member) of a tensor is the noise stream of (seed, member, tensor_id) of docs/noise-contract.md. Each call
is one compiled launch per dtype group of the tensors (their run tables are built once, here), never one per
tensor, and the update is one pass over the weights whatever the number of members. This is standard one-sided ES
(K=1: every member perturbs every weight); CoPES subspaces and master weights live in copes.ParameterSpace, which
builds on the same ops.

The tensors are held by their storage. Each tensor is given once: two entries on one storage (a tied embedding and
`lm_head` from `state_dict()`) would get two noises and could not be restored exactly, so they are refused, naming
both. When one of them is reallocated (`model.to(...)`), the next op refuses to run, naming it: build a new WeightSet.
"""

from __future__ import annotations

import weakref
import zlib
from collections.abc import Iterable, Sequence

import torch

from copes_kernels._validate import ROUNDING_MODES
from copes_kernels.dispatch import multi_accumulate_, multi_perturb_, multi_restore_
from copes_kernels.partition import DEFAULT_CHUNK_SIZE
from copes_kernels.run_tables import STORAGE_DTYPES, RunTable, build_run_table

SIXTEEN_BIT = (torch.bfloat16, torch.float16)


def tensor_id_of(name: str) -> int:
    """A stable uint32 tensor id for a parameter name (CRC-32): the same name gets the same noise in every process."""
    return zlib.crc32(name.encode())


class WeightSet:
    """Tensors (float32 / bfloat16 / float16, contiguous, one device) with their tensor ids, grouped by dtype."""

    def __init__(
        self,
        tensors: Iterable[torch.Tensor],
        tensor_ids: Iterable[int],
        *,
        names: Sequence[str] | None = None,
        chunk_size: int = DEFAULT_CHUNK_SIZE,
    ) -> None:
        given, tensor_ids = list(tensors), [int(i) for i in tensor_ids]
        tensors = [t.detach() for t in given]  # detach: no grad-mode trap
        if len(tensors) != len(tensor_ids):
            raise ValueError(f"{len(tensors)} tensors but {len(tensor_ids)} tensor_ids: pass one id per tensor")
        if not tensors:
            raise ValueError("a WeightSet needs at least one tensor")
        self.names = list(names) if names is not None else [f"tensor {i}" for i in range(len(tensors))]
        if len(self.names) != len(tensors):
            raise ValueError(f"{len(tensors)} tensors but {len(self.names)} names: pass one name per tensor")
        if len(set(tensor_ids)) != len(tensor_ids):
            raise ValueError("tensor_ids must be distinct: two tensors with one id would get the same noise")
        if len({t.device for t in tensors}) != 1:
            raise ValueError("a WeightSet's tensors share one device: make one WeightSet per device")
        for name, tensor in zip(self.names, tensors):
            if tensor.dtype not in STORAGE_DTYPES or not tensor.is_contiguous():
                raise ValueError(f"{name} must be a contiguous float32, bfloat16 or float16 tensor, got a "
                                 f"{'' if tensor.is_contiguous() else 'non-contiguous '}{tensor.dtype} one")
        _refuse_aliases(self.names, tensors)
        # Where each given tensor's data lived when the set was built: a reallocation (`model.to(...)`) moves it, and
        # the run tables would then perturb the dead copy. Weak references: the set must not keep the model alive.
        self._given = [(weakref.ref(t), t.data_ptr(), t.dtype) for t in given]
        groups: dict[torch.dtype, list[int]] = {}
        for index, tensor in enumerate(tensors):
            groups.setdefault(tensor.dtype, []).append(index)
        self.tables: tuple[RunTable, ...] = tuple(
            build_run_table([tensors[i] for i in indices], tensor_ids=[tensor_ids[i] for i in indices],
                            chunk_size=chunk_size)
            for indices in groups.values()
        )
        self.backups = tuple(torch.empty(t.backup_numel, dtype=t.dtype, device=t.device) for t in self.tables)
        self.perturbed = False

    def _check_not_reallocated(self) -> None:
        for name, (reference, data_ptr, dtype) in zip(self.names, self._given):
            tensor = reference()
            if tensor is not None and (tensor.data_ptr() != data_ptr or tensor.dtype != dtype):
                raise RuntimeError(f"{name} was reallocated since this WeightSet was built (model.to(...)?): build a "
                                   "new WeightSet from the tensors as they are now")

    @classmethod
    def from_named(
        cls, named_tensors: Iterable[tuple[str, torch.Tensor]], *, chunk_size: int = DEFAULT_CHUNK_SIZE
    ) -> WeightSet:
        """From (name, tensor) pairs such as `model.named_parameters()`, each id the CRC-32 of its name."""
        pairs = list(named_tensors)
        names = [name for name, _ in pairs]
        seen: set[str] = set()
        for name in names:
            if name in seen:
                raise ValueError(f"the name {name!r} is given twice: pass each tensor once")
            seen.add(name)
        ids = [tensor_id_of(name) for name in names]
        if len(set(ids)) != len(ids):
            raise ValueError("two parameter names hash to one tensor id: pass tensor_ids to WeightSet yourself")
        return cls([tensor for _, tensor in pairs], ids, names=names, chunk_size=chunk_size)

    @property
    def numel(self) -> int:
        return sum(table.backup_numel for table in self.tables)

    def perturb(self, *, seed: int, member: int, sigma: float) -> None:
        """w += sigma * eps_(seed, member) on every tensor, after backing up their bits for `restore`."""
        if self.perturbed:
            raise RuntimeError("the weights are already perturbed: call restore() before the next perturb()")
        self._check_not_reallocated()
        for table, backup in zip(self.tables, self.backups):
            multi_perturb_(table, seed=seed, member=member, sigma=sigma, backup=backup)
        self.perturbed = True

    def restore(self) -> None:
        """Put back the bits `perturb` found: exact, whatever the dtype."""
        if not self.perturbed:
            raise RuntimeError("restore() without a perturb(): the weights are unperturbed")
        self._check_not_reallocated()
        for table, backup in zip(self.tables, self.backups):
            multi_restore_(table, backup)
        self.perturbed = False

    def update(
        self,
        coeffs: Iterable[float] | torch.Tensor,
        *,
        members: Iterable[int] | torch.Tensor,
        seed: int | None = None,
        seeds: Iterable[int] | torch.Tensor | None = None,
        lr: float = 1.0,
        rounding: str = "nearest",
    ) -> torch.Tensor:
        """w += lr * sum_j coeffs[j] * eps_j, one pass; eps_j keyed by (seed, members[j]) or (seeds[j], members[j]).

        `rounding="stochastic"` stores the 16-bit tensors with unbiased stochastic rounding (float32 ones round to
        nearest either way). Returns the squared L2 norm of the stored change (float64 0-d, on the device).
        """
        if self.perturbed:
            raise RuntimeError("update() on perturbed weights: call restore() first")
        if rounding not in ROUNDING_MODES:
            raise ValueError(f"rounding must be one of {ROUNDING_MODES}, got {rounding!r}")
        self._check_not_reallocated()
        scaled = torch.as_tensor(list(coeffs) if not isinstance(coeffs, torch.Tensor) else coeffs, dtype=torch.float32)
        scaled = scaled.cpu() * float(lr)
        members = members.cpu() if isinstance(members, torch.Tensor) else list(members)
        seeds = None if seeds is None else (seeds.cpu() if isinstance(seeds, torch.Tensor) else list(seeds))
        squared = torch.zeros((), dtype=torch.float64, device=self.tables[0].device)
        for table in self.tables:
            group_rounding = rounding if table.dtype in SIXTEEN_BIT else "nearest"
            squared = squared + multi_accumulate_(
                table, seed=seed, seeds=seeds, members=members, coeffs=scaled, rounding=group_rounding
            )
        return squared


def _refuse_aliases(names: Sequence[str], tensors: Sequence[torch.Tensor]) -> None:
    """Two entries whose bytes overlap (tied weights, views of one tensor) are an error naming both."""
    spans = sorted((t.data_ptr(), t.data_ptr() + t.numel() * t.element_size(), name)
                   for name, t in zip(names, tensors) if t.numel())
    for (_, end, name), (start, _, other) in zip(spans, spans[1:]):
        if start < end:
            raise ValueError(f"{name} and {other} share storage (tied weights?): give each tensor once, e.g. "
                             "model.named_parameters(), which skips the tied copy")

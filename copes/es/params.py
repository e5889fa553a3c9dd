"""The trainable-parameter space of a model: its chunks, backups and update precision, and the one writer of its
weights. Works on any `torch.nn.Module`; every tensor operation goes through the public `copes_kernels` API, so
CUDA parameters run the fused Triton kernels and CPU parameters the compiled (numba) CPU backend, or the torch
reference where numba is not installed. Which tensors it holds, and their noise ids, `copes.es.selection` decides.

`ParameterSpace` is the only code that writes trainable weights, for every strategy: perturb / restore (CoPES), the
noise-sum update (CoPES) and the low-rank update (EGGROLL family) all go through it, and so do the fp32
masters, stochastic rounding and the applied-norm measurement. Each write bumps the written tensors' autograd
version counters (`torch.autograd.graph.increment_version`), as torch's own in-place ops do: the kernels write
through raw addresses, and code that caches something derived from the weights (the vLLM engine's packed GEMM
copies) compares `tensor._version` to know when to rebuild it.

Restore (undo one member's perturbation):
  "device"    back up only the perturbed subspace's chunks (1/K of the weights) on the device; exact.
  "host"      the same packed chunks copied to host memory (pinned for CUDA), slice by slice; exact, and the
              device holds no backup at all (the paper's way of saving accelerator memory).
  "subtract"  re-apply the noise with -sigma; needs no memory but x + s e - s e != x in floating point.

Update precision (applies to 16-bit parameters; float32 ones always update in place, in float32):
  "native"         add the update in the parameter's dtype: a step below half an ulp is lost.
  "stochastic"     unbiased stochastic rounding of (w + delta) into bf16/fp16: tiny steps survive in expectation.
  "master_device"  an fp32 master copy on the parameter's device receives the update; the model gets its
                   round-to-nearest copy.
  "master_host"    the fp32 master lives in host memory (pinned for CUDA) and is staged to the device per slice.
  "auto"           "stochastic" (the strategy may choose a master mode instead, e.g. for Adam).

`stream_elements` processes every parameter in slices of that many elements (passing `offset`, so the noise
and the chunk layout are those of the whole tensor): it bounds the transient memory (backups, staged masters,
the update-norm snapshot) and gives bit-identical results for any slice size.

Multi-tensor launches (`multi_tensor=True`, the default; used where the fused Triton kernels or the compiled CPU
backend run): once per step
the CPU-side partition becomes device-resident run tables, one per subspace and dtype group plus one of every
chunk for the update (`copes_kernels.build_run_table`, one upload each). A member is then one perturb-and-backup
launch and one restore launch per dtype group, and an update one accumulate launch per group with the norm
measured in-kernel, whatever the number of tensors, and no host sync inside a member. They apply to restore
"device" and "subtract" and to the "native" / "stochastic" precisions without an update rule; with
`stream_elements`, to the update and to restore "subtract" only (slicing bounds backups, which those hold none
of). The other modes (and `multi_tensor=False`, the per-tensor path kept for comparison) loop over the
per-tensor ops slice by slice, with the same weights bit for bit.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch

import copes_kernels as ck
from copes.choices import RESTORE_MODES, UPDATE_PRECISIONS
from copes.es.selection import select_parameters, tensor_id_for, without_sub_ulp
from copes.failpoints import failpoint

# Weights from which the CPU kernels compile in a child process: numba's compile keeps ~0.1 GiB in the process
# that runs it, which matters against a multi-GiB model, while the child costs seconds only where its start-up is
# small beside loading such a model.
COMPILE_IN_CHILD_BYTES = 2**30

# (parameter index, offset of the slice in the parameter, fp32 gradient estimate of the slice) -> fp32 delta.
UpdateRule = Callable[[int, int, torch.Tensor], torch.Tensor]


@dataclass(eq=False)
class TrainableParameter:
    """One tensor ES moves. `data` shares the model's storage, so writes to it change the model."""

    name: str
    data: torch.Tensor
    tensor_id: int
    precision: str  # resolved: "native", "stochastic", "master_device" or "master_host"
    master: torch.Tensor | None = None  # fp32 copy, same shape, for the master precisions

    @property
    def numel(self) -> int:
        return self.data.numel()


@dataclass
class _Perturbation:
    """What restore() needs to undo the perturbation currently applied."""

    partition: list[torch.Tensor]
    seed: int
    member: int
    subspace: int
    sigma: float
    backups: list[torch.Tensor]  # packed chunks per slice, in slice order ("device" / "host"); per table when fused
    tables: list[ck.RunTable] | None = None  # the run tables of the fused path (None: the per-tensor path)


class ParameterSpace:
    """The trainable parameters of `model`, chunked for CoPES partitions, with perturb / restore / update."""

    def __init__(
        self,
        model: torch.nn.Module,
        include: str | Sequence[str] | None = None,
        exclude: str | Sequence[str] | None = None,
        chunk_size: int = ck.DEFAULT_CHUNK_SIZE,
        *,
        names: Sequence[str] | None = None,
        restore: str = "device",
        update_precision: str = "auto",
        stream_elements: int | None = None,
        multi_tensor: bool = True,
        sub_ulp_sigma: float | None = None,
    ) -> None:
        if not isinstance(model, torch.nn.Module):
            raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
        if int(chunk_size) < 1:
            raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
        if restore not in RESTORE_MODES:
            raise ValueError(f"restore must be one of {RESTORE_MODES}, got {restore!r}")
        if update_precision not in UPDATE_PRECISIONS:
            raise ValueError(f"update_precision must be one of {UPDATE_PRECISIONS}, got {update_precision!r}")
        if stream_elements is not None and int(stream_elements) < 1:
            raise ValueError(f"stream_elements must be None or >= 1, got {stream_elements}")
        self.model = model
        self.chunk_size = int(chunk_size)
        self.restore_mode = restore
        self.update_precision = update_precision
        self.stream_elements = None if stream_elements is None else int(stream_elements)
        selected = select_parameters(model, include, exclude, names)
        if sub_ulp_sigma is not None and include is None and names is None:
            selected = without_sub_ulp(selected, sub_ulp_sigma)
        self.parameters = [self._make_parameter(name, param.detach(), tensor_id_for(name)) for name, param in selected]
        self.multi_tensor = bool(multi_tensor)
        self._pending: _Perturbation | None = None
        # The partition last returned by partition() with its CPU copy; the last partition used with its run tables
        # by subspace (None: every chunk).
        self._host_partition: tuple[list[torch.Tensor], list[torch.Tensor]] | None = None
        self._run_tables: tuple[list[torch.Tensor], dict[int | None, list[ck.RunTable]]] | None = None
        self._host_buffers: dict[tuple[int, int], torch.Tensor] = {}
        if restore == "subtract":
            warnings.warn(
                "restore='subtract' undoes each perturbation by adding -sigma * eps: floating-point rounding makes "
                "it inexact, so the weights drift; use 'device' or 'host' for an exact restore",
                stacklevel=2,
            )

    def _make_parameter(self, name: str, data: torch.Tensor, tensor_id: int) -> TrainableParameter:
        if data.dtype == torch.float32:
            precision = "native"
        else:
            precision = "stochastic" if self.update_precision == "auto" else self.update_precision
        master = None
        if precision == "master_device":
            master = data.to(torch.float32, copy=True)
        elif precision == "master_host":
            master = torch.empty(data.shape, dtype=torch.float32, pin_memory=data.is_cuda).copy_(data)
        return TrainableParameter(name, data, tensor_id, precision, master)

    # ---------------------------------------------------------------- layout

    @property
    def names(self) -> list[str]:
        return [p.name for p in self.parameters]

    @property
    def numel(self) -> int:
        return sum(p.numel for p in self.parameters)

    @property
    def chunk_counts(self) -> list[int]:
        return [ck.num_chunks(p.numel, self.chunk_size) for p in self.parameters]

    def _total_chunks(self, chunk_size: int) -> int:
        return sum(ck.num_chunks(p.numel, chunk_size) for p in self.parameters)

    def fit_chunk_size(self, num_subspaces: int) -> int:
        """Make sure there are at least `num_subspaces` chunks, so every subspace is non-empty.

        When there are too few, the chunk size shrinks (with a warning) to the largest one that yields enough;
        a model with fewer elements than subspaces cannot be split at all (ValueError). Returns the chunk size.
        """
        if self._total_chunks(self.chunk_size) >= num_subspaces:
            return self.chunk_size
        if self.numel < num_subspaces:
            raise ValueError(
                f"num_subspaces={num_subspaces} exceeds the {self.numel} trainable elements: even 1-element chunks "
                "cannot give every subspace one"
            )
        # The chunk count never grows with the chunk size: binary-search the largest size that still gives K.
        low, high = 1, self.chunk_size - 1
        while low < high:
            middle = (low + high + 1) // 2
            if self._total_chunks(middle) >= num_subspaces:
                low = middle
            else:
                high = middle - 1
        warnings.warn(
            f"chunk_size={self.chunk_size} gives {self._total_chunks(self.chunk_size)} chunks for "
            f"num_subspaces={num_subspaces}; using chunk_size={low} instead",
            stacklevel=2,
        )
        self.chunk_size = low
        return low

    def partition(self, seed: int, num_subspaces: int) -> list[torch.Tensor]:
        """Chunk -> subspace maps (int16), one per parameter, each on its parameter's device."""
        parts = ck.make_partition(self.chunk_counts, num_subspaces=num_subspaces, seed=seed)
        placed = [part.to(p.data.device) for part, p in zip(parts, self.parameters)]
        self._host_partition = (placed, parts)  # sizes the run tables without reading the device copy back
        return placed

    def _slices(self) -> Iterator[tuple[int, TrainableParameter, int, torch.Tensor]]:
        """(parameter index, parameter, offset, flat contiguous view) for every slice of every parameter."""
        for index, param in enumerate(self.parameters):
            flat = param.data.view(-1)
            step = self.stream_elements or max(flat.numel(), 1)
            for offset in range(0, flat.numel(), step):
                yield index, param, offset, flat[offset : offset + step]

    def _layout(self, partition: list[torch.Tensor], index: int, subspace: int, offset: int) -> dict[str, Any]:
        return dict(chunk_subspace=partition[index], subspace=subspace, chunk_size=self.chunk_size, offset=offset)

    # ---------------------------------------------------------------- run tables (multi-tensor launches)

    def _fused(self, *, update: bool = False) -> bool:
        """Whether this call takes the multi-tensor path (see the module docstring)."""
        if not self.multi_tensor:
            return False
        # Slices bound transient memory (backups, staged masters): the fused update and a subtracting restore hold none.
        if self.stream_elements is not None and not update and self.restore_mode != "subtract":
            return False
        if update and any(p.precision not in ("native", "stochastic") for p in self.parameters):
            return False
        if not update and self.restore_mode == "host":
            return False
        # The compiled CPU backend (numba) has multi-tensor kernels too; the reference only loops per tensor.
        return all(ck.backend_for(p.data.device) in ("triton", "cpu") for p in self.parameters)

    def _tables(self, partition: list[torch.Tensor], subspace: int | None) -> list[ck.RunTable]:
        """The run tables of `subspace` (every chunk when None), one per (device, dtype) group. A new partition
        builds them all at once, for every subspace and the update: from the CPU copy partition() kept, else from
        one read-back of `partition`."""
        if self._run_tables is None or self._run_tables[0] is not partition:
            if self._host_partition is not None and self._host_partition[0] is partition:
                host = self._host_partition[1]
            else:
                host = [part.cpu() for part in partition]
            # make_partition gives every subspace a chunk, so the largest id names K - 1.
            num_subspaces = int(torch.cat(host).max()) + 1
            groups: dict[tuple[torch.device, torch.dtype], list[int]] = {}
            for index, param in enumerate(self.parameters):
                if param.numel:
                    groups.setdefault((param.data.device, param.data.dtype), []).append(index)

            def group_tables(table_subspace: int | None) -> list[ck.RunTable]:
                return [
                    ck.build_run_table(
                        [self.parameters[i].data for i in indices],
                        tensor_ids=[self.parameters[i].tensor_id for i in indices],
                        chunk_subspaces=[partition[i] for i in indices],
                        host_chunk_subspaces=[host[i] for i in indices],
                        subspace=table_subspace,
                        num_subspaces=num_subspaces,
                        chunk_size=self.chunk_size,
                    )
                    for indices in groups.values()
                ]

            every = [*range(num_subspaces), None]
            self._run_tables = (partition, {k: group_tables(k) for k in every})
        tables = self._run_tables[1]
        if subspace not in tables:
            raise ValueError(f"subspace must be in [0, {len(tables) - 1}) for this partition, got {subspace}")
        return tables[subspace]

    def warm_up(self) -> float:
        """Compile (or load from numba's on-disk cache) the CPU backend's kernels for these parameters' dtypes, so
        a fresh install's compile is not charged to the first perturb and update; seconds taken (0.0 on CUDA).
        With large weights on a CPU the compile runs in a child process (`copes_kernels.warm_up`'s in_child)."""
        seconds = 0.0
        for device in {p.data.device for p in self.parameters}:
            held = [p.data for p in self.parameters if p.data.device == device]
            in_child = sum(t.numel() * t.element_size() for t in held) >= COMPILE_IN_CHILD_BYTES
            seconds += ck.warm_up({t.dtype for t in held}, device=device, in_child=in_child)
        return seconds

    def synchronize(self) -> None:
        """Wait for queued kernels on every CUDA device holding a parameter (for honest phase timings)."""
        for device in {p.data.device for p in self.parameters if p.data.is_cuda}:
            torch.cuda.synchronize(device)

    def _mark_written(self) -> None:
        """Bump every trainable tensor's version counter; called before a write, so one that fails halfway counts."""
        torch.autograd.graph.increment_version([p.data for p in self.parameters])

    # ---------------------------------------------------------------- perturb / restore

    def perturb(self, partition: list[torch.Tensor], *, seed: int, member: int, subspace: int, sigma: float) -> None:
        """w += sigma * eps_member on the chunks of `subspace`, keeping what restore() needs to undo it."""
        if self._pending is not None:
            raise RuntimeError("perturb() called while another perturbation is applied; call restore() first")
        self._mark_written()
        if self._fused():
            tables = self._tables(partition, subspace)
            group_backups = []
            for table in tables:
                backup = None
                if self.restore_mode == "device":
                    backup = torch.empty(table.backup_numel, dtype=table.dtype, device=table.device)
                    group_backups.append(backup)
                ck.multi_perturb_(table, seed=seed, member=member, sigma=sigma, backup=backup)
            self._pending = _Perturbation(partition, seed, member, subspace, sigma, group_backups, tables)
            return
        backups: list[torch.Tensor] = []
        for index, param, offset, view in self._slices():
            layout = self._layout(partition, index, subspace, offset)
            if self.restore_mode != "subtract":
                packed = ck.backup_chunks(view, **layout)
                backups.append(self._to_host(index, offset, packed) if self.restore_mode == "host" else packed)
            ck.perturb_(view, seed=seed, member=member, tensor_id=param.tensor_id, sigma=sigma, **layout)
        self._pending = _Perturbation(partition, seed, member, subspace, sigma, backups)

    def _to_host(self, index: int, offset: int, packed: torch.Tensor) -> torch.Tensor:
        """Copy a packed backup into this slice's reusable host buffer (pinned memory is costly to allocate).

        A buffer grows only when a subspace owns more of the slice than ever before, with 1/8 headroom, so the host
        holds about 1/K of the weights, not all of them, and reallocations soon stop."""
        buffer = self._host_buffers.get((index, offset))
        if buffer is None or buffer.numel() < packed.numel():
            numel = self.parameters[index].numel
            slice_numel = min(self.stream_elements or numel, numel - offset)
            size = min(slice_numel, packed.numel() + packed.numel() // 8)
            buffer = torch.empty(size, dtype=packed.dtype, pin_memory=packed.is_cuda)
            self._host_buffers[(index, offset)] = buffer
        host = buffer[: packed.numel()]
        # Stream order guarantees the copy lands before restore's upload, which runs on the same stream.
        host.copy_(packed, non_blocking=True)
        return host

    def restore(self) -> None:
        """Undo the applied perturbation (bit-exact for "device" and "host")."""
        pending = self._pending
        if pending is None:
            raise RuntimeError("restore() called without an applied perturbation")
        self._mark_written()
        if pending.tables is not None:
            for index, table in enumerate(pending.tables):
                if self.restore_mode == "subtract":
                    ck.multi_perturb_(table, seed=pending.seed, member=pending.member, sigma=-pending.sigma)
                else:
                    ck.multi_restore_(table, pending.backups[index])
            self._pending = None
            return
        backups = iter(pending.backups)
        for index, param, offset, view in self._slices():
            layout = self._layout(pending.partition, index, pending.subspace, offset)
            if self.restore_mode == "subtract":
                ck.perturb_(
                    view, seed=pending.seed, member=pending.member, tensor_id=param.tensor_id, sigma=-pending.sigma,
                    **layout,
                )
            else:
                ck.restore_chunks_(view, next(backups), **layout)
        self._pending = None

    # ---------------------------------------------------------------- update

    def apply_update(
        self,
        partition: list[torch.Tensor],
        *,
        seed: int,
        members: Sequence[int] | torch.Tensor,
        coeffs: Sequence[float] | torch.Tensor,
        member_subspaces: Sequence[int] | torch.Tensor,
        rule: UpdateRule | None = None,
    ) -> float:
        """Add sum_j coeffs[j] * P_{member_subspaces[j]} eps_{members[j]} to the weights (or, with `rule`,
        materialise that sum per slice in fp32 as a gradient estimate and add `rule(index, offset, g)`).

        Never holds a full-size noise tensor. Returns the L2 norm of the change actually applied to the
        trainable weights (to the fp32 masters where there are any), measured slice by slice as
        ||after - before||: exact, and it includes rounding (a lost sub-ulp step counts as zero).
        """
        if self._pending is not None:
            raise RuntimeError("apply_update() called while a perturbation is applied; call restore() first")
        if rule is not None and any(p.precision == "stochastic" for p in self.parameters):
            raise ValueError(
                "update_precision='stochastic' only supports the plain (SGD) update; use a master precision for an "
                "update rule such as Adam"
            )
        self._mark_written()
        if rule is None and self._fused(update=True):
            squares = []
            for table in self._tables(partition, None):
                group_member = next(p for p in self.parameters if p.data.dtype == table.dtype)
                squares.append(ck.multi_accumulate_(
                    table, seed=seed, members=members, coeffs=coeffs, member_subspaces=member_subspaces,
                    rounding=self._rounding(group_member),
                ))
                # Crash tests: die with the update half applied. One pass per tensor, as the per-tensor path makes,
                # so a failpoint count names the same point of a run on either path.
                for _ in table.tensors:
                    failpoint("update")
            return math.sqrt(float(sum(s.to(squares[0].device) for s in squares))) if squares else 0.0  # one sync

        def add_noise_sum(index: int, param: TrainableParameter, offset: int, target: torch.Tensor) -> None:
            noise = dict(
                seed=seed, members=members, tensor_id=param.tensor_id, offset=offset,
                chunk_subspace=partition[index], member_subspaces=member_subspaces, chunk_size=self.chunk_size,
            )
            if rule is None:
                ck.accumulate_(target, coeffs=coeffs, rounding=self._rounding(param), **noise)
            else:
                gradient = torch.zeros(target.numel(), dtype=torch.float32, device=target.device)
                ck.accumulate_(gradient, coeffs=coeffs, **noise)
                target.add_(rule(index, offset, gradient))

        return self._write_update(self._slices(), add_noise_sum)

    def apply_lowrank_update(
        self, factors: Sequence[tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None], *, seed: int, scale: float
    ) -> float:
        """W_i += scale * sum_j coeffs_j A_j B_j^T for each parameter i with `factors[i] = (A, B, coeffs)`
        (A [M, m, r], B [M, n, r], coeffs [M]); None leaves parameter i alone. Each matrix is updated whole
        (`stream_elements` does not slice it). Returns the applied norm, as `apply_update` does."""
        if self._pending is not None:
            raise RuntimeError("apply_lowrank_update() called while a perturbation is applied; call restore() first")
        if len(factors) != len(self.parameters):
            raise ValueError(f"factors must have one entry per parameter ({len(self.parameters)}), got {len(factors)}")
        self._mark_written()

        def add_lowrank(index: int, param: TrainableParameter, offset: int, target: torch.Tensor) -> None:
            A, B, coeffs = factors[index]
            ck.lowrank_accumulate_(
                target.view(param.data.shape), A=A, B=B, coeffs=coeffs, scale=scale, rounding=self._rounding(param),
                seed=seed, tensor_id=param.tensor_id,
            )

        whole = (
            (index, param, 0, param.data.view(-1))
            for index, param in enumerate(self.parameters) if factors[index] is not None
        )
        return self._write_update(whole, add_lowrank)

    @staticmethod
    def _rounding(param: TrainableParameter) -> str:
        return "stochastic" if param.precision == "stochastic" else "nearest"

    def _write_update(
        self,
        slices: Iterable[tuple[int, TrainableParameter, int, torch.Tensor]],
        add: Callable[[int, TrainableParameter, int, torch.Tensor], None],
    ) -> float:
        """Run `add(index, param, offset, target)` on each slice's update target (the weights, or its fp32 master,
        staged to the device for "master_host"), write masters back to the model, and return ||after - before||."""
        squared_norm = 0.0
        for index, param, offset, view in slices:
            target = self._update_target(param, offset, view)
            before = target.clone()
            add(index, param, offset, target)
            squared_norm += float(torch.linalg.vector_norm(target.float() - before.float(), dtype=torch.float64)) ** 2
            failpoint("update")  # crash tests: die with the update half applied
            if param.master is not None:
                if param.precision == "master_host":
                    param.master.view(-1)[offset : offset + view.numel()].copy_(target)
                view.copy_(target)
        return math.sqrt(squared_norm)

    def _update_target(self, param: TrainableParameter, offset: int, view: torch.Tensor) -> torch.Tensor:
        """Where this slice's update is accumulated: the weights, the device master, or a staged host master."""
        if param.master is None:
            return view
        master = param.master.view(-1)[offset : offset + view.numel()]
        return master if param.precision == "master_device" else master.to(view.device)

    # ---------------------------------------------------------------- resume

    def master_state(self) -> dict[str, torch.Tensor]:
        """CPU copies of the fp32 masters, keyed by parameter name (empty when no parameter keeps one)."""
        return {p.name: p.master.detach().to("cpu", copy=True) for p in self.parameters if p.master is not None}

    def load_master_state(self, masters: dict[str, torch.Tensor]) -> None:
        """Put back masters saved by `master_state()`."""
        with torch.no_grad():
            for param in self.parameters:
                if param.master is not None:
                    param.master.copy_(masters[param.name])

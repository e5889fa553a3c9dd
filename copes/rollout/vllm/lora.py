"""EGGROLL's members as vLLM LoRA adapters, built in memory from the noise contract.

Member j's rank-r perturbation of a linear weight W [m, n] is W + s * A_j B_j^T with s = sigma_k / sqrt(r) and
(A_j [m, r], B_j [n, r]) = ck.lowrank_factors(seed_t, j, tensor_id): exactly a LoRA adapter with
lora_A = B_j^T [r, n], lora_B = s * A_j [m, r] and scaling 1 (alpha = r). The strategy's `row_members(...)` block
yields the routing as data (`RoutedRows`: which member each row is, each member's factors by HF module name), and
`MemberAdapters` turns it into one `LoRARequest` per request: every member of the population rides in one
`llm.generate` call, and vLLM batches the adapters (punica kernels). The weights themselves change only at the
update, through the same HF-named views as CoPES.

Nothing touches the disk: the adapter tensors are handed to the in-process worker, whose LoRA manager loads an
adapter of ours from them (`CoPESWorkerExtension.copes_serve_adapters`) instead of from a PEFT folder.

Identity: vLLM keys its prefix cache by adapter name, so each (step's noise, member) gets a fresh id and name from a
counter that never repeats in an engine's life: KV computed under another member's or another step's adapter is
never served. A step's noise is told by identity (`RoutedRows.noise`, one list object per step, held here until
the next so it cannot be freed and its id reused). When new noise arrives, the previous adapters are removed from
the engine, so adapter memory is one step's population.

Reach: vLLM's LoRA reaches its linear layers (qkv / o / gate_up / down projections under HF names q_proj ...), not
a tied embedding (a tied lm_head is the embedding matrix: its per-row correction also enters the input lookup, which
LoRA does not model). Under vLLM the low-rank strategies leave a tied embedding out of their targets, and refuse a
target read by a linear `lora_reach` names (copes.run.components.build_strategy).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch

# vLLM's allowed --max-lora-rank values (vllm.config.lora.MaxLoRARanks); an adapter of lower rank fits a larger slot.
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
# The path an in-memory adapter's LoRARequest carries (vLLM wants one); the worker never opens it.
MEMORY_PATH = "copes-memory-adapter"


@dataclass(frozen=True)
class LoRASlots:
    """How many member adapters one generate call may mix, and their rank (the engine's LoRA settings)."""

    adapters: int
    rank: int

    @property
    def max_lora_rank(self) -> int:
        """The smallest rank slot vLLM offers that holds `rank` (a rank-r adapter is exact in a wider slot)."""
        return next(slot for slot in VLLM_LORA_RANKS if slot >= self.rank)

    def engine_options(self) -> dict[str, Any]:
        """vLLM's LLM(...) options: every member of a rank's population in one batch, none evicted mid-step."""
        return {"enable_lora": True, "max_lora_rank": self.max_lora_rank, "max_loras": self.adapters,
                "max_cpu_loras": self.adapters}


class Routing(Protocol):
    """The data a `row_members(...)` block yields (copes.es.strategies.row_routing.RoutedRows)."""

    step: int
    member_of_row: torch.Tensor
    scale: float
    noise: Any

    def member_factors(self, member: int) -> dict[str, tuple[torch.Tensor, torch.Tensor]]: ...


def adapter_tensors(factors: dict[str, tuple[torch.Tensor, torch.Tensor]], scale: float) -> dict[str, torch.Tensor]:
    """PEFT-named LoRA tensors of one member: for module M with factors (A [m, r], B [n, r]),
    `base_model.model.M.lora_A.weight` = B^T [r, n] and `...lora_B.weight` = scale * A [m, r], so that
    lora_B @ lora_A = scale * A B^T (the member's perturbation of M's weight)."""
    tensors = {}
    for module, (A, B) in factors.items():
        tensors[f"base_model.model.{module}.lora_A.weight"] = B.t().contiguous()
        tensors[f"base_model.model.{module}.lora_B.weight"] = (A * scale).contiguous()
    return tensors


def lora_reach(module_names: Sequence[str], lora_modules: set[str]) -> list[str]:
    """Those of `module_names` (HF nn.Linear names) whose last segment is none of vLLM's LoRA target modules."""
    return [name for name in module_names if name.rpartition(".")[2] not in lora_modules]


class MemberAdapters:
    """The engine side of the member adapters: ids, the in-memory store the worker loads from, retirement.

    `store` is shared with the in-process worker (`copes_serve_adapters`): {lora_int_id: (tensors, rank)}."""

    def __init__(self, llm: Any, slots: LoRASlots) -> None:
        self.llm, self.slots = llm, slots
        self.store: dict[int, tuple[dict[str, torch.Tensor], int]] = {}
        self._ids = itertools.count(1)
        self._noise: tuple[Any, float] | None = None  # the routed noise (and scale) the current adapters carry
        self._requests: dict[int, Any] = {}  # member -> this step's LoRARequest
        llm.collective_rpc("copes_serve_adapters", args=(self.store,))

    def requests(self, routing: Routing, rows: int) -> list[Any]:
        """One LoRARequest per batch row (`rows` of them, in `routing.member_of_row` order), each member's adapter
        built once per step."""
        from vllm.lora.request import LoRARequest

        members = [int(m) for m in routing.member_of_row.tolist()]
        if len(members) != rows:
            raise ValueError(f"row_members routes {len(members)} rows, the generate call has {rows}")
        if self._noise is None or routing.noise is not self._noise[0] or routing.scale != self._noise[1]:
            self.retire()
            self._noise = (routing.noise, routing.scale)
        if len(set(members)) > self.slots.adapters:
            raise ValueError(f"one generate call mixes {len(set(members))} members; the engine was started for "
                             f"{self.slots.adapters} adapters")
        for member in sorted(set(members) - set(self._requests)):
            factors = routing.member_factors(member)
            rank = next(iter(factors.values()))[0].shape[-1] if factors else self.slots.rank
            lora_id = next(self._ids)
            self.store[lora_id] = (adapter_tensors(factors, routing.scale), rank)
            self._requests[member] = LoRARequest(f"copes-step{routing.step}-member{member}-id{lora_id}", lora_id,
                                                 MEMORY_PATH)
        return [self._requests[member] for member in members]

    def retire(self) -> None:
        """Remove every adapter of the current step from the engine and the store."""
        for request in self._requests.values():
            self.llm.llm_engine.remove_lora(request.lora_int_id)
            self.store.pop(request.lora_int_id, None)
        self._requests = {}

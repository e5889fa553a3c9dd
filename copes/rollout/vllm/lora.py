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

Names and reach, decided here alone (`LoRATargets`): vLLM applies an adapter's module only when its name is one
its LoRA manager looks up (a LoRA layer's name, a fused layer's parts under their own names: `...qkv_proj` looks up
`...q_proj`, `...k_proj`, `...v_proj`), and drops any other at debug level, so a misnamed adapter silently leaves a
member equal to the base model. Each adapter module is therefore named after the vLLM module that holds the HF
linear's weight (found by the weight-loader trace, copes.rollout.vllm.views): the holder itself, or for a part of
a fused holder (q_proj in qkv_proj, in_proj_qkv in Qwen3.5's fused in_proj_qkvz) the holder's sibling under the
part's name; a build whose layers are separate (in_proj_qkv and in_proj_z) names them directly. A target whose
adapter name vLLM does not look up is refused at start (`check_lora_reach`), and an adapter carrying such a module
is an error, never a silent base-model member. A tied embedding is not reachable: a tied lm_head is the embedding
matrix, whose per-row correction also enters the input lookup, which LoRA does not model; the low-rank strategies
leave it out of their targets under vLLM (`tied_embeddings`, read from the model alone so copes-replay on HF leaves
out the same).
"""

from __future__ import annotations

import itertools
import os
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from copes.errors import ConfigError, UserError

# vLLM's allowed --max-lora-rank values (vllm.config.lora.MaxLoRARanks); an adapter of lower rank fits a larger slot.
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
# The path an in-memory adapter's LoRARequest carries (vLLM wants one); the worker never opens it.
MEMORY_PATH = "copes-memory-adapter"
LORA_BASE_LAYER = "base_layer"  # vLLM's LoRA layer keeps the layer it wraps under this name


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


@dataclass(frozen=True)
class LoRATargets:
    """Where an engine's LoRA layers read adapters: `lookups`, every module name vLLM's LoRA manager looks an adapter
    up under (CoPESWorkerExtension.copes_lora_modules), and `holders`, each HF parameter's vLLM parameter."""

    lookups: frozenset[str]
    holders: dict[str, str]

    def adapter_module(self, linear: str) -> str | None:
        """The module name the adapter of HF linear `linear` carries (see the module docstring); None when vLLM
        holds no weight of its own for it (a tied lm_head)."""
        holder = self.holders.get(f"{linear}.weight")
        if holder is None:
            return None
        module = holder.removesuffix(".weight").removesuffix(f".{LORA_BASE_LAYER}")  # a LoRA layer wraps the holder
        parent, _, leaf = module.rpartition(".")
        part = linear.rpartition(".")[2]
        return module if part == leaf else f"{parent}.{part}".lstrip(".")

    def unreachable(self, linears: Sequence[str]) -> list[str]:
        """Those of the HF linear modules `linears` whose adapter vLLM would not apply."""
        return [linear for linear in linears if self.adapter_module(linear) not in self.lookups]


def tied_embeddings(model: torch.nn.Module, algorithm: str, *, notice: bool) -> list[str]:
    """The linear weights an nn.Embedding also reads (a tied lm_head), which a LoRA adapter cannot carry: left out
    of a low-rank strategy's targets on vLLM, with one notice (when `notice`, on rank 0)."""
    read_by = {kind: {id(m.weight) for m in model.modules() if type(m) is kind}
               for kind in (torch.nn.Linear, torch.nn.Embedding)}
    both = read_by[torch.nn.Linear] & read_by[torch.nn.Embedding]
    tied = [name for name, param in model.named_parameters() if id(param) in both]
    if tied and notice and os.environ.get("RANK", "0") == "0":
        print(f"notice: {algorithm} on vLLM leaves {', '.join(tied)} unperturbed (a LoRA adapter cannot carry a "
              "tied embedding); --exclude it for the same targets on --rollout-engine hf", file=sys.stderr)
    return tied


def check_lora_reach(targets: LoRATargets, matrices: Sequence[Any], algorithm: str) -> None:
    """One line naming the strategy's targets (`matrices`: name and the linears reading each) read by a linear
    whose adapter vLLM would not apply."""
    unreachable = [matrix.param.name for matrix in matrices
                   if targets.unreachable([name for name, _ in matrix.linears])]
    if unreachable:
        raise ConfigError(f"vLLM's LoRA layers do not reach {', '.join(unreachable)}: --exclude them for "
                          f"{algorithm} on --rollout-engine vllm")


def adapter_tensors(factors: dict[str, tuple[torch.Tensor, torch.Tensor]], scale: float) -> dict[str, torch.Tensor]:
    """PEFT-named LoRA tensors of one member: for module M with factors (A [m, r], B [n, r]),
    `base_model.model.M.lora_A.weight` = B^T [r, n] and `...lora_B.weight` = scale * A [m, r], so that
    lora_B @ lora_A = scale * A B^T (the member's perturbation of M's weight)."""
    tensors = {}
    for module, (A, B) in factors.items():
        tensors[f"base_model.model.{module}.lora_A.weight"] = B.t().contiguous()
        tensors[f"base_model.model.{module}.lora_B.weight"] = (A * scale).contiguous()
    return tensors


class MemberAdapters:
    """The engine side of the member adapters: ids, the in-memory store the worker loads from, retirement.

    `store` is shared with the in-process worker (`copes_serve_adapters`): {lora_int_id: (tensors, rank)}, the
    tensors named by `targets`."""

    def __init__(self, llm: Any, slots: LoRASlots, targets: LoRATargets) -> None:
        self.llm, self.slots, self.targets = llm, slots, targets
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
            unreachable = self.targets.unreachable(list(factors))
            if unreachable:
                raise UserError(f"member {member}'s LoRA adapter names {len(unreachable)} modules no vLLM LoRA layer "
                                f"reads ({unreachable[0]} ...): vLLM would drop them and run the base model")
            factors = {self.targets.adapter_module(linear): pair for linear, pair in factors.items()}
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

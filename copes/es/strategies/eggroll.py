"""EGGROLL (low-rank ES, the whole population in one batched forward) and the hybrid CoPES-lowrank.

Every targeted matrix W [m, n] (the weight of an `nn.Linear`) gets, for member j, the rank-r perturbation

    W_j = W + sigma_k / sqrt(r) * A_j B_j^T,    (A_j [m, r], B_j [n, r]) = ck.lowrank_factors(seed_t, j, tensor_id)

and the weights are never modified during evaluation: inside `with row_members(member_of_row):` every targeted
linear runs as `ck.lowrank_linear` (one base GEMM for the whole batch plus a rank-r term per row), so batch row b
sees W_j with j = member_of_row[b]. `fitness_fn(model, row_members)` is called ONCE per step for all N members
and returns rewards [N] or [N, Q].

Step t (seed_t = copes.es.strategies.base.step_seed(seed, t), the same seed CoPES would use):
    groups      ck.make_partition with one chunk per matrix: each matrix -> one of K groups (balanced within one)
    member j    in group k(j) = j % K perturbs only its group's matrices, sigma_k = sqrt(K) * sigma; its rows see
                a zero correction in every other matrix
    fitness     r_hat = shape_fitness(rewards) (per-question z-scores for EGGROLL, joint for the hybrid)
    update      W += lr / (N_k sqrt(r)) * sum_{j in k(W)} r_hat_j A_j B_j^T: one GEMM per matrix, N_k = N / K

EGGROLL is the case K = 1 (sigma_k = sigma, every member perturbs every matrix, N_k = N).

Tied weights: a Parameter shared by an `nn.Linear` and an `nn.Embedding` (lm_head == embed_tokens) is one matrix
with one noise id; the embedding lookup gets the same per-row correction (A_j[token] B_j^T), so each member
really evaluates W_j everywhere. Parameter names follow `ParameterSpace`: a tied weight is named once, by its
first name (`model.embed_tokens.weight`, not `lm_head.weight`). Parameters that are no `nn.Linear` weight
(norms, biases, untied embeddings) are frozen. The per-row routing lives in `copes.es.strategies.row_routing`; the
update goes through `ParameterSpace.apply_lowrank_update`, the one writer of trainable weights.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any, ClassVar

import torch
from torch import nn

import copes_kernels as ck
from copes.es.params import ParameterSpace
from copes.es.selection import select_parameters
from copes.es.strategies.base import (
    WHOLE_POPULATION,
    ESBase,
    Evaluation,
    StepPlan,
    StepStats,
    population_rewards,
    step_seed,
)
from copes.es.strategies.row_routing import (
    LowRankMatrix,
    MatrixNoise,
    RoutedRows,
    RowMembers,
    find_matrices,
    linear_weight_names,
    route_rows,
)

# Factors cost (m + n) * r floats per member and matrix; beyond 16 the low-rank forward stops being cheap.
MAX_RANK = 16

BatchedFitnessFn = Callable[[nn.Module, RowMembers], Any]

__all__ = ["MAX_RANK", "EGGROLL", "BatchedFitnessFn", "CoPESLowRank", "RowMembers"]


class _LowRankES(ESBase):
    """Shared engine of EGGROLL (K = 1) and CoPESLowRank (K > 1); see the module docstring for the math.

    `matrices` are the low-rank targets (in module order, which indexes `plan().partition`); `frozen_names` the
    selected parameters that are no nn.Linear weight and never move.
    """

    evaluation: ClassVar[Evaluation] = WHOLE_POPULATION

    def __init__(
        self,
        model: nn.Module,
        population: int = 40,
        num_subspaces: int = 4,
        sigma: float = 1e-3,
        lr: float = 5e-4,
        rank: int = 1,
        seed: int = 0,
        include: str | Sequence[str] | None = None,
        exclude: str | Sequence[str] | None = None,
        fitness: str = "joint",
        std_floor: float = 1e-8,
        update_precision: str = "auto",
    ) -> None:
        super().__init__(model, population=population, num_subspaces=num_subspaces, sigma=sigma, lr=lr, seed=seed,
                         fitness=fitness, std_floor=std_floor)
        if not 1 <= int(rank) <= MAX_RANK:
            raise ValueError(f"rank must be in [1, {MAX_RANK}], got {rank}")
        self.rank = int(rank)
        candidates = select_parameters(model, include, exclude)
        targets = linear_weight_names(model, candidates)
        if not targets:
            raise ValueError(f"include={include!r} / exclude={exclude!r} select no nn.Linear weight of the model")
        self.frozen_names = [name for name, _ in candidates if name not in set(targets)]
        # Only the targets get update state (fp32 masters), never the frozen tensors.
        self.space = ParameterSpace(model, names=targets, update_precision=update_precision)
        self.matrices: list[LowRankMatrix] = find_matrices(model, self.space.parameters)
        if len(self.matrices) < self.num_subspaces:
            raise ValueError(
                f"num_subspaces={self.num_subspaces} exceeds the {len(self.matrices)} targeted matrices: every group "
                "needs at least one"
            )
        self._space_index = {id(p): index for index, p in enumerate(self.space.parameters)}
        self._noise: list[MatrixNoise] | None = None
        self._active_rows = False

    # ---------------------------------------------------------------- phases

    @property
    def factor_norm(self) -> float:
        """sqrt(r): A_j B_j^T is divided by it in the perturbation and in the update."""
        return math.sqrt(self.rank)

    def plan(self) -> StepPlan:
        """This step's seed, matrix groups (`partition[i]` is a 1-element int16 tensor: matrix i's group) and
        member layout (member j in group j % K, noise stream j, sign +1)."""
        if self._plan is None:
            seed = step_seed(self.seed, self._step)
            members = torch.arange(self.population, dtype=torch.int64)
            self._plan = StepPlan(
                step=self._step,
                seed=seed,
                sigma=self.sigma_k,
                partition=ck.make_partition([1] * len(self.matrices), num_subspaces=self.num_subspaces, seed=seed),
                member_subspace=members % self.num_subspaces,
                noise_member=members,
                noise_sign=torch.ones(self.population, dtype=torch.float64),
            )
        return self._plan

    def _step_noise(self) -> list[MatrixNoise]:
        """Generate (once per step) every matrix's factors for the members of its group."""
        if self._noise is None:
            plan = self.plan()
            start = time.perf_counter()
            self._noise = [
                self._matrix_noise(plan, matrix, int(group[0])) for matrix, group in zip(self.matrices, plan.partition)
            ]
            self.space.synchronize()
            self._seconds["perturb"] += time.perf_counter() - start
        return self._noise

    def _matrix_noise(self, plan: StepPlan, matrix: LowRankMatrix, group: int) -> MatrixNoise:
        weight = matrix.weight
        members = plan.members_of(group)
        A, B = ck.lowrank_factors(
            seed=plan.seed, member=members, tensor_id=matrix.param.tensor_id,
            out_features=weight.shape[0], in_features=weight.shape[1], rank=self.rank, device=weight.device,
        )
        zero_slot = len(members)
        slot_of_member = torch.full((self.population,), zero_slot, dtype=torch.int64)
        slot_of_member[members] = torch.arange(len(members))
        if len(members) < self.population:  # other groups' members exist: give them an all-zero factor
            A = torch.cat([A, A.new_zeros(1, *A.shape[1:])])
            B = torch.cat([B, B.new_zeros(1, *B.shape[1:])])
        return MatrixNoise(A, B, slot_of_member.to(weight.device), len(members))

    @contextlib.contextmanager
    def row_members(self, member_of_row: torch.Tensor) -> Iterator[RoutedRows]:
        """Inside the block, batch row b of every forward uses member `member_of_row[b]`'s perturbation; the block
        yields the routing as data (`RoutedRows`, for engines that apply members as adapters).

        Only valid inside `fitness_fn` during `step` / `evaluate`; forwards must keep the batch in dim 0.
        """
        if self._noise is None:
            raise RuntimeError("row_members is only valid inside fitness_fn, while step() / evaluate() runs")
        if self._active_rows:
            raise RuntimeError("row_members blocks cannot be nested")
        rows = torch.as_tensor(member_of_row)
        if rows.dim() != 1 or rows.dtype.is_floating_point or rows.dtype == torch.bool:
            raise ValueError(f"member_of_row must be a 1-D integer tensor, got {rows.dtype} {tuple(rows.shape)}")
        if rows.numel() and (int(rows.min()) < 0 or int(rows.max()) >= self.population):
            raise ValueError(f"member_of_row values must lie in [0, {self.population}), got {rows.tolist()}")
        self._active_rows = True
        try:
            with route_rows(self.matrices, self._noise, rows.to(torch.int64), sigma=self.sigma_k,
                            factor_norm=self.factor_norm, step=self.plan().step) as routed:
                yield routed
        finally:
            self._active_rows = False

    def evaluate(self, fitness_fn: BatchedFitnessFn, members: Sequence[int] | None = None) -> torch.Tensor:
        """Call `fitness_fn(model, row_members)` once for the whole population (under torch.no_grad()); returns its
        rewards as float64 [N] or [N, Q]. The weights are not modified.

        `members` (a rank's share in distributed runs) narrows the call to those members: the fn then returns one
        row of rewards per listed member, in that order.
        """
        self._step_noise()
        start = time.perf_counter()
        try:
            with torch.no_grad():
                value = fitness_fn(self.model, self.row_members)
        finally:
            self._seconds["rollout"] += time.perf_counter() - start
        return population_rewards(value, self.population if members is None else len(members))

    def _prepare_update(self) -> None:
        self._step_noise()  # regenerated if rewards came from elsewhere (e.g. gathered from other ranks)

    def _update(self, plan: StepPlan, r_hat: torch.Tensor) -> float:
        """W += lr / (N_k sqrt(r)) sum_j r_hat_j A_j B_j^T per matrix; returns ||after - before|| over all of them.
        No restore phase: evaluation never writes the weights."""
        factors: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None] = [None] * len(self.space.parameters)
        for matrix, noise, part in zip(self.matrices, self._step_noise(), plan.partition):
            used = slice(0, noise.num_members)
            factors[self._space_index[id(matrix.param)]] = (noise.A[used], noise.B[used],
                                                            r_hat[plan.members_of(int(part[0]))])
        scale = self.lr / (self.members_per_subspace * self.factor_norm)
        return self.space.apply_lowrank_update(factors, seed=plan.seed, scale=scale)

    def _end_step(self) -> None:
        super()._end_step()
        self._noise = None

    def step(self, fitness_fn: BatchedFitnessFn) -> StepStats:
        """One full step: evaluate the whole population in one `fitness_fn(model, row_members)` call, then update
        the model in place."""
        return self.apply_update(self.evaluate(fitness_fn))

    # ---------------------------------------------------------------- resume

    def _config(self) -> dict[str, Any]:
        return {
            **self._shared_config(),
            "rank": self.rank,
            "matrices": {m.param.name: m.param.precision for m in self.matrices},
        }


class EGGROLL(_LowRankES):
    """Low-rank ES: rank-`rank` noise on every targeted nn.Linear, the population evaluated in one batched call.

    es = EGGROLL(model, population=40, sigma=1e-3, lr=5e-4, rank=1)
    stats = es.step(fitness_fn)   # fitness_fn(model, row_members) -> rewards [N] or [N, Q]; inside
                                  # `with row_members(member_of_row):` row b of every forward is member_of_row[b]

    The non-matrix parameters (norms, biases, embeddings) stay frozen: a per-row copy of those tensors cannot ride
    in the one batched forward the way a rank-r term can. Use `copes.CoPES` for full-rank noise on every parameter.
    """

    def __init__(
        self,
        model: nn.Module,
        population: int = 40,
        sigma: float = 1e-3,
        lr: float = 5e-4,
        rank: int = 1,
        seed: int = 0,
        *,
        fitness: str = "per_question",
        **options: Any,
    ) -> None:
        """`options`: include, exclude, std_floor, update_precision, as for CoPESLowRank."""
        super().__init__(
            model, population=population, num_subspaces=1, sigma=sigma, lr=lr, rank=rank, seed=seed, fitness=fitness,
            **options,
        )


class CoPESLowRank(_LowRankES):
    """CoPES over matrices with EGGROLL noise: each step the targeted matrices are split into K random groups and
    member j perturbs only group j % K's matrices (sigma_k = sqrt(K) sigma); rewards standardised jointly; each
    matrix is updated from its own group's N/K members. Same `step(fitness_fn(model, row_members))` as EGGROLL.

    CoPESLowRank(model, population=40, num_subspaces=4, sigma=1e-3, lr=5e-4, rank=1, seed=0, include=None,
                 exclude=None, fitness="joint", std_floor=1e-8, update_precision="auto")
    """

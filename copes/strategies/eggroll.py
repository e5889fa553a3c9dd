"""EGGROLL (low-rank ES, the whole population in one batched forward) and the hybrid CoPES-lowrank.

Every targeted matrix W [m, n] (the weight of an `nn.Linear`) gets, for member j, the rank-r perturbation

    W_j = W + sigma_k / sqrt(r) * A_j B_j^T,    (A_j [m, r], B_j [n, r]) = ck.lowrank_factors(seed_t, j, tensor_id)

and the weights are never modified during evaluation: inside `with row_members(member_of_row):` every targeted
linear runs as `ck.lowrank_linear` (one base GEMM for the whole batch plus a rank-r term per row), so batch row b
sees W_j with j = member_of_row[b]. `fitness_fn(model, row_members)` is called ONCE per step for all N members
and returns rewards [N] or [N, Q].

Step t (seed_t = copes.strategies.copes.step_seed(seed, t), the same seed CoPES would use):
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
(norms, biases, untied embeddings) are frozen.
"""

from __future__ import annotations

import contextlib
import glob
import math
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

import copes_kernels as ck
from copes.fitness import FITNESS_MODES, shape_fitness
from copes.params import ParameterSpace, TrainableParameter
from copes.strategies.copes import MAX_POPULATION, StepPlan, StepStats, step_seed

# Factors cost (m + n) * r floats per member and matrix; beyond 16 the low-rank forward stops being cheap.
MAX_RANK = 16

RowMembers = Callable[[torch.Tensor], contextlib.AbstractContextManager[None]]
BatchedFitnessFn = Callable[[nn.Module, RowMembers], Any]


@dataclass(eq=False)
class LowRankMatrix:
    """One targeted weight matrix and every module that reads it (several when weights are tied)."""

    param: TrainableParameter  # name, tensor_id, update precision, fp32 master
    weight: nn.Parameter
    linears: list[tuple[str, nn.Linear]] = field(default_factory=list)
    embeddings: list[tuple[str, nn.Embedding]] = field(default_factory=list)


@dataclass
class _MatrixNoise:
    """This step's factors of one matrix, for the members of its group, plus a zero slot for everyone else."""

    A: torch.Tensor  # [N_k (+1), m, r] float32
    B: torch.Tensor  # [N_k (+1), n, r] float32
    slot_of_member: torch.Tensor  # [N] int64: member -> row of A/B (the zero slot for other groups' members)
    num_members: int  # N_k: rows 0 .. N_k - 1 of A/B are the group's members, in member order


def _find_matrices(model: nn.Module, space: ParameterSpace) -> tuple[list[LowRankMatrix], list[str]]:
    """Split the selected parameters into low-rank targets (nn.Linear weights) and frozen ones."""
    params_by_name = dict(model.named_parameters())
    selected = {id(params_by_name[p.name]): p for p in space.parameters}
    matrices: dict[int, LowRankMatrix] = {}
    for module_name, module in model.named_modules():
        if type(module) is nn.Linear and id(module.weight) in selected:
            matrix = matrices.setdefault(id(module.weight), LowRankMatrix(selected[id(module.weight)], module.weight))
            matrix.linears.append((module_name, module))
    for module_name, module in model.named_modules():
        for _, param in module.named_parameters(recurse=False):
            matrix = matrices.get(id(param))
            if matrix is None or type(module) is nn.Linear:
                continue
            if type(module) is not nn.Embedding or module.max_norm is not None:
                raise ValueError(
                    f"{matrix.param.name!r} is a linear weight that {module_name!r} ({type(module).__name__}) also "
                    "reads; only nn.Linear and plain nn.Embedding (max_norm=None) uses can be perturbed per row: "
                    "exclude it"
                )
            matrix.embeddings.append((module_name, module))
    frozen = [p.name for p in space.parameters if id(params_by_name[p.name]) not in matrices]
    return list(matrices.values()), frozen


class _LowRankES:
    """Shared engine of EGGROLL (K = 1) and CoPESLowRank (K > 1); see the module docstring for the math.

    `matrices` are the low-rank targets (in module order, which indexes `plan().partition`); `frozen_names` the
    selected parameters that are no nn.Linear weight and never move.
    """

    def __init__(
        self,
        model: nn.Module,
        *,
        population: int,
        num_subspaces: int,
        sigma: float,
        lr: float,
        rank: int,
        seed: int,
        include: str | Sequence[str] | None,
        exclude: str | Sequence[str] | None,
        fitness: str,
        std_floor: float,
        update_precision: str,
    ) -> None:
        self._validate(population, num_subspaces, sigma, lr, rank, seed, fitness, std_floor)
        self.model = model
        self.population = int(population)
        self.num_subspaces = int(num_subspaces)
        self.sigma = float(sigma)
        self.lr = float(lr)
        self.rank = int(rank)
        self.seed = int(seed)
        self.fitness = fitness
        self.std_floor = float(std_floor)
        # Selection, noise ids and collision checks are ParameterSpace's; "native" keeps this pass free of copies.
        selection = ParameterSpace(model, include, exclude, update_precision="native")
        matrices, self.frozen_names = _find_matrices(model, selection)
        if not matrices:
            raise ValueError(f"include={include!r} / exclude={exclude!r} select no nn.Linear weight of the model")
        # Second pass over the targets only, so fp32 masters (if any) are made for matrices, not frozen tensors.
        targets = ParameterSpace(
            model, [glob.escape(m.param.name) for m in matrices], update_precision=update_precision
        )
        target_by_name = {p.name: p for p in targets.parameters}
        for matrix in matrices:
            matrix.param = target_by_name[matrix.param.name]
        self.matrices = matrices
        self._space = targets
        if len(matrices) < self.num_subspaces:
            raise ValueError(
                f"num_subspaces={self.num_subspaces} exceeds the {len(matrices)} targeted matrices: every group "
                "needs at least one"
            )
        self._step = 0
        self._plan: StepPlan | None = None
        self._noise: list[_MatrixNoise] | None = None
        self._active_rows = False
        self._seconds = dict.fromkeys(("perturb", "evaluate"), 0.0)

    @staticmethod
    def _validate(population, num_subspaces, sigma, lr, rank, seed, fitness, std_floor) -> None:
        if int(num_subspaces) < 1:
            raise ValueError(f"num_subspaces must be >= 1, got {num_subspaces}")
        if not 1 <= int(population) <= MAX_POPULATION:
            raise ValueError(f"population must be in [1, {MAX_POPULATION}], got {population}")
        if int(population) % int(num_subspaces):
            raise ValueError(f"population={population} must be divisible by num_subspaces={num_subspaces}")
        for name, value in (("sigma", sigma), ("lr", lr)):
            if not (math.isfinite(float(value)) and float(value) > 0):
                raise ValueError(f"{name} must be a finite number > 0, got {value}")
        if not 1 <= int(rank) <= MAX_RANK:
            raise ValueError(f"rank must be in [1, {MAX_RANK}], got {rank}")
        if int(seed) < 0:
            raise ValueError(f"seed must be >= 0, got {seed}")
        if fitness not in FITNESS_MODES:
            raise ValueError(f"fitness must be one of {FITNESS_MODES}, got {fitness!r}")
        if not (math.isfinite(float(std_floor)) and float(std_floor) >= 0):
            raise ValueError(f"std_floor must be a finite number >= 0, got {std_floor}")

    # ---------------------------------------------------------------- phases

    @property
    def step_count(self) -> int:
        """Completed steps (the index of the next step)."""
        return self._step

    @property
    def members_per_subspace(self) -> int:
        return self.population // self.num_subspaces

    @property
    def sigma_k(self) -> float:
        return math.sqrt(self.num_subspaces) * self.sigma

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

    def _step_noise(self) -> list[_MatrixNoise]:
        """Generate (once per step) every matrix's factors for the members of its group."""
        if self._noise is None:
            plan = self.plan()
            start = time.perf_counter()
            self._noise = [
                self._matrix_noise(plan, matrix, int(group[0])) for matrix, group in zip(self.matrices, plan.partition)
            ]
            self._space.synchronize()
            self._seconds["perturb"] += time.perf_counter() - start
        return self._noise

    def _matrix_noise(self, plan: StepPlan, matrix: LowRankMatrix, group: int) -> _MatrixNoise:
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
        return _MatrixNoise(A, B, slot_of_member.to(weight.device), len(members))

    @contextlib.contextmanager
    def row_members(self, member_of_row: torch.Tensor) -> Iterator[None]:
        """Inside the block, batch row b of every forward uses member `member_of_row[b]`'s perturbation.

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
        rows = rows.to(torch.int64)
        undo: list[Callable[[], None]] = []
        self._active_rows = True
        try:
            for matrix, noise in zip(self.matrices, self._noise):
                slots = noise.slot_of_member[rows.to(noise.slot_of_member.device)]
                for name, linear in matrix.linears:
                    undo.append(self._route_linear(name, linear, noise, slots))
                for name, embedding in matrix.embeddings:
                    undo.append(self._perturb_embedding(name, embedding, noise, slots).remove)
            yield
        finally:
            for restore in reversed(undo):
                restore()
            self._active_rows = False

    def _route_linear(
        self, name: str, linear: nn.Linear, noise: _MatrixNoise, slots: torch.Tensor
    ) -> Callable[[], None]:
        """Replace `linear.forward` by the batched low-rank linear; returns the function that puts it back."""
        sigma = self.sigma_k

        def forward(x: torch.Tensor) -> torch.Tensor:
            _check_batch(name, x, slots)
            return ck.lowrank_linear(x, linear.weight, linear.bias, A=noise.A, B=noise.B, row_member=slots, sigma=sigma)

        # An instance-level forward (e.g. set by a wrapper library) is kept aside and put back afterwards.
        previous = linear.__dict__.get("forward")
        linear.forward = forward

        def restore() -> None:
            if previous is None:
                del linear.forward
            else:
                linear.forward = previous

        return restore

    def _perturb_embedding(
        self, name: str, embedding: nn.Embedding, noise: _MatrixNoise, slots: torch.Tensor
    ) -> torch.utils.hooks.RemovableHandle:
        """Add row b's correction sigma_k / sqrt(r) * A_j[token] B_j^T to a tied embedding's lookup."""
        scale = self.sigma_k / math.sqrt(self.rank)

        def hook(module: nn.Module, inputs: tuple[torch.Tensor, ...], output: torch.Tensor) -> torch.Tensor:
            token_ids = inputs[0]
            _check_batch(name, token_ids, slots)
            ids = token_ids.reshape(token_ids.shape[0], -1)  # [batch, tokens]
            # Gather only the looked-up rows of A: A[slots] would copy [batch, vocab, r].
            a_rows = noise.A[slots[:, None].expand_as(ids), ids]  # [batch, tokens, r]
            correction = torch.bmm(a_rows, noise.B[slots].transpose(1, 2))  # [batch, tokens, dim]
            return (output.float() + scale * correction.view(output.shape)).to(output.dtype)

        return embedding.register_forward_hook(hook)

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
            self._seconds["evaluate"] += time.perf_counter() - start
        return self._as_rewards(value, self.population if members is None else len(members))

    def _as_rewards(self, value: Any, expected: int) -> torch.Tensor:
        try:
            rewards = torch.as_tensor(value, dtype=torch.float64).detach().to("cpu")
        except (TypeError, ValueError, RuntimeError) as error:
            raise TypeError(
                f"fitness_fn must return rewards [N] or [N, Q] as a tensor or nested lists of floats: {error}"
            ) from None
        if rewards.dim() not in (1, 2) or rewards.shape[0] != expected:
            raise ValueError(f"rewards must be [{expected}] or [{expected}, Q], got {tuple(rewards.shape)}")
        return rewards

    def apply_update(self, rewards: torch.Tensor | Sequence[Any]) -> StepStats:
        """Shape the rewards of all N members ([N] or [N, Q]) and apply this step's update; ends the step."""
        plan = self.plan()
        rewards_t = self._as_rewards(rewards, self.population)
        r_hat, info = shape_fitness(
            rewards_t, self.fitness, member_subspaces=plan.member_subspace, std_floor=self.std_floor
        )
        noise = self._step_noise()  # regenerated if rewards came from elsewhere (e.g. gathered from other ranks)
        start = time.perf_counter()
        update_norm = 0.0
        if not info["zero_update"]:  # no signal: leave the weights untouched
            update_norm = self._update(plan, noise, r_hat)
            self._space.synchronize()
        # No restore phase: evaluation never writes the weights.
        stats = StepStats.of_step(plan.step, info, update_norm, {**self._seconds, "update": time.perf_counter() - start})
        self._step += 1
        self._plan = None
        self._noise = None
        self._seconds = dict.fromkeys(self._seconds, 0.0)
        return stats

    def _update(self, plan: StepPlan, noise: list[_MatrixNoise], r_hat: torch.Tensor) -> float:
        """W += lr / (N_k sqrt(r)) sum_j r_hat_j A_j B_j^T per matrix; returns ||after - before|| over all of them."""
        scale = self.lr / (self.members_per_subspace * math.sqrt(self.rank))
        squared_norm = 0.0
        for matrix, matrix_noise, part in zip(self.matrices, noise, plan.partition):
            param = matrix.param
            members = plan.members_of(int(part[0]))
            target = param.data if param.master is None else param.master.to(param.data.device)
            before = target.clone()
            used = slice(0, matrix_noise.num_members)
            ck.lowrank_accumulate_(
                target, A=matrix_noise.A[used], B=matrix_noise.B[used], coeffs=r_hat[members], scale=scale,
                rounding="stochastic" if param.precision == "stochastic" else "nearest",
                seed=plan.seed, tensor_id=param.tensor_id,
            )
            squared_norm += float(torch.linalg.vector_norm(target.float() - before.float(), dtype=torch.float64)) ** 2
            if param.precision == "master_host":
                param.master.copy_(target)  # the staged device copy goes back to host memory
            if param.master is not None:
                param.data.copy_(target)
        return math.sqrt(squared_norm)

    def step(self, fitness_fn: BatchedFitnessFn) -> StepStats:
        """One full step: evaluate the whole population in one `fitness_fn(model, row_members)` call, then update
        the model in place."""
        return self.apply_update(self.evaluate(fitness_fn))

    # ---------------------------------------------------------------- resume

    def _config(self) -> dict[str, Any]:
        """The settings that change the trajectory: a resumed run must match them exactly."""
        return {
            "population": self.population,
            "num_subspaces": self.num_subspaces,
            "sigma": self.sigma,
            "lr": self.lr,
            "rank": self.rank,
            "seed": self.seed,
            "fitness": self.fitness,
            "std_floor": self.std_floor,
            "matrices": {m.param.name: m.param.precision for m in self.matrices},
        }

    def state_dict(self) -> dict[str, Any]:
        """Everything, besides the model's own weights, needed to continue bit-exactly (take it between steps):
        JSON-able `step` and `config`, and the fp32 master weights as CPU tensors keyed by parameter name."""
        return {
            "step": self._step,
            "config": self._config(),
            "master_weights": {
                m.param.name: m.param.master.detach().to("cpu", copy=True)
                for m in self.matrices
                if m.param.master is not None
            },
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume from `state_dict()`; the model must already hold the weights saved with it."""
        saved, current = state["config"], self._config()
        mismatched = sorted(k for k in current.keys() | saved.keys() if saved.get(k) != current.get(k))
        if mismatched:
            details = ", ".join(f"{k}: saved {saved.get(k)!r} vs now {current.get(k)!r}" for k in mismatched)
            raise ValueError(f"state_dict was saved with a different configuration ({details})")
        with torch.no_grad():
            for matrix in self.matrices:
                if matrix.param.master is not None:
                    matrix.param.master.copy_(state["master_weights"][matrix.param.name])
        self._step = int(state["step"])
        self._plan = None
        self._noise = None


def _check_batch(module_name: str, inputs: torch.Tensor, slots: torch.Tensor) -> None:
    if inputs.dim() == 0 or inputs.shape[0] != slots.shape[0]:
        raise ValueError(
            f"{module_name!r} got input {tuple(inputs.shape)} inside row_members(...) of {slots.shape[0]} rows: the "
            "batch must be dim 0 and match member_of_row"
        )


class EGGROLL(_LowRankES):
    """Low-rank ES: rank-`rank` noise on every targeted nn.Linear, the population evaluated in one batched call.

    es = EGGROLL(model, population=40, sigma=1e-3, lr=5e-4, rank=1)
    stats = es.step(fitness_fn)   # fitness_fn(model, row_members) -> rewards [N] or [N, Q]; inside
                                  # `with row_members(member_of_row):` row b of every forward is member_of_row[b]

    `full_rank_others=True` (full-rank noise on the frozen non-matrix parameters: norms, biases, embeddings)
    is rejected: a per-row copy of those tensors cannot ride in the one batched forward the way a rank-r term can,
    so it would need one evaluation per member. Use `copes.CoPES` for full-rank noise on every parameter.
    """

    def __init__(
        self,
        model: nn.Module,
        population: int = 40,
        sigma: float = 1e-3,
        lr: float = 5e-4,
        rank: int = 1,
        seed: int = 0,
        include: str | Sequence[str] | None = None,
        exclude: str | Sequence[str] | None = None,
        fitness: str = "per_question",
        full_rank_others: bool = False,
        std_floor: float = 1e-8,
        update_precision: str = "auto",
    ) -> None:
        if full_rank_others:
            raise ValueError(
                "full_rank_others=True needs a separate evaluation per member (a full-rank perturbation of norms, "
                "biases or embeddings has no per-row form in one batched forward); use copes.CoPES for full-rank "
                "noise on all parameters, or keep them frozen"
            )
        super().__init__(
            model, population=population, num_subspaces=1, sigma=sigma, lr=lr, rank=rank, seed=seed, include=include,
            exclude=exclude, fitness=fitness, std_floor=std_floor, update_precision=update_precision,
        )


class CoPESLowRank(_LowRankES):
    """CoPES over matrices with EGGROLL noise: each step the targeted matrices are split into K random groups and
    member j perturbs only group j % K's matrices (sigma_k = sqrt(K) sigma); rewards standardised jointly; each
    matrix is updated from its own group's N/K members. Same `step(fitness_fn(model, row_members))` as EGGROLL.
    """

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
        super().__init__(
            model, population=population, num_subspaces=num_subspaces, sigma=sigma, lr=lr, rank=rank, seed=seed,
            include=include, exclude=exclude, fitness=fitness, std_floor=std_floor, update_precision=update_precision,
        )

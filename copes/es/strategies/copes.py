"""CoPES: cooperative parameter-subspace evolution strategies. Standard ES is CoPES with num_subspaces=1.

Step t:
    seed_t      = first 8 bytes (little-endian) of blake2b("copes-step:{seed}:{t}"): a 64-bit seed that is a pure
                  function of (seed, t), the same on every rank and after a resume
    partition   = make_partition(chunk counts, K, seed_t): every chunk of every parameter -> one of K subspaces
    member i    in subspace k(i) = i % K (interleaved, so any contiguous shard of members covers the subspaces
                evenly), perturbs only its subspace's chunks: w + s_i * sigma_k * eps_i, sigma_k = sqrt(K) sigma
                (sigma with scale_sigma=False, the paper's ablation); eps_i is noise stream i, s_i = +1
    antithetic  the j-th member of a subspace pairs with the (j+1)-th for even j: the pair shares the stream of
                its first member, with s = +1 and -1
    fitness     r_hat = shape_fitness(rewards) (copes.es.fitness; joint z-score by default)
    gradient    g = sum_k P_k g_k,  g_k = (1/N_k) sum_{i in k} r_hat_i s_i eps_i,  N_k = N / K
    update      SGD: w += lr * g, accumulated chunk by chunk from regenerated noise (no full-size noise buffer);
                Adam: g materialised slice by slice in fp32, then w += lr * m_hat / (sqrt(v_hat) + adam_eps)

`step(fitness_fn)` = `plan()`, `evaluate_member(i, fitness_fn)` for every member, `apply_update(rewards)`: the
three phases are public so a trainer can shard members across processes and report progress.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from typing import Any, ClassVar

import torch

import copes_kernels as ck
from copes.choices import OPTIMIZERS
from copes.es.params import ParameterSpace, TrainableParameter
from copes.es.strategies.base import (
    MAX_POPULATION,
    PER_MEMBER,
    ESBase,
    Evaluation,
    FitnessFn,
    StepPlan,
    StepStats,
    step_seed,
)

__all__ = ["MAX_POPULATION", "OPTIMIZERS", "CoPES", "FitnessFn", "StepPlan", "StepStats", "step_seed"]


def _as_rewards(value: Any) -> torch.Tensor:
    """A fitness result as float64: 0-d for one score, [Q] for per-question scores (None -> NaN: missing)."""
    if value is None:
        return torch.tensor(math.nan, dtype=torch.float64)
    if isinstance(value, (list, tuple)):
        value = [math.nan if v is None else v for v in value]
    try:
        rewards = torch.as_tensor(value, dtype=torch.float64, device="cpu").detach()
    except (TypeError, ValueError, RuntimeError) as error:
        raise TypeError(
            f"fitness_fn must return a float or a sequence of per-question floats, got {type(value).__name__}"
        ) from error
    if rewards.dim() > 1:
        raise ValueError(f"fitness_fn must return a scalar or a 1-D sequence, got shape {tuple(rewards.shape)}")
    return rewards


def _stack_rewards(per_member: list[torch.Tensor]) -> torch.Tensor:
    """[N] from scalars, or [N, Q] from per-question vectors (shorter ones padded with NaN: missing answers)."""
    scalar = [r.dim() == 0 for r in per_member]
    if all(scalar):
        return torch.stack(per_member)
    if any(scalar):
        raise ValueError("fitness_fn returned a scalar for some members and per-question rewards for others")
    questions = max(r.numel() for r in per_member)
    stacked = torch.full((len(per_member), questions), math.nan, dtype=torch.float64)
    for row, rewards in zip(stacked, per_member):
        row[: rewards.numel()] = rewards
    return stacked


class _Adam:
    """Adam on the ES gradient estimate, fp32 moments on each parameter's device, fed slice by slice."""

    def __init__(self, parameters: list[TrainableParameter], lr: float, betas: tuple[float, float], eps: float):
        self.lr, self.betas, self.eps = lr, betas, eps
        self.steps = 0
        self.exp_avg = [torch.zeros(p.numel, dtype=torch.float32, device=p.data.device) for p in parameters]
        self.exp_avg_sq = [torch.zeros(p.numel, dtype=torch.float32, device=p.data.device) for p in parameters]

    def __call__(self, index: int, offset: int, gradient: torch.Tensor) -> torch.Tensor:
        beta1, beta2 = self.betas
        exp_avg = self.exp_avg[index][offset : offset + gradient.numel()]
        exp_avg_sq = self.exp_avg_sq[index][offset : offset + gradient.numel()]
        exp_avg.mul_(beta1).add_(gradient, alpha=1 - beta1)
        exp_avg_sq.mul_(beta2).addcmul_(gradient, gradient, value=1 - beta2)
        # Ascent: ES maximises the reward, so the step follows +g.
        bias1, bias2 = 1 - beta1**self.steps, 1 - beta2**self.steps
        return (self.lr / bias1) * exp_avg / ((exp_avg_sq / bias2).sqrt_().add_(self.eps))


class CoPES(ESBase):
    """Cooperative parameter-subspace ES on any `torch.nn.Module` (see the module docstring for the math).

    es = CoPES(model, population=40, num_subspaces=4, sigma=1e-3, lr=5e-4, seed=0)
    stats = es.step(fitness_fn)   # fitness_fn(model) -> float | sequence of per-question floats
    """

    evaluation: ClassVar[Evaluation] = PER_MEMBER

    def __init__(
        self,
        model: torch.nn.Module,
        population: int = 40,
        num_subspaces: int = 4,
        sigma: float = 1e-3,
        lr: float = 5e-4,
        seed: int = 0,
        chunk_size: int = ck.DEFAULT_CHUNK_SIZE,
        include: str | Sequence[str] | None = None,
        exclude: str | Sequence[str] | None = None,
        restore: str = "device",
        update_precision: str = "auto",
        fitness: str = "joint",
        scale_sigma: bool = True,
        antithetic: bool = False,
        optimizer: str = "sgd",
        adam_betas: tuple[float, float] = (0.9, 0.999),
        adam_eps: float = 1e-8,
        std_floor: float = 1e-8,
        stream_elements: int | None = None,
    ) -> None:
        super().__init__(model, population=population, num_subspaces=num_subspaces, sigma=sigma, lr=lr, seed=seed,
                         fitness=fitness, std_floor=std_floor, scale_sigma=scale_sigma)
        self._validate(antithetic, optimizer, adam_betas, adam_eps, update_precision)
        self.antithetic = bool(antithetic)
        self.optimizer = optimizer
        self.adam_betas = (float(adam_betas[0]), float(adam_betas[1]))
        self.adam_eps = float(adam_eps)
        # Adam needs arbitrary fp32 deltas, which stochastic rounding of noise sums cannot apply: keep masters.
        if update_precision == "auto" and optimizer == "adam":
            update_precision = "master_device"
        self.space = ParameterSpace(
            model, include, exclude, chunk_size,
            restore=restore, update_precision=update_precision, stream_elements=stream_elements,
            sub_ulp_sigma=self.sigma_k,  # 16-bit tensors whose noise rounds away are left out, by name
        )
        self.space.fit_chunk_size(self.num_subspaces)
        self._adam = (_Adam(self.space.parameters, self.lr, self.adam_betas, self.adam_eps) if optimizer == "adam"
                      else None)

    def _validate(self, antithetic, optimizer, adam_betas, adam_eps, update_precision) -> None:
        if antithetic and self.members_per_subspace % 2:
            raise ValueError(
                f"antithetic=True pairs members inside each subspace, but population/num_subspaces = "
                f"{self.members_per_subspace} is odd"
            )
        if optimizer not in OPTIMIZERS:
            raise ValueError(f"optimizer must be one of {OPTIMIZERS}, got {optimizer!r}")
        if len(adam_betas) != 2 or not all(0 <= float(b) < 1 for b in adam_betas):
            raise ValueError(f"adam_betas must be two numbers in [0, 1), got {adam_betas}")
        if not (math.isfinite(float(adam_eps)) and float(adam_eps) > 0):
            raise ValueError(f"adam_eps must be a finite number > 0, got {adam_eps}")
        if optimizer == "adam" and update_precision == "stochastic":
            raise ValueError(
                "update_precision='stochastic' cannot apply Adam steps; use 'master_device' or 'master_host' "
                "(or 'auto', which picks master_device for 16-bit parameters under Adam)"
            )

    # ---------------------------------------------------------------- phases

    def plan(self) -> StepPlan:
        """This step's seed, partition and member layout (built once per step, then reused)."""
        if self._plan is None:
            seed = step_seed(self.seed, self._step)
            members = torch.arange(self.population, dtype=torch.int64)
            member_subspace = members % self.num_subspaces
            rank_in_subspace = members // self.num_subspaces
            second_of_pair = ((rank_in_subspace % 2 == 1) if self.antithetic
                              else torch.zeros_like(members, dtype=torch.bool))
            self._plan = StepPlan(
                step=self._step,
                seed=seed,
                sigma=self.sigma_k,
                partition=self.space.partition(seed, self.num_subspaces),
                member_subspace=member_subspace,
                noise_member=torch.where(second_of_pair, members - self.num_subspaces, members),
                noise_sign=torch.where(second_of_pair, -1.0, 1.0).to(torch.float64),
            )
        return self._plan

    def evaluate_member(self, member: int, fitness_fn: FitnessFn) -> torch.Tensor:
        """Perturb for `member`, call fitness_fn(model) under torch.no_grad(), restore; returns the rewards as
        float64 (0-d for one score, [Q] for per-question scores). The weights are restored even if it raises."""
        plan = self.plan()
        if not 0 <= int(member) < self.population:
            raise ValueError(f"member must be in [0, {self.population}), got {member}")
        start = time.perf_counter()
        self.space.perturb(
            plan.partition,
            seed=plan.seed,
            member=int(plan.noise_member[member]),
            subspace=int(plan.member_subspace[member]),
            sigma=float(plan.noise_sign[member]) * plan.sigma,
        )
        self.space.synchronize()
        perturbed = time.perf_counter()
        try:
            with torch.no_grad():
                value = fitness_fn(self.model)
        finally:
            evaluated = time.perf_counter()
            self.space.restore()
            self.space.synchronize()
            restored = time.perf_counter()
            self._seconds["perturb"] += perturbed - start
            self._seconds["rollout"] += evaluated - perturbed
            self._seconds["restore"] += restored - evaluated
        return _as_rewards(value)

    def _update(self, plan: StepPlan, r_hat: torch.Tensor) -> float:
        gradient_coeffs = r_hat * plan.noise_sign / self.members_per_subspace
        # An antithetic pair shares one stream: merge its two coefficients so the update regenerates it once.
        streams, inverse = torch.unique(plan.noise_member, return_inverse=True)
        merged = torch.zeros(streams.numel(), dtype=torch.float64).index_add_(0, inverse, gradient_coeffs)
        stream_subspaces = torch.empty_like(streams).scatter_(0, inverse, plan.member_subspace)
        if self._adam is None:
            coeffs, rule = merged * self.lr, None
        else:
            self._adam.steps += 1
            coeffs, rule = merged, self._adam
        return self.space.apply_update(
            plan.partition, seed=plan.seed, members=streams, coeffs=coeffs, member_subspaces=stream_subspaces, rule=rule
        )

    def step(self, fitness_fn: FitnessFn, on_member: Callable[[int, torch.Tensor], None] | None = None) -> StepStats:
        """One full step: evaluate every member with its perturbation applied, then update the model in place.

        `on_member(i, rewards)` is called after member i (e.g. to advance a progress bar).
        """
        per_member = []
        for member in range(self.population):
            rewards = self.evaluate_member(member, fitness_fn)
            if on_member is not None:
                on_member(member, rewards)
            per_member.append(rewards)
        return self.apply_update(_stack_rewards(per_member))

    # ---------------------------------------------------------------- resume

    def _config(self) -> dict[str, Any]:
        return {
            **self._shared_config(),
            "chunk_size": self.space.chunk_size,
            "scale_sigma": self.scale_sigma,
            "antithetic": self.antithetic,
            "optimizer": self.optimizer,
            "adam_betas": list(self.adam_betas),
            "adam_eps": self.adam_eps,
            "parameters": {p.name: p.precision for p in self.space.parameters},
        }

    def state_dict(self) -> dict[str, Any]:
        """Everything, besides the model's own weights, needed to continue bit-exactly (take it between steps).

        JSON-able values (`step`, `config`) plus CPU tensors keyed by parameter name (Adam moments, fp32 masters).
        """
        state = super().state_dict()
        if self._adam is not None:
            names = self.space.names
            state["adam"] = {
                "steps": self._adam.steps,
                "exp_avg": {n: t.to("cpu", copy=True) for n, t in zip(names, self._adam.exp_avg)},
                "exp_avg_sq": {n: t.to("cpu", copy=True) for n, t in zip(names, self._adam.exp_avg_sq)},
            }
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume from `state_dict()`; the model must already hold the weights saved with it."""
        super().load_state_dict(state)
        if self._adam is not None:
            with torch.no_grad():
                self._adam.steps = int(state["adam"]["steps"])
                for name, exp_avg, exp_avg_sq in zip(self.space.names, self._adam.exp_avg, self._adam.exp_avg_sq):
                    exp_avg.copy_(state["adam"]["exp_avg"][name])
                    exp_avg_sq.copy_(state["adam"]["exp_avg_sq"][name])

"""What every ES strategy shares: the step seed, the step plan and stats, reward checks, the validation of the
common settings, the resume check, and the `Strategy` protocol the trainer drives.

A strategy evaluates its population in one of two shapes, named by its `evaluation` attribute:
    PER_MEMBER        `evaluate_member(i, fitness_fn(model))`: member i's perturbation is written into the
                      weights for the call and undone after it (CoPES, standard ES)
    WHOLE_POPULATION  `evaluate(fitness_fn(model, row_members), members)`: one call for all members, each batch
                      row routed to its member's perturbation; the weights are never written (EGGROLL family)
Both end a step with `apply_update(rewards)`, which shapes the rewards of all N members and moves the weights
through the strategy's `ParameterSpace`, the one writer of trainable weights.
"""

from __future__ import annotations

import hashlib
import math
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, Literal, Protocol

import torch

from copes.es.fitness import FITNESS_MODES, shape_fitness
from copes.es.params import ParameterSpace

# Member ids are uint32 noise streams; the kernels reserve the top of that range for non-member streams.
MAX_POPULATION = 1 << 31

PER_MEMBER = "member"
WHOLE_POPULATION = "population"
Evaluation = Literal["member", "population"]

# Time inside one step: noise applied (or factors generated), the fitness function's rollouts, the undo, the update.
STEP_PHASES = ("perturb", "rollout", "restore", "update")

FitnessFn = Callable[[torch.nn.Module], Any]


def step_seed(seed: int, step: int) -> int:
    """The uint64 noise seed of step `step` of a run seeded with `seed`: the first 8 bytes (little-endian) of
    blake2b("copes-step:{seed}:{step}"), the same on every rank and after a resume."""
    digest = hashlib.blake2b(f"copes-step:{int(seed)}:{int(step)}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little")


@dataclass(frozen=True)
class StepPlan:
    """Everything that fixes one step's perturbations: identical on every process that builds it."""

    step: int
    seed: int
    sigma: float  # sigma_k, the per-member noise scale
    partition: list[torch.Tensor]  # per trainable parameter: chunk -> subspace (int16)
    member_subspace: torch.Tensor  # [N] int64: the subspace member i perturbs
    noise_member: torch.Tensor  # [N] int64: the noise stream member i uses (shared by an antithetic pair)
    noise_sign: torch.Tensor  # [N] float64: +1, or -1 for the second member of an antithetic pair

    def members_of(self, subspace: int) -> list[int]:
        return torch.nonzero(self.member_subspace == subspace).flatten().tolist()


@dataclass
class StepStats:
    """What one step did. Rewards are per-member means (over questions), after NaN/inf were scored as failures.

    `update_norm` is the L2 norm of the change actually applied to the trainable weights (the fp32 masters when
    the model keeps them), measured exactly as ||after - before|| slice by slice during the update.
    `rollout_seconds` is the time inside the fitness function (the population's rollouts and scoring); held-out
    evaluation is the trainer's, not a step phase.
    """

    step: int
    mean_reward: float
    max_reward: float
    min_reward: float
    std_reward: float
    num_invalid_rewards: int
    update_norm: float
    zero_update: bool
    perturb_seconds: float
    rollout_seconds: float
    restore_seconds: float
    update_seconds: float

    @classmethod
    def of_step(cls, step: int, info: dict[str, Any], update_norm: float, seconds: dict[str, float]) -> StepStats:
        """Stats from shape_fitness's `info`, the applied norm and the seconds per phase (STEP_PHASES; a phase a
        strategy does not have counts 0)."""
        return cls(
            step=step, mean_reward=info["mean"], max_reward=info["max"], min_reward=info["min"], std_reward=info["std"],
            num_invalid_rewards=info["num_invalid"], update_norm=update_norm, zero_update=info["zero_update"],
            **{f"{phase}_seconds": seconds.get(phase, 0.0) for phase in STEP_PHASES},
        )

    def phase_seconds(self) -> dict[str, float]:
        return {phase: getattr(self, f"{phase}_seconds") for phase in STEP_PHASES}


def population_rewards(value: Any, rows: int) -> torch.Tensor:
    """Rewards of `rows` members as float64 on the CPU, [rows] or [rows, Q]; anything else is rejected."""
    try:
        rewards = torch.as_tensor(value, dtype=torch.float64).detach().to("cpu")
    except (TypeError, ValueError, RuntimeError) as error:
        raise TypeError(
            f"fitness_fn must return rewards [N] or [N, Q] as a tensor or nested lists of floats: {error}"
        ) from None
    if rewards.dim() not in (1, 2) or rewards.shape[0] != rows:
        raise ValueError(f"rewards must be [{rows}] or [{rows}, Q], got {tuple(rewards.shape)}")
    return rewards


def validate_common(population: int, num_subspaces: int, sigma: float, lr: float, seed: int, fitness: str,
                    std_floor: float) -> None:
    """The checks every strategy makes of the settings they share (a ValueError naming the argument)."""
    if int(num_subspaces) < 1:
        raise ValueError(f"num_subspaces must be >= 1, got {num_subspaces}")
    if not 1 <= int(population) <= MAX_POPULATION:
        raise ValueError(f"population must be in [1, {MAX_POPULATION}], got {population}")
    if int(population) % int(num_subspaces):
        raise ValueError(f"population={population} must be divisible by num_subspaces={num_subspaces}")
    for name, value in (("sigma", sigma), ("lr", lr)):
        if not (math.isfinite(float(value)) and float(value) > 0):
            raise ValueError(f"{name} must be a finite number > 0, got {value}")
    if int(seed) < 0:
        raise ValueError(f"seed must be >= 0, got {seed}")
    if fitness not in FITNESS_MODES:
        raise ValueError(f"fitness must be one of {FITNESS_MODES}, got {fitness!r}")
    if not (math.isfinite(float(std_floor)) and float(std_floor) >= 0):
        raise ValueError(f"std_floor must be a finite number >= 0, got {std_floor}")


def check_same_config(saved: dict[str, Any], current: dict[str, Any]) -> None:
    """A resumed run must have the settings that shaped the saved trajectory."""
    mismatched = sorted(k for k in current.keys() | saved.keys() if saved.get(k) != current.get(k))
    if mismatched:
        details = ", ".join(f"{k}: saved {saved.get(k)!r} vs now {current.get(k)!r}" for k in mismatched)
        raise ValueError(f"state_dict was saved with a different configuration ({details})")


class Strategy(Protocol):
    """What the trainer drives. It calls `evaluate_member` (PER_MEMBER) or `evaluate` (WHOLE_POPULATION) as
    `evaluation` says, then `apply_update`; `state_dict` / `load_state_dict` carry the rest across a resume."""

    evaluation: ClassVar[Evaluation]
    population: int
    num_subspaces: int
    space: ParameterSpace

    @property
    def step_count(self) -> int: ...

    def plan(self) -> StepPlan: ...

    def apply_update(self, rewards: torch.Tensor | Sequence[Any]) -> StepStats: ...

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


class PerMemberStrategy(Strategy, Protocol):
    """evaluation == PER_MEMBER: `fitness_fn(model)` runs once per member with its perturbation in the weights."""

    def evaluate_member(self, member: int, fitness_fn: FitnessFn) -> torch.Tensor: ...


class PopulationStrategy(Strategy, Protocol):
    """evaluation == WHOLE_POPULATION: `fitness_fn(model, row_members)` runs once for `members` (all by default),
    every batch row routed to its member inside `with row_members(member_of_row):`."""

    def evaluate(self, fitness_fn: Callable[..., Any], members: Sequence[int] | None = None) -> torch.Tensor: ...


class ESBase(ABC):
    """The step bookkeeping both strategy families share; a subclass builds `self.space`, implements `plan()`,
    `_update(plan, r_hat) -> applied norm` and `_config()`."""

    evaluation: ClassVar[Evaluation]
    space: ParameterSpace

    def __init__(self, model: torch.nn.Module, *, population: int, num_subspaces: int, sigma: float, lr: float,
                 seed: int, fitness: str, std_floor: float, scale_sigma: bool = True) -> None:
        validate_common(population, num_subspaces, sigma, lr, seed, fitness, std_floor)
        self.model = model
        self.population = int(population)
        self.num_subspaces = int(num_subspaces)
        self.sigma = float(sigma)
        self.lr = float(lr)
        self.seed = int(seed)
        self.fitness = fitness
        self.std_floor = float(std_floor)
        self.scale_sigma = bool(scale_sigma)
        self._step = 0
        self._plan: StepPlan | None = None
        self._seconds = dict.fromkeys(STEP_PHASES[:-1], 0.0)  # the update is timed by apply_update itself

    @property
    def step_count(self) -> int:
        """Completed steps (the index of the next step)."""
        return self._step

    @property
    def members_per_subspace(self) -> int:
        return self.population // self.num_subspaces

    @property
    def sigma_k(self) -> float:
        """The per-member noise scale: sqrt(K) * sigma (sigma itself with scale_sigma=False)."""
        return math.sqrt(self.num_subspaces) * self.sigma if self.scale_sigma else self.sigma

    @abstractmethod
    def plan(self) -> StepPlan:
        """This step's seed, partition and member layout (built once per step, then reused)."""

    @abstractmethod
    def _update(self, plan: StepPlan, r_hat: torch.Tensor) -> float:
        """Apply the update of shaped rewards `r_hat` through `self.space`; returns the applied norm."""

    @abstractmethod
    def _config(self) -> dict[str, Any]:
        """The settings that change the trajectory: a resumed run must match them exactly (`_shared_config()`
        plus the strategy's own)."""

    def _shared_config(self) -> dict[str, Any]:
        return {"population": self.population, "num_subspaces": self.num_subspaces, "sigma": self.sigma,
                "lr": self.lr, "seed": self.seed, "fitness": self.fitness, "std_floor": self.std_floor}

    def apply_update(self, rewards: torch.Tensor | Sequence[Any]) -> StepStats:
        """Shape the rewards of all N members ([N] or [N, Q]) and apply this step's update; ends the step."""
        plan = self.plan()
        rewards_t = population_rewards(rewards, self.population)
        r_hat, info = shape_fitness(
            rewards_t, self.fitness, member_subspaces=plan.member_subspace, std_floor=self.std_floor
        )
        self._prepare_update()
        start = time.perf_counter()
        update_norm = 0.0
        if not info["zero_update"]:  # no signal: leave the weights (and any optimizer state) untouched
            update_norm = self._update(plan, r_hat)
            self.space.synchronize()
        stats = StepStats.of_step(plan.step, info, update_norm,
                                  {**self._seconds, "update": time.perf_counter() - start})
        self._step += 1
        self._end_step()
        return stats

    def _prepare_update(self) -> None:  # noqa: B027 - an optional hook, a no-op unless a strategy overrides it
        """Hook: work the update needs that is not update time (EGGROLL regenerates gathered ranks' factors)."""

    def _end_step(self) -> None:
        self._plan = None
        self._seconds = dict.fromkeys(self._seconds, 0.0)

    def state_dict(self) -> dict[str, Any]:
        """Everything, besides the model's own weights, needed to continue bit-exactly (take it between steps):
        JSON-able `step` and `config`, and the fp32 master weights as CPU tensors keyed by parameter name."""
        return {"step": self._step, "config": self._config(), "master_weights": self.space.master_state()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume from `state_dict()`; the model must already hold the weights saved with it."""
        check_same_config(state["config"], self._config())
        self.space.load_master_state(state["master_weights"])
        self._step = int(state["step"])
        self._end_step()


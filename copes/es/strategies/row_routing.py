"""Per-row routing of a low-rank population through an unmodified model (the EGGROLL family's evaluation).

Inside `route_rows(...)` every targeted `nn.Linear` runs as `ck.lowrank_linear` (one base GEMM for the whole
batch plus a rank-r term per row), so batch row b sees W + sigma_k / sqrt(r) * A_j B_j^T with j its member; a
plain `nn.Embedding` that shares the weight (tied lm_head == embed_tokens) gets the same correction on its
lookup. Leaving the block puts every module back. Nothing here writes a weight.

The block yields a `RoutedRows`: the same routing as data, for an engine that does not run these modules' forwards
(vLLM applies each member as a LoRA adapter built from `member_factors`, copes.rollout.vllm.lora).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch
from torch import nn

import copes_kernels as ck
from copes.es.params import TrainableParameter

RowMembers = Callable[[torch.Tensor], contextlib.AbstractContextManager["RoutedRows"]]


@dataclass(eq=False)
class LowRankMatrix:
    """One targeted weight matrix and every module that reads it (several when weights are tied)."""

    param: TrainableParameter  # name, tensor_id, update precision, fp32 master
    weight: nn.Parameter
    linears: list[tuple[str, nn.Linear]] = field(default_factory=list)
    embeddings: list[tuple[str, nn.Embedding]] = field(default_factory=list)


@dataclass
class MatrixNoise:
    """This step's factors of one matrix, for the members of its group, plus a zero slot for everyone else."""

    A: torch.Tensor  # [N_k (+1), m, r] float32
    B: torch.Tensor  # [N_k (+1), n, r] float32
    slot_of_member: torch.Tensor  # [N] int64: member -> row of A/B (the zero slot for other groups' members)
    num_members: int  # N_k: rows 0 .. N_k - 1 of A/B are the group's members, in member order


@dataclass(frozen=True)
class RoutedRows:
    """What `route_rows` yields: which member each batch row is, and each member's factors by module name.

    `noise` is the step's list of factors itself, made once per step and never changed: two blocks whose `noise` is
    the same object (and `scale` equal) route the same perturbations. `step` is for people (adapter names)."""

    step: int
    member_of_row: torch.Tensor  # [rows] int64
    scale: float  # sigma_k / sqrt(r): member j's weight is W + scale * A_j B_j^T
    matrices: list[LowRankMatrix]
    noise: list[MatrixNoise]

    def member_factors(self, member: int) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        """{module name: (A_j [m, r], B_j [n, r])} for every nn.Linear reading a matrix that `member` perturbs (a
        matrix of another group has no entry: its correction is zero)."""
        factors = {}
        for matrix, noise in zip(self.matrices, self.noise):
            slot = int(noise.slot_of_member[member])
            if slot < noise.num_members:
                factors.update({name: (noise.A[slot], noise.B[slot]) for name, _ in matrix.linears})
        return factors


def linear_weight_names(model: nn.Module, candidates: list[tuple[str, nn.Parameter]]) -> list[str]:
    """The candidates that are the weight of some `nn.Linear` (the low-rank targets), in model order."""
    linear_weights = {id(module.weight) for module in model.modules() if type(module) is nn.Linear}
    return [name for name, param in candidates if id(param) in linear_weights]


def find_matrices(model: nn.Module, targets: list[TrainableParameter]) -> list[LowRankMatrix]:
    """Each target's `LowRankMatrix` with every module that reads it, in the order of the first nn.Linear that
    reads each (the order `plan().partition` indexes); a target that another kind of module also reads cannot be
    perturbed per row (ValueError)."""
    params_by_name = dict(model.named_parameters())
    target_by_id = {id(params_by_name[p.name]): p for p in targets}
    matrices: dict[int, LowRankMatrix] = {}
    for module_name, module in model.named_modules():
        if type(module) is nn.Linear and id(module.weight) in target_by_id:
            matrix = matrices.setdefault(id(module.weight),
                                         LowRankMatrix(target_by_id[id(module.weight)], module.weight))
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
    return list(matrices.values())


@contextlib.contextmanager
def route_rows(
    matrices: list[LowRankMatrix], noise: list[MatrixNoise], member_of_row: torch.Tensor, *, sigma: float,
    factor_norm: float, step: int,
) -> Iterator[RoutedRows]:
    """Inside the block, batch row b of every forward uses member `member_of_row[b]`'s perturbation (already
    validated by the caller, int64). `sigma` is sigma_k; A_j B_j^T is divided by `factor_norm` (sqrt(r)) in the
    embedding correction, as `ck.lowrank_linear` does internally for the linears. Yields the routing as data."""
    undo: list[Callable[[], None]] = []
    try:
        for matrix, matrix_noise in zip(matrices, noise):
            slots = matrix_noise.slot_of_member[member_of_row.to(matrix_noise.slot_of_member.device)]
            for name, linear in matrix.linears:
                undo.append(_route_linear(name, linear, matrix_noise, slots, sigma))
            for name, embedding in matrix.embeddings:
                undo.append(_perturb_embedding(name, embedding, matrix_noise, slots, sigma / factor_norm).remove)
        yield RoutedRows(step, member_of_row, sigma / factor_norm, matrices, noise)
    finally:
        for restore in reversed(undo):
            restore()


def _route_linear(
    name: str, linear: nn.Linear, noise: MatrixNoise, slots: torch.Tensor, sigma: float
) -> Callable[[], None]:
    """Replace `linear.forward` by the batched low-rank linear; returns the function that puts it back."""

    def forward(x: torch.Tensor) -> torch.Tensor:
        _check_batch(name, x, slots)
        # The rows were validated once for the whole block (row_members): no per-call read-back of slots.
        return ck.lowrank_linear(
            x, linear.weight, linear.bias, A=noise.A, B=noise.B, row_member=slots, sigma=sigma, check_rows=False
        )

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
    name: str, embedding: nn.Embedding, noise: MatrixNoise, slots: torch.Tensor, scale: float
) -> torch.utils.hooks.RemovableHandle:
    """Add row b's correction scale * A_j[token] B_j^T to a tied embedding's lookup."""

    def hook(module: nn.Module, inputs: tuple[torch.Tensor, ...], output: torch.Tensor) -> torch.Tensor:
        token_ids = inputs[0]
        _check_batch(name, token_ids, slots)
        ids = token_ids.reshape(token_ids.shape[0], -1)  # [batch, tokens]
        # Gather only the looked-up rows of A: A[slots] would copy [batch, vocab, r].
        a_rows = noise.A[slots[:, None].expand_as(ids), ids]  # [batch, tokens, r]
        correction = torch.bmm(a_rows, noise.B[slots].transpose(1, 2))  # [batch, tokens, dim]
        return (output.float() + scale * correction.view(output.shape)).to(output.dtype)

    return embedding.register_forward_hook(hook)


def _check_batch(module_name: str, inputs: torch.Tensor, slots: torch.Tensor) -> None:
    if inputs.dim() == 0 or inputs.shape[0] != slots.shape[0]:
        raise ValueError(
            f"{module_name!r} got input {tuple(inputs.shape)} inside row_members(...) of {slots.shape[0]} rows: the "
            "batch must be dim 0 and match member_of_row"
        )

"""Embed the fused ES kernels in your own trainer: CoPES on a small torch model, CPU, nothing but copes_kernels.

Each step: draw a random chunk partition into K subspaces; for every subspace back up its chunks, evaluate N/K
members perturbed only there (sigma_k = sqrt(K) sigma), restore bit-exactly; z-score all N rewards jointly and
apply one fused update theta += alpha * sum_k (1/N_k) sum_i r_hat_{k,i} eps_{k,i} regenerated from seeds.

    python examples/embed_es.py --steps 200
"""

from __future__ import annotations

import argparse
import math

import torch

import copes_kernels as ck


def evolve(steps: int, population: int = 16, subspaces: int = 4, sigma: float = 0.05, alpha: float = 0.02,
           chunk_size: int = 32, log_every: int = 20) -> list[float]:
    """Fit y = sin(3 x0) + x1^2 with a 2-16-1 MLP by ES; returns the unperturbed reward (-MSE) every step."""
    generator = torch.Generator().manual_seed(0)
    x = torch.rand(256, 2, generator=generator) * 2 - 1
    y = torch.sin(3 * x[:, :1]) + x[:, 1:] ** 2
    with torch.random.fork_rng(devices=[]):  # the same starting model on every call, the caller's RNG untouched
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(2, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    params = [p.data for p in model.parameters()]  # tensor_id = position: stable across steps

    def reward() -> float:
        return -torch.nn.functional.mse_loss(model(x), y).item()

    members_per_subspace, sigma_k = population // subspaces, math.sqrt(subspaces) * sigma
    history = []
    with torch.no_grad():
        for step in range(steps):
            chunk_counts = [ck.num_chunks(p.numel(), chunk_size) for p in params]
            partition = ck.make_partition(chunk_counts, num_subspaces=subspaces, seed=step)
            chunking = [dict(chunk_subspace=part, chunk_size=chunk_size) for part in partition]
            rewards = torch.empty(population)
            for k in range(subspaces):
                backups = [ck.backup_chunks(p, subspace=k, **c) for p, c in zip(params, chunking)]
                for member in range(k * members_per_subspace, (k + 1) * members_per_subspace):
                    for tensor_id, (p, c) in enumerate(zip(params, chunking)):
                        ck.perturb_(p, seed=step, member=member, tensor_id=tensor_id, sigma=sigma_k, subspace=k, **c)
                    rewards[member] = reward()
                    for p, c, backup in zip(params, chunking, backups):
                        ck.restore_chunks_(p, backup, subspace=k, **c)
            coeffs = alpha * (rewards - rewards.mean()) / (rewards.std() + 1e-8) / members_per_subspace
            member_subspaces = torch.arange(population) // members_per_subspace
            for tensor_id, (p, c) in enumerate(zip(params, chunking)):
                ck.accumulate_(p, seed=step, members=range(population), coeffs=coeffs, tensor_id=tensor_id,
                               member_subspaces=member_subspaces, **c)
            history.append(reward())
            if log_every and (step % log_every == 0 or step == steps - 1):
                print(f"step {step:4d}  reward {history[-1]:.4f}")
    return history


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--population", type=int, default=16)
    parser.add_argument("--subspaces", type=int, default=4)
    args = parser.parse_args()
    evolve(args.steps, population=args.population, subspaces=args.subspaces)

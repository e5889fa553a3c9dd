"""Port an OpenAI-ES loop onto copes_kernels: a bfloat16 torch model, one seed per member, nothing but the kernels.

The loop of OpenAI-ES code (es-at-scale and most others): each iteration draws one seed per member, perturbs the
weights with that member's Gaussian noise, evaluates, undoes the perturbation, and moves the weights along the
reward-weighted sum of the noises. On `ck.WeightSet` each of those is one call:

    weights.perturb(seed=seeds[j], member=j, sigma=sigma)     # in place; the touched bits are backed up
    weights.restore()                                         # exact: a bf16 subtract-restore is not
    weights.update(coeffs, members=range(n), seeds=seeds, lr=lr, rounding="stochastic")   # one pass

Stochastic rounding keeps the bf16 update unbiased: a step far below one bf16 ulp of a weight still moves it on
average, where round-to-nearest would drop it. Noise is regenerated from (seed, member, tensor_id), never stored.

    python examples/openai_es.py --iterations 200
"""

from __future__ import annotations

import argparse

import numpy as np
import torch

import copes_kernels as ck


def evolve(iterations: int, population: int = 16, sigma: float = 0.05, lr: float = 0.02,
           log_every: int = 20) -> list[float]:
    """Fit y = sin(3 x0) + x1^2 with a bfloat16 2-16-1 MLP by OpenAI-ES; returns the unperturbed reward (-MSE)
    after every iteration."""
    generator = torch.Generator().manual_seed(0)
    x = torch.rand(256, 2, generator=generator) * 2 - 1
    y = torch.sin(3 * x[:, :1]) + x[:, 1:] ** 2
    with torch.random.fork_rng(devices=[]):  # the same starting model on every call, the caller's RNG untouched
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(2, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    model = model.to(torch.bfloat16)
    weights = ck.WeightSet.from_named(model.named_parameters())  # tensor ids: CRC-32 of the parameter names
    seed_source = np.random.default_rng(0)

    def reward() -> float:
        with torch.no_grad():
            return -torch.nn.functional.mse_loss(model(x.to(torch.bfloat16)).float(), y).item()

    history = []
    for iteration in range(iterations):
        seeds = [int(s) for s in seed_source.integers(0, 2**63, size=population)]
        rewards = []
        for member, seed in enumerate(seeds):
            weights.perturb(seed=seed, member=member, sigma=sigma)
            rewards.append(reward())
            weights.restore()
        r = torch.tensor(rewards)
        coeffs = (r - r.mean()) / (r.std() + 1e-8) / (population * sigma)  # standardised rewards / (N sigma)
        weights.update(coeffs, members=range(population), seeds=seeds, lr=lr, rounding="stochastic")
        history.append(reward())
        if log_every and (iteration % log_every == 0 or iteration == iterations - 1):
            print(f"iteration {iteration:4d}  reward {history[-1]:+.4f}")
    return history


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--iterations", type=int, default=200)
    parser.add_argument("--population", type=int, default=16)
    args = parser.parse_args()
    evolve(args.iterations, args.population)


if __name__ == "__main__":
    main()

"""CoPES (K=4) vs standard ES (K=1) on an MLP regression (reward = -MSE), equal evaluations per step, 3 seeds.

Both use N=40 members per step (so the same number of fitness evaluations), the same sigma and lr; CoPES uses
sigma_k = sqrt(K) sigma on each member's 1/K subspace (the paper's default).
Run: python bench/copes_vs_es_mlp.py [sigma] [lr ...]
"""
import sys
import time

import torch
from torch import nn

from copes.es.strategies.copes import CoPES

torch.set_num_threads(1)
STEPS, REPORT = 200, (0, 10, 25, 50, 100, 150, 200)
X = torch.randn(256, 8, generator=torch.Generator().manual_seed(0))
Y = torch.sin(X @ torch.randn(8, 4, generator=torch.Generator().manual_seed(1)))


def make_mlp() -> nn.Module:
    torch.manual_seed(123)  # one initialisation for every run: only the ES seed varies
    return nn.Sequential(nn.Linear(8, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 4))


@torch.no_grad()
def reward(model: nn.Module) -> float:
    return -float(((model(X) - Y) ** 2).mean())


def curve(num_subspaces: int, seed: int, sigma: float, lr: float) -> list[float]:
    model = make_mlp()
    es = CoPES(model, population=40, num_subspaces=num_subspaces, sigma=sigma, lr=lr, seed=seed, chunk_size=64)
    rewards = [reward(model)]
    for _ in range(STEPS):
        es.step(reward)
        rewards.append(reward(model))
    return rewards


if __name__ == "__main__":
    sigma = float(sys.argv[1]) if len(sys.argv) > 1 else 0.01
    lrs = [float(v) for v in sys.argv[2:]] or [0.005, 0.01]
    print(f"MLP 8-64-64-4 ({sum(p.numel() for p in make_mlp().parameters())} params), N=40, sigma={sigma}, "
          f"chunk 64; reward = -MSE of the current weights (mean +- std over seeds 0,1,2)")
    for lr in lrs:
        for k in (4, 1):
            start = time.time()
            runs = torch.tensor([curve(k, seed, sigma, lr) for seed in range(3)])
            cells = "  ".join(f"{runs[:, s].mean():.4f}+-{runs[:, s].std():.4f}" for s in REPORT)
            print(f"lr={lr:<6} K={k}  steps {REPORT}: {cells}   ({time.time() - start:.0f}s)", flush=True)

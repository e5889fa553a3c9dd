"""An OpenAI-ES iteration on the kernels' fast path (ck.WeightSet) against the same loop's own torch version, on a
random ~17M-parameter Qwen3, fp32 and bf16, one seed per member.

The torch version is the loop as es-at-scale-style code writes it: per member, a generator seeded with the
member's seed draws `torch.randn` in the weight's dtype for every parameter in turn; perturb adds sigma * noise,
restore regenerates it and subtracts it; the update regenerates every member's noise and adds
lr * coeff_j * noise_j, one pass over the weights per member. The kernel version perturbs with a bit-exact
backup, restores by copying the bits back, and updates in one pass for all members (per-member seeds; bf16 with
stochastic rounding). Both sides do the same work per iteration: `population` x (perturb + restore) + 1 update;
the model's forward pass, the same for both, is left out.

Reported per dtype: seconds per iteration (best of the alternating rounds), speed-up = torch / kernels, and the
share of weights the torch subtract-restore fails to give back bit for bit (the kernels' restore: 0 by test). The
compile of the CPU kernels is timed first, as its own phase (ck.warm_up).

    python bench/openai_es_loop.py [--population 8] [--repeats 2]
"""

from __future__ import annotations

import argparse

import numpy as np
import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

import copes_kernels as ck

from common.harness import DEVICE, alternating_best_seconds, machine_note, pin_one_thread, report

SIGMA, LR = 1e-3, 5e-4


def qwen3_17m(dtype: torch.dtype) -> torch.nn.Module:
    """A random Qwen3 of 16.9M parameters (embeddings tied), built from a config, never downloaded."""
    config = Qwen3Config(vocab_size=32768, hidden_size=320, intermediate_size=1024, num_hidden_layers=5,
                         num_attention_heads=5, num_key_value_heads=1, head_dim=64, tie_word_embeddings=True)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = Qwen3ForCausalLM(config)
    return model.to(DEVICE, dtype).eval().requires_grad_(False)


class TorchLoop:
    """The loop's own torch version (see the module docstring)."""

    def __init__(self, params: list[torch.Tensor]) -> None:
        self.params = params

    def _noises(self, seed: int):
        generator = torch.Generator(device=DEVICE).manual_seed(seed)
        for p in self.params:
            yield p, torch.randn(p.shape, generator=generator, dtype=p.dtype, device=DEVICE)

    def perturb(self, seed: int) -> None:
        for p, noise in self._noises(seed):
            p.add_(noise, alpha=SIGMA)

    def restore(self, seed: int) -> None:
        for p, noise in self._noises(seed):
            p.sub_(noise, alpha=SIGMA)

    def update(self, seeds: list[int], coeffs: list[float]) -> None:
        for seed, coeff in zip(seeds, coeffs):
            for p, noise in self._noises(seed):
                p.add_(noise, alpha=LR * coeff)


def iteration_runs(population: int, dtype: torch.dtype) -> tuple[dict, float]:
    """The two iterations as callables on two copies of the model, and the torch restore's failure share."""
    seeds = [int(s) for s in np.random.default_rng(0).integers(0, 2**63, size=population)]
    coeffs = torch.linspace(-1, 1, population).tolist()
    torch_params = [p.data for p in qwen3_17m(dtype).parameters()]
    naive = TorchLoop(torch_params)
    weights = ck.WeightSet.from_named(qwen3_17m(dtype).named_parameters())
    rounding = "stochastic" if dtype != torch.float32 else "nearest"

    def torch_iteration() -> None:
        for seed in seeds:
            naive.perturb(seed)
            naive.restore(seed)
        naive.update(seeds, coeffs)

    def kernel_iteration() -> None:
        for member, seed in enumerate(seeds):
            weights.perturb(seed=seed, member=member, sigma=SIGMA)
            weights.restore()
        weights.update(coeffs, members=range(population), seeds=seeds, lr=LR, rounding=rounding)

    before = [p.clone() for p in torch_params]
    naive.perturb(seeds[0])
    naive.restore(seeds[0])
    moved = sum(int((a != b).sum()) for a, b in zip(before, torch_params)) / sum(p.numel() for p in torch_params)
    return {"torch": torch_iteration, "kernels": kernel_iteration}, moved


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--population", type=int, default=8, help="members per iteration")
    parser.add_argument("--repeats", type=int, default=2, help="timed rounds (after one warm-up round)")
    args = parser.parse_args()
    pin_one_thread()
    dtypes = (torch.float32, torch.bfloat16)
    compile_seconds = ck.warm_up(dtypes, device=DEVICE)
    rows = []
    for dtype in dtypes:
        runs, moved = iteration_runs(args.population, dtype)
        best = alternating_best_seconds(runs, args.repeats)
        rows.append({
            "dtype": str(dtype).removeprefix("torch."),
            "parameters": sum(p.numel() for p in qwen3_17m(dtype).parameters()),
            "population": args.population,
            "torch_s": best["torch"],
            "kernels_s": best["kernels"],
            "speedup": best["torch"] / best["kernels"],
            "torch_restore_moved": moved,
        })
    report("openai_es_loop", rows, f"OpenAI-ES iteration, kernels vs torch ({machine_note()}; "
                                   f"CPU kernels compiled or loaded in {compile_seconds:.1f} s first)")


if __name__ == "__main__":
    main()

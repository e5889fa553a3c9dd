"""Engine time per member (perturb + restore) and per update on a model of ~400 small tensors, multi-tensor launches
(ParameterSpace's default) against the per-tensor path (`multi_tensor=False`), same model, same run.

The tensors are small on purpose: the kernels' own work is negligible, so the times are the host's (Python,
launches, syncs), which is what grows with the number of tensors. Both paths run the Triton kernels: compiled on
a GPU, under Triton's interpreter on CPU (COPES_BACKEND=triton is set here), where a launch costs far more than on
a GPU, so the CPU ratio is a launch-count effect, not a GPU prediction. Each time includes `synchronize()`, as
the strategy's phase timings do. Prints a table and writes bench/results/engine_overhead_<device>.csv.

    python bench/engine_overhead.py [--layers 36] [--repeats 3]
    python bench/engine_overhead.py --hidden-size 16 --population 8 --repeats 1   # CPU (interpreter): minutes
"""

from __future__ import annotations

import argparse
import os

import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

from copes.es.params import ParameterSpace

from common.harness import (
    DEVICE,
    POPULATION,
    SIGMA,
    SUBSPACES,
    alternating_best_seconds,
    machine_note,
    pin_one_thread,
    report,
)

SEED = 5


def build_model(layers: int, hidden: int) -> torch.nn.Module:
    """A random Qwen3 with 2 + 11 * layers trainable tensors (tied embeddings), bf16, on DEVICE."""
    config = Qwen3Config(
        vocab_size=4 * hidden, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
        num_attention_heads=2, num_key_value_heads=1, head_dim=hidden // 2, max_position_embeddings=64,
        tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    return Qwen3ForCausalLM(config).to(device=DEVICE, dtype=torch.bfloat16).eval()


class EngineCycle:
    """One member's perturb + restore, and one N-member update, through a ParameterSpace."""

    def __init__(self, model: torch.nn.Module, *, multi_tensor: bool, population: int) -> None:
        self.space = ParameterSpace(model, multi_tensor=multi_tensor)
        self.partition = self.space.partition(SEED, SUBSPACES)
        members = torch.arange(population)
        self.member_subspaces = members % SUBSPACES
        self.members = members
        self.coeffs = torch.linspace(-1, 1, population, dtype=torch.float64) * 1e-3
        self.space.perturb(self.partition, seed=SEED, member=0, subspace=0, sigma=SIGMA)  # builds the step's tables
        self.space.restore()

    def member(self) -> None:
        self.space.perturb(self.partition, seed=SEED, member=3, subspace=3, sigma=SIGMA)
        self.space.synchronize()
        self.space.restore()
        self.space.synchronize()

    def update(self) -> None:
        self.space.apply_update(
            self.partition, seed=SEED, members=self.members, coeffs=self.coeffs, member_subspaces=self.member_subspaces
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=36, help="Qwen3 layers (11 tensors each, plus 2)")
    parser.add_argument("--hidden-size", type=int, default=64, help="hidden size (the tensors stay small)")
    parser.add_argument("--population", type=int, default=POPULATION, help="members in the update (N)")
    parser.add_argument("--repeats", type=int, default=3, help="timed rounds (the fastest is kept)")
    args = parser.parse_args()
    # Both paths on the kernels, also on CPU (the dispatcher then turns on Triton's interpreter).
    os.environ.setdefault("COPES_BACKEND", "triton")
    pin_one_thread()
    model = build_model(args.layers, args.hidden_size)
    cycles = {
        name: EngineCycle(model, multi_tensor=name == "multi-tensor", population=args.population)
        for name in ("multi-tensor", "per-tensor")
    }
    tensors = len(cycles["multi-tensor"].space.parameters)
    member = alternating_best_seconds({name: cycle.member for name, cycle in cycles.items()}, args.repeats)
    update = alternating_best_seconds({name: cycle.update for name, cycle in cycles.items()}, args.repeats)
    rows = [
        {
            "path": name,
            "tensors": tensors,
            "backend": os.environ["COPES_BACKEND"],
            "member_ms": 1e3 * member[name],
            "update_ms": 1e3 * update[name],
            "member_speedup": member["per-tensor"] / member[name],
            "update_speedup": update["per-tensor"] / update[name],
        }
        for name in cycles
    ]
    report("engine_overhead", rows, f"Engine time per member and per update, N={args.population}, K={SUBSPACES} "
                                    f"({machine_note()})")


if __name__ == "__main__":
    main()

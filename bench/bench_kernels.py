"""Kernel microbenchmarks: every copes_kernels op against the naive PyTorch way, timed in the same run.

The naive baseline is what ES code without a noise contract does: a per-tensor seeded `torch.randn` materialised
in full, then a (masked) add; a low-rank member's weight materialised before its GEMM. `copes` is the public op as
dispatched: on CPU the compiled backend (`copes_kernels/backends/cpu/`, the real CPU training path), on CUDA the Triton
kernels; on CPU the torch/numpy `reference` (the test oracle) is timed too. Timing: pytest-benchmark on CPU,
triton.testing.do_bench on CUDA.
GB/s counts the bytes an op must move at least (the same count for both implementations), so the GB/s ratio is
the speed-up. For the multi-tensor ops the `reference` twin loops over the per-tensor ops through the dispatcher
(on CPU: the compiled per-tensor ops, i.e. the per-tensor path). Prints a table and writes
bench/results/kernels_<device>.csv.

    python bench/bench_kernels.py                  # or: pytest bench/bench_kernels.py
"""

from __future__ import annotations

import csv
import math
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

import pytest
import torch

import copes_kernels as ck
from copes_kernels.backends import reference

from common.harness import DEVICE, POPULATION, RESULTS_DIR, SIGMA, SUBSPACES, device_label, element_masks, seeded_randn

IMPLEMENTATIONS = ("copes", "reference", "naive") if DEVICE.type == "cpu" else ("copes", "naive")
# The CPU ops take 0.1-600 ms each: five timed rounds after one warm-up, and the fastest one is reported, since a
# shared machine only ever adds time (GPU timings are do_bench medians).
CPU_ROUNDS = 5


@dataclass(frozen=True)
class Sizes:
    numel: int  # elements of the perturbed / updated parameter
    dtype: torch.dtype
    batch: int  # low-rank population forward: rows (one member each), tokens per row, square weight, rank
    tokens: int
    features: int
    rank: int


# The multi-tensor ops run one member (perturb + packed backup, then restore) over the parameter cut into this many
# equal tensors (32K elements each on CPU: every tensor is one chunk, as most of a small model's are), so their
# fixed cost per tensor shows.
GROUP_TENSORS = 64
# CPU: a ~2M-element fp32 parameter, the size profiled for the reference. GPU: a 64M-element bf16 parameter
# (a 4B-model's MLP matrix) and a 4096-wide layer with 64 members.
SIZES = {
    "cpu": Sizes(numel=1 << 21, dtype=torch.float32, batch=16, tokens=8, features=512, rank=4),
    "cuda": Sizes(numel=1 << 26, dtype=torch.bfloat16, batch=64, tokens=64, features=4096, rank=4),
}


@dataclass
class Case:
    elements: int  # output elements per call
    bytes_moved: int  # the least traffic the op needs (reads + writes)
    runs: dict[str, Callable[[], object]]  # implementation -> one call


@dataclass
class Row:
    op: str
    implementation: str
    milliseconds: float
    elements: int
    bytes_moved: int

    @property
    def elements_per_second(self) -> float:
        return self.elements / (self.milliseconds * 1e-3)

    @property
    def gigabytes_per_second(self) -> float:
        return self.bytes_moved / (self.milliseconds * 1e-3) / 1e9


def build_cases(sizes: Sizes) -> dict[str, Case]:
    n, dtype, element_size = sizes.numel, sizes.dtype, torch.tensor([], dtype=sizes.dtype).element_size()
    ids = dict(seed=7, tensor_id=3)
    x = torch.randn(n, device=DEVICE).to(dtype)
    chunks = ck.num_chunks(n, ck.DEFAULT_CHUNK_SIZE)
    chunk_subspace = ck.make_partition([chunks], num_subspaces=SUBSPACES, seed=7, device=DEVICE)[0]
    masks = element_masks(chunk_subspace, n, ck.DEFAULT_CHUNK_SIZE)
    selected = int(masks[0].sum())
    chunking = dict(chunk_subspace=chunk_subspace, subspace=0)
    backup = ck.backup_chunks(x, **chunking)
    members = list(range(POPULATION))
    coeffs = torch.linspace(-1, 1, POPULATION).tolist()
    member_subspaces = [j * SUBSPACES // POPULATION for j in members]

    def naive_accumulate() -> None:
        update = torch.zeros(n, device=DEVICE)
        for member, coeff, subspace in zip(members, coeffs, member_subspaces):
            update.add_(seeded_randn(n, member=member, **ids) * masks[subspace], alpha=coeff)
        x.add_(update)

    m = in_features = sizes.features
    rows, tokens, rank = sizes.batch, sizes.tokens, sizes.rank
    weight = (torch.randn(m, in_features, device=DEVICE) / math.sqrt(in_features)).to(dtype)
    activations = torch.randn(rows, tokens, in_features, device=DEVICE).to(dtype)
    factor_members = list(range(rows))
    factor_coeffs = torch.linspace(-1, 1, rows).tolist()
    shape = dict(out_features=m, in_features=in_features, rank=rank, device=DEVICE)
    A, B = ck.lowrank_factors(member=factor_members, **shape, **ids)
    row_member = torch.arange(rows, device=DEVICE)
    lowrank_scale = SIGMA / math.sqrt(rank)

    def naive_lowrank_linear() -> torch.Tensor:
        outputs = [
            torch.nn.functional.linear(activations[b], (weight.float() + lowrank_scale * A[b] @ B[b].T).to(dtype))
            for b in range(rows)
        ]
        return torch.stack(outputs)

    def naive_lowrank_accumulate() -> None:
        update = torch.zeros(m, in_features, device=DEVICE)
        for j, coeff in enumerate(factor_coeffs):
            update.addmm_(A[j], B[j].T, alpha=coeff * SIGMA)
        weight.add_(update.to(dtype))

    factor_bytes = rows * (m + in_features) * rank * 4

    group = list(x.view(GROUP_TENSORS, -1))
    group_ids = [100 + k for k in range(GROUP_TENSORS)]
    group_host = ck.make_partition([ck.num_chunks(t.numel(), ck.DEFAULT_CHUNK_SIZE) for t in group],
                                   num_subspaces=SUBSPACES, seed=7)
    group_table = ck.build_run_table(group, tensor_ids=group_ids, chunk_subspaces=[p.to(DEVICE) for p in group_host],
                                     host_chunk_subspaces=group_host, subspace=0, num_subspaces=SUBSPACES)
    group_backup = torch.empty(group_table.backup_numel, dtype=dtype, device=DEVICE)
    owned = [(t, tensor_id) for t, tensor_id, part in zip(group, group_ids, group_host) if bool((part == 0).all())]

    def naive_member() -> None:
        for tensor, tensor_id in owned:
            saved = tensor.clone()
            tensor.add_(seeded_randn(tensor.numel(), seed=7, member=1, tensor_id=tensor_id), alpha=SIGMA)
            tensor.copy_(saved)

    def engine(api: ModuleType) -> dict[str, Callable[[], object]]:
        """One call of each op through `api`: the public (dispatched) ops or the reference module."""
        return {
            "normal": lambda: api.normal(n, member=1, device=DEVICE, **ids),
            "perturb_": lambda: api.perturb_(x, member=1, sigma=SIGMA, **ids),
            "perturb_ subspace": lambda: api.perturb_(
                x, member=1, sigma=math.sqrt(SUBSPACES) * SIGMA, **chunking, **ids
            ),
            "backup_chunks": lambda: api.backup_chunks(x, **chunking),
            "restore_chunks_": lambda: api.restore_chunks_(x, backup, **chunking),
            "accumulate_": lambda: api.accumulate_(
                x, members=members, coeffs=coeffs, chunk_subspace=chunk_subspace, member_subspaces=member_subspaces,
                **ids,
            ),
            "lowrank_factors": lambda: api.lowrank_factors(member=factor_members, **shape, **ids),
            "lowrank_linear": lambda: api.lowrank_linear(
                activations, weight, None, A=A, B=B, row_member=row_member, sigma=SIGMA
            ),
            "lowrank_accumulate_": lambda: api.lowrank_accumulate_(
                weight, A=A, B=B, coeffs=factor_coeffs, scale=SIGMA
            ),
            "multi_perturb_+restore": lambda: (
                api.multi_perturb_(group_table, seed=7, member=1, sigma=SIGMA, backup=group_backup),
                api.multi_restore_(group_table, group_backup),
            ),
        }

    naive = {
        "normal": lambda: seeded_randn(n, member=1, **ids),
        "perturb_": lambda: x.add_(seeded_randn(n, member=1, **ids), alpha=SIGMA),
        "perturb_ subspace": lambda: x.add_(
            seeded_randn(n, member=1, **ids) * masks[0], alpha=math.sqrt(SUBSPACES) * SIGMA
        ),
        "backup_chunks": lambda: x[masks[0]],
        "restore_chunks_": lambda: x.masked_scatter_(masks[0], backup),
        "accumulate_": naive_accumulate,
        "lowrank_factors": lambda: [seeded_randn((m + in_features) * rank, member=j, **ids) for j in factor_members],
        "lowrank_linear": naive_lowrank_linear,
        "lowrank_accumulate_": naive_lowrank_accumulate,
        "multi_perturb_+restore": naive_member,
    }
    apis = {"copes": engine(ck), "reference": engine(reference), "naive": naive}
    traffic = {  # (output elements, least bytes moved) per call
        "normal": (n, 4 * n),
        "perturb_": (n, 2 * n * element_size),
        "perturb_ subspace": (selected, 2 * selected * element_size),
        "backup_chunks": (selected, 2 * selected * element_size),
        "restore_chunks_": (selected, 2 * selected * element_size),
        "accumulate_": (n, 2 * n * element_size),
        "lowrank_factors": (factor_bytes // 4, factor_bytes),
        "lowrank_linear": (rows * tokens * m, (rows * tokens * (in_features + m) + m * in_features) * element_size),
        "lowrank_accumulate_": (m * in_features, 2 * m * in_features * element_size),
        # read w, write the backup and w; then read the backup, write w
        "multi_perturb_+restore": (group_table.backup_numel, 5 * group_table.backup_numel * element_size),
    }
    return {
        op: Case(elements, moved, {impl: apis[impl][op] for impl in IMPLEMENTATIONS})
        for op, (elements, moved) in traffic.items()
    }


OPS = ("normal", "perturb_", "perturb_ subspace", "backup_chunks", "restore_chunks_", "accumulate_",
       "lowrank_factors", "lowrank_linear", "lowrank_accumulate_", "multi_perturb_+restore")


def report(rows: list[Row], write_line: Callable[[str], None]) -> Path:
    """Print the table (speed-up = naive time / this time; on CPU also reference time / this time), write the CSV."""
    by_key = {(row.op, row.implementation): row for row in rows}
    label = device_label()
    path = RESULTS_DIR / f"kernels_{label}.csv"
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    sizes = SIZES[DEVICE.type]
    threads = f", {torch.get_num_threads()} CPU threads" if DEVICE.type == "cpu" else ""
    parameter = f"a {sizes.numel}-element {str(sizes.dtype).removeprefix('torch.')} parameter{threads}"
    write_line(f"\nkernels on {label} ({parameter}; speed-up = naive / impl, vs ref = reference / impl)")
    write_line(f"{'op':20s} {'impl':9s} {'ms':>10s} {'Melem/s':>10s} {'GB/s':>8s} {'speed-up':>9s} {'vs ref':>7s}")
    with path.open("w", newline="") as file:
        writer = csv.writer(file)
        writer.writerow(
            ["device", "op", "implementation", "ms", "elements_per_s", "gb_per_s", "speedup_vs_naive",
             "speedup_vs_reference", "dtype"]
        )
        for row in rows:
            naive, oracle = by_key.get((row.op, "naive")), by_key.get((row.op, "reference"))
            speedup = naive.milliseconds / row.milliseconds if naive else float("nan")
            vs_reference = oracle.milliseconds / row.milliseconds if oracle else float("nan")
            write_line(
                f"{row.op:20s} {row.implementation:9s} {row.milliseconds:10.3f} "
                f"{row.elements_per_second / 1e6:10.1f} {row.gigabytes_per_second:8.2f} "
                f"{speedup:9.2f} {vs_reference:7.2f}"
            )
            writer.writerow([
                label, row.op, row.implementation, f"{row.milliseconds:.4f}", f"{row.elements_per_second:.4g}",
                f"{row.gigabytes_per_second:.4g}", f"{speedup:.3f}", f"{vs_reference:.3f}",
                str(sizes.dtype).removeprefix("torch."),
            ])
    write_line(f"wrote {path}")
    return path


@pytest.fixture(scope="module")
def cases() -> dict[str, Case]:
    return build_cases(SIZES[DEVICE.type])


@pytest.fixture(scope="module")
def results(request: pytest.FixtureRequest):
    rows: list[Row] = []
    yield rows
    ordered = sorted(rows, key=lambda row: (OPS.index(row.op), row.implementation))
    capture = request.config.pluginmanager.get_plugin("capturemanager")
    with capture.global_and_fixture_disabled():  # the table shows without -s
        report(ordered, print)


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@pytest.mark.parametrize("op", OPS)
def test_kernel_speed(
    op: str, implementation: str, cases: dict[str, Case], results: list[Row], request: pytest.FixtureRequest
) -> None:
    case = cases[op]
    run = case.runs[implementation]
    if DEVICE.type == "cuda":
        import triton.testing

        milliseconds = triton.testing.do_bench(run, return_mode="median")
    else:
        benchmark = request.getfixturevalue("benchmark")
        benchmark.group = op
        benchmark.pedantic(run, rounds=CPU_ROUNDS, warmup_rounds=1)
        milliseconds = benchmark.stats.stats.min * 1e3
    results.append(Row(op, implementation, milliseconds, case.elements, case.bytes_moved))


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q", "-p", "no:cacheprovider", *sys.argv[1:]]))

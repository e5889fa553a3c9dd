"""Memory against context, measured: the peak of one GRPO update (sampling, then forward + backward over prompt and
completion, with and without gradient checkpointing, the Adam moments of the steady state) against one ES member
through copes' HF engine (chunked prefill, no full-prompt logits), on the reduced-width Qwen3.5 (hybrid) and Qwen3
(full attention) of bench/common/grpo_memory.py, every allocation counted. Each point runs in its own process, one at a
time (a point's CSV row is written as soon as it ends, so the sweep resumes), and the plan's GRPO and ES figures for
the same shapes are written beside the measured ones. The PNG goes to docs/memory-context.png.

    nice -n 15 python bench/memory_context.py --lengths 1024 4096 16384 32768
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import fcntl
import multiprocessing
import os
from collections.abc import Iterator, Sequence
from pathlib import Path

from common.harness import RESULTS_DIR, append_csv_row, pin_one_thread

REPO = Path(__file__).resolve().parents[1]
CSV = RESULTS_DIR / "memory_context.csv"
PLOT = REPO / "docs" / "memory-context.png"
COMPLETION = 64  # generated tokens per row: GRPO's group and the ES member sample the same
ROWS = 1  # one sequence per micro-batch (GRPO) and one row (ES member): the per-sequence cost against context
FIELDS = ["model", "context", "kind", "measured_mib", "planned_mib"]
BIG_CONTEXT = 16384  # points from here on may pass ~4 GB resident: they take the shared machine's big-memory lock
# COPES_BENCH_LOCK: a lock file the long-context points take on a machine shared with other big jobs.
BIG_MEMORY_LOCK = Path(os.environ["COPES_BENCH_LOCK"]) if os.environ.get("COPES_BENCH_LOCK") else None
KINDS = ("GRPO update, checkpointing", "GRPO update, no checkpointing", "ES member (HF engine)")


def plan_terms(name: str, context: int, kind: str) -> list[tuple[str, int]]:
    """The plan's terms of one point (config only, instant), in bytes: what its planned peak adds up."""
    from copes.plan.grpo import grpo_columns
    from copes.plan.memory import RolloutShape, _rollout_lines, model_shape

    from common import grpo_memory

    shape = model_shape(grpo_memory.reduced_config(name))
    if kind.startswith("GRPO"):
        # The moments of a bf16 model under torch's AdamW are bf16; a mixed-precision user keeps them in fp32
        # with fp32 masters: the plan's state lines, counted exactly. Compared here: gradients and activations.
        checkpointing = kind == KINDS[0]
        grpo = grpo_columns(shape, "bfloat16", context, COMPLETION, kl=False, checkpointing=checkpointing, copes=None)
        start = [("saved activations", grpo.activations()), ("completion logits", grpo.logits),
                 ("embedding gradient", grpo.embedding_gradient), ("one MLP's backward", grpo.backward_transients)]
        end = [("gradients", grpo.gradients), ("saved activations, checkpointing", grpo.activations_checkpointed)]
        return start if sum(b for _, b in start) >= sum(b for _, b in end) else end
    # One turn: no kept copy.
    rollout = RolloutShape(1, context - COMPLETION, COMPLETION, 0, context, min(512, context - COMPLETION), True)
    per_row, per_call, _ = _rollout_lines(shape, rollout, 2)
    return [(line.what, line.bytes) for line in per_row + per_call if not line.what.startswith("kept")]


def planned_mib(name: str, context: int, kind: str) -> float:
    """Today's plan for one point: recomputed for stored points, so the CSV and the plot always set the
    measurements beside the plan as it is now."""
    return round(sum(size for _, size in plan_terms(name, context, kind)) / 2**20, 2)


def measure(point: tuple[str, int, str]) -> dict[str, object]:
    """One point in a fresh process (bf16, one thread): bytes beyond the weights."""
    name, context, kind = point
    pin_one_thread()
    import torch

    from common import grpo_memory

    model = grpo_memory.reduced_model(name, torch.bfloat16)
    prompts = torch.randint(1, grpo_memory.VOCAB - 1, (ROWS, context - COMPLETION),
                            generator=torch.Generator().manual_seed(context))
    if kind.startswith("GRPO"):
        measured = grpo_memory.grpo_update_peaks(model, prompts, COMPLETION, checkpointing=kind == KINDS[0]).update
    else:
        measured = grpo_memory.es_member_peak(model, prompts, COMPLETION)
    return {"model": name, "context": context, "kind": kind, "measured_mib": round(measured / 2**20, 2),
            "planned_mib": planned_mib(name, context, kind)}


@contextlib.contextmanager
def big_memory(needed: bool) -> Iterator[None]:
    """Hold the shared machine's big-memory lock (when it has one) for one large point, not the whole sweep."""
    if not needed or BIG_MEMORY_LOCK is None:
        yield
        return
    with BIG_MEMORY_LOCK.open() as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def sweep(models: Sequence[str], lengths: Sequence[int], kinds: Sequence[str]) -> list[dict[str, str]]:
    stored = list(csv.DictReader(CSV.open())) if CSV.is_file() else []
    # One row per point (two sweeps run side by side can both measure one); measurements stay, the plan is today's.
    done = list({(row["model"], int(row["context"]), row["kind"]): row for row in stored}.values())
    for row in done:
        row["planned_mib"] = str(planned_mib(row["model"], int(row["context"]), row["kind"]))
    if done:
        with CSV.open("w", newline="") as handle:
            writer = csv.DictWriter(handle, FIELDS)
            writer.writeheader()
            writer.writerows(done)
    seen = {(row["model"], int(row["context"]), row["kind"]) for row in done}
    context = multiprocessing.get_context("spawn")
    for length in lengths:
        for name in models:
            for kind in kinds:
                if (name, length, kind) in seen:
                    continue
                with big_memory(length >= BIG_CONTEXT), context.Pool(1) as pool:
                    row = pool.apply(measure, ((name, length, kind),))
                print(row, flush=True)
                append_csv_row(CSV, FIELDS, row)
                done.append({key: str(value) for key, value in row.items()})
    return done


def plot(rows: Sequence[dict[str, str]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(1, 2, figsize=(12, 4.5), dpi=110)
    for axis, name in zip(axes, ("qwen3.5", "qwen3")):
        for kind in KINDS:
            points = sorted((int(r["context"]), float(r["measured_mib"]), float(r["planned_mib"]))
                            for r in rows if r["model"] == name and r["kind"] == kind)
            if not points:
                continue
            x, measured, planned = zip(*points)
            (line,) = axis.plot(x, measured, marker="o", label=f"{kind}, measured")
            axis.plot(x, planned, linestyle="--", color=line.get_color(), label=f"{kind}, planned")
        axis.set_xscale("log", base=2)
        axis.set_yscale("log")
        axis.set_xlabel("context (tokens: prompt + 64 generated)")
        axis.set_ylabel("peak beyond the weights (MiB)")
        axis.set_title(f"reduced-width {name} (bf16, one sequence)", fontsize=9)
        axis.grid(alpha=0.3)
        axis.legend(fontsize=7)
    figure.tight_layout()
    figure.savefig(path)
    plt.close(figure)


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", default=["qwen3.5", "qwen3"], choices=["qwen3.5", "qwen3"])
    parser.add_argument("--lengths", nargs="+", type=int, default=[1024, 4096, 16384, 32768])
    parser.add_argument("--kinds", nargs="+", default=list(KINDS), choices=KINDS)
    args = parser.parse_args(argv)
    rows = sweep(args.models, args.lengths, args.kinds)
    plot(rows, PLOT)
    print(f"wrote {CSV} and {PLOT}")


if __name__ == "__main__":
    main()

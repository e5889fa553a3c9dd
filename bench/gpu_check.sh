#!/usr/bin/env bash
# The prepared GPU check for copes_kernels and the engine, for a bare GPU image: python3 with torch, triton,
# transformers, tokenizers, safetensors, numpy, scipy, pyyaml, click, tqdm, matplotlib, pytest, pytest-benchmark,
# and no network. It installs nothing (math-verify, bm25s and datasets are optional extras none of this needs).
#
# Phases, each under its own timeout (and all of them inside an 8-minute budget), each printing one summary line:
#   env         torch / triton versions and the GPU
#   tests       kernels_tests on the GPU: the compiled kernels against the reference, `gpu`-marked tests included,
#               and the kernels' compile-cache sizes after them (kernels_tests/count_compiles.py)
#   lowering    every kernel compiled for this GPU's architecture: registers, spills, SASS counts, 128-bit accesses
#   kernels     every op against the naive PyTorch baseline (bench/bench_kernels.py, triton.testing.do_bench)
#   engine      host + kernel time per member and per update, multi-tensor vs per-tensor launches, 400 tensors
#   step / naive / memory / eggroll   the end-to-end benchmarks of bench/README.md
# Results land in $OUT (default bench/results/gpu_check): one log per phase, the benchmarks' CSVs, phases.csv
# (phase, status, seconds) and summary.txt (the summary lines). Exit status: non-zero if any phase failed.
#
#     OUT=/tmp/gpu bash bench/gpu_check.sh
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-bench/results/gpu_check}"
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
PYTHON="${PYTHON:-python3}"
BUDGET_S="${BUDGET_S:-470}"  # the whole script stays under 8 minutes
SUMMARY="$OUT/summary.txt"
echo "phase,status,seconds" >"$OUT/phases.csv"
: >"$SUMMARY"
status=0

# phase NAME TIMEOUT_S COMMAND...: run under min(TIMEOUT_S, what is left of the budget), log to $OUT/NAME.log,
# print and record one line: status, seconds, and the log's last line.
phase() {
    local name=$1 limit=$2
    shift 2
    local left=$((BUDGET_S - SECONDS))
    if [ "$left" -lt 10 ]; then
        echo "$name,skipped,0" >>"$OUT/phases.csv"
        echo "== $name: skipped (budget spent)" | tee -a "$SUMMARY"
        status=1
        return
    fi
    [ "$limit" -gt "$left" ] && limit=$left
    local start=$SECONDS
    timeout --kill-after=5 "$limit" "$@" >"$OUT/$name.log" 2>&1
    local rc=$? result=passed
    if [ $rc -eq 124 ] || [ $rc -eq 137 ]; then result="timeout after ${limit}s"; status=1
    elif [ $rc -ne 0 ]; then result="FAILED (rc $rc)"; status=1
    fi
    local took=$((SECONDS - start))
    echo "$name,${result%% *},$took" >>"$OUT/phases.csv"
    echo "== $name: $result in ${took}s | $(grep -v '^\s*$' "$OUT/$name.log" | tail -n 1 | cut -c1-160)" | tee -a "$SUMMARY"
}

phase env 30 "$PYTHON" -c "
import sys, torch, triton
if not torch.cuda.is_available():
    sys.exit('no CUDA device visible to torch')
print('torch', torch.__version__, '| triton', triton.__version__, '|', torch.cuda.get_device_name(),
      '| sm_%d%d' % torch.cuda.get_device_capability())"
if ! grep -q '^env,passed' "$OUT/phases.csv"; then
    echo "gpu_check: FAILED (no usable GPU: see $OUT/env.log)" | tee -a "$SUMMARY"
    exit 1
fi
arch=$("$PYTHON" -c "import torch; major, minor = torch.cuda.get_device_capability(); print(f'{major}{minor}')")

phase tests 170 "$PYTHON" -m kernels_tests.count_compiles kernels_tests -q -rs --durations=10 -p no:cacheprovider
phase lowering 45 "$PYTHON" -m kernels_tests.lower_kernels --arch "$arch"
phase kernels 60 "$PYTHON" bench/bench_kernels.py -p no:cacheprovider
phase engine 45 "$PYTHON" bench/engine_overhead.py
phase step 40 "$PYTHON" bench/step_overhead.py
phase naive 30 "$PYTHON" bench/vs_naive.py
phase memory 30 "$PYTHON" bench/memory.py
# EGGROLL's paper throughput figure is for a full batch (N=40 members, 4 rows each).
phase eggroll 40 "$PYTHON" bench/eggroll_throughput.py --large-population 40 --rows-per-member 4

for csv in bench/results/*.csv; do
    case "$csv" in *_cpu.csv) ;; *) cp "$csv" "$OUT"/ ;; esac
done
echo "gpu_check: $([ $status -eq 0 ] && echo passed || echo FAILED) in ${SECONDS}s; results in $OUT" | tee -a "$SUMMARY"
exit $status

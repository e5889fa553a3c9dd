#!/usr/bin/env bash
# The prepared GPU check for copes_kernels, sized to finish in under 5 minutes on one CUDA GPU:
#   1. make the few Python packages the kernels, tests and benchmarks import available (pip-installs any that
#      are missing: from ./.whl wheels when the machine is offline, else from the index),
#   2. run kernels_tests on the GPU: the "triton" backend compiles the real kernels, `gpu`-marked tests included,
#      every op compared against the reference,
#   3. compile every kernel for this GPU's architecture and list registers / spills,
#   4. time every op against the naive PyTorch baseline (bench/bench_kernels.py, triton.testing.do_bench),
#   5. run the end-to-end benchmarks (step overhead, engine vs naive, memory per restore mode, EGGROLL
#      throughput) on the GPU: the numbers for the GPU section of bench/README.md.
# Logs and the results CSVs land in $OUT when set (else bench/results). Exit status: non-zero if any step failed.
#
#     OUT=/tmp/gpu bash bench/gpu_check.sh
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-bench/results}"
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
PYTHON="${PYTHON:-python3}"

"$PYTHON" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 'no CUDA device visible to torch')" || exit 1
missing=$("$PYTHON" - <<'PY'
import importlib.util
needed = {"numpy": "numpy", "scipy": "scipy", "triton": "triton", "pytest": "pytest", "pytest_benchmark": "pytest-benchmark",
          # the end-to-end benchmarks run the trainer: the package's own requirements (setup.py)
          "transformers": "transformers", "tokenizers": "tokenizers", "safetensors": "safetensors", "yaml": "pyyaml",
          "click": "click", "tqdm": "tqdm", "matplotlib": "matplotlib", "math_verify": "math-verify", "bm25s": "bm25s",
          "datasets": "datasets"}
print(" ".join(package for module, package in needed.items() if importlib.util.find_spec(module) is None))
PY
)
if [ -n "$missing" ]; then
    echo "installing: $missing"
    if [ -d .whl ]; then
        "$PYTHON" -m pip install -q --no-index --find-links .whl $missing || exit 1
    else
        "$PYTHON" -m pip install -q $missing || exit 1
    fi
fi
"$PYTHON" -c "import torch, triton; print('torch', torch.__version__, '| triton', triton.__version__, '|', torch.cuda.get_device_name())"

status=0
echo "== kernel tests on $("$PYTHON" -c 'import torch; print(torch.cuda.get_device_name())')"
"$PYTHON" -m pytest kernels_tests -q -rs --durations=10 -p no:cacheprovider 2>&1 | tee "$OUT/kernels_tests.log" || status=1

echo "== lowering for this architecture"
arch=$("$PYTHON" -c "import torch; major, minor = torch.cuda.get_device_capability(); print(f'{major}{minor}')")
"$PYTHON" -m kernels_tests.lower_kernels --arch "$arch" 2>&1 | tee "$OUT/lowering.log" || status=1

echo "== kernel timings"
"$PYTHON" bench/bench_kernels.py -p no:cacheprovider 2>&1 | tee "$OUT/bench.log" || status=1

# Default sizes, except EGGROLL's batch: the paper's throughput figure is for a full batch (N=40 members, 4 rows
# each; prompt + generated tokens stay within the tiny model's 64 positions).
echo "== end-to-end benchmarks"
for run in "step_overhead" "vs_naive" "memory" "eggroll_throughput --large-population 40 --rows-per-member 4"; do
    script=${run%% *}
    flags=${run#"$script"}
    echo "-- $run"
    # shellcheck disable=SC2086  # $flags is a list of words
    "$PYTHON" "bench/$script.py" $flags 2>&1 | tee "$OUT/$script.log" || status=1
done
if [ "$OUT" != bench/results ]; then
    for csv in bench/results/*.csv; do
        case "$csv" in *_cpu.csv) ;; *) cp "$csv" "$OUT"/ ;; esac
    done
fi

echo "gpu_check: $([ $status -eq 0 ] && echo passed || echo FAILED)"
exit $status

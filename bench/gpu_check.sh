#!/usr/bin/env bash
# The prepared GPU check for copes_kernels, sized to finish in under 5 minutes on one CUDA GPU:
#   1. make the few Python packages the kernels, tests and benchmarks import available (pip-installs any that
#      are missing: from ./.whl wheels when the machine is offline, else from the index),
#   2. run kernels_tests on the GPU: the "triton" backend compiles the real kernels, `gpu`-marked tests included,
#      every op compared against the reference,
#   3. compile every kernel for this GPU's architecture and list registers / spills,
#   4. time every op against the naive PyTorch baseline (bench/bench_kernels.py, triton.testing.do_bench).
# Logs and the results CSV land in $OUT when set (else bench/results). Exit status: non-zero if any step failed.
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
needed = {"numpy": "numpy", "scipy": "scipy", "triton": "triton", "pytest": "pytest", "pytest_benchmark": "pytest-benchmark"}
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
[ "$OUT" = bench/results ] || cp bench/results/kernels_*.csv "$OUT"/ 2>/dev/null

echo "gpu_check: $([ $status -eq 0 ] && echo passed || echo FAILED)"
exit $status

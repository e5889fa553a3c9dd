"""The real Triton compiler accepts every kernel for an NVIDIA GPU, checked on machines without one."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import triton

from kernels_tests.lower_kernels import kernel_cases

REPO_ROOT = Path(__file__).resolve().parents[1]
PTXAS = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"
pytestmark = pytest.mark.slow  # each test compiles every kernel in a subprocess (tens of seconds)


@pytest.mark.skipif(not PTXAS.exists(), reason="this Triton build ships no NVIDIA backend (ptxas) to compile with")
def test_every_kernel_compiles_for_sm90() -> None:
    # A subprocess: this test session runs the interpreter, which replaces the compiler under test.
    env = {name: value for name, value in os.environ.items() if name != "TRITON_INTERPRET"}
    result = subprocess.run(
        [sys.executable, "-m", "kernels_tests.lower_kernels", "--arch", "90"],
        cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=600, check=False,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    compiled = {line.split()[0] for line in result.stdout.splitlines() if "sm_90" in line}
    assert compiled == {name for name, *_ in kernel_cases()}
    spilled_bytes = re.findall(r"(?:LOCAL|STACK):(\d+)", result.stdout)
    assert spilled_bytes and set(spilled_bytes) == {"0"}, "a kernel spills registers to local memory or the stack"
    # Instruction budget (static SASS, bench/README.md): the goals are perturb <= 60 per element and
    # accumulate <= 45 per regenerated normal; the guards sit just above today's counts (41.6 and 33.9 for the
    # aligned kernels, 55.9 and 36.0 for the variants odd offsets and sizes compile), so added work fails here.
    # Per-member keys (seeds=[...]) cost the accumulate loop 2.1 of those (31.8 before): each member's Philox key
    # schedule is its own, no longer hoisted out of the member loop.
    for line in result.stdout.splitlines():
        name = line.split()[0] if line.strip() else ""
        kernel, aligned = name.split("[")[0], "unaligned" not in name
        if kernel in ("perturb", "multi_perturb"):
            assert float(re.search(r" per-element:([\d.]+)", line).group(1)) <= (43 if aligned else 58), line
        if kernel in ("accumulate", "multi_accumulate"):
            assert float(re.search(r"loop-per-element:([\d.]+)", line).group(1)) <= (35 if aligned else 37), line
        if kernel in ("perturb", "accumulate", "multi_perturb", "multi_restore", "multi_accumulate", "normal_rows",
                      "copy_runs", "store_stochastic") and aligned:
            # 128-bit loads and stores, and no shared-memory layout shuffle (multi_accumulate's norm reduction
            # crosses warps: two accesses).
            assert int(re.search(r"ldg128\+stg128:(\d+)", line).group(1)) >= 4, line
            assert int(re.search(r" shared:(\d+)", line).group(1)) <= (2 if kernel == "multi_accumulate" else 0), line


def test_compile_counter_reports_the_variants_a_run_launches() -> None:
    # A subprocess: the counter runs its own pytest session. Rows of odd length never promise 128-bit accesses,
    # and a new offset or size never compiles another kernel (fixed BLOCK, sizes not specialised).
    result = subprocess.run(
        [sys.executable, "-m", "kernels_tests.count_compiles", "-q", "-p", "no:cacheprovider",
         "kernels_tests/test_rng.py", "-k", "normals_agree"],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=600, check=False,
    )
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    assert re.search(r"_normal_rows_kernel +launches +12 +compiles +1\b", result.stdout), result.stdout[-2000:]

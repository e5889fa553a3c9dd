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
    # Instruction budget (static SASS, bench/README.md): guards at today's counts. The goals (perturb <= 60
    # per element, accumulate <= 45 per regenerated normal) are not met yet; a change that adds work fails here.
    for line in result.stdout.splitlines():
        name = line.split()[0].split("[")[0] if line.strip() else ""
        if name in ("perturb", "multi_perturb"):
            assert float(re.search(r" per-element:([\d.]+)", line).group(1)) <= 90, line
        if name in ("accumulate", "multi_accumulate"):
            assert float(re.search(r"loop-per-element:([\d.]+)", line).group(1)) <= 52, line

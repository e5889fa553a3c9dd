"""A bare GPU image (torch, triton, transformers, ... but no math-verify, bm25s, datasets, numba, trl or wandb, and
for kernels_tests no scipy) imports `copes_kernels`, every `copes` module, the benchmark scripts and the kernel
tests; a feature that needs a missing extra fails with one line naming it. Proved in a subprocess where they look
uninstalled."""

from __future__ import annotations

import re
import subprocess
import sys
import textwrap
from pathlib import Path

from helpers.paths import REPO

# A None entry in sys.modules makes `import name` raise ModuleNotFoundError and importlib.util.find_spec(name) return
# None: the module looks uninstalled to the code under test and to the libraries it imports.
BLOCKER = """
import sys
for name in {blocked!r}:
    sys.modules[name] = None
"""


def _run_blocked(blocked: set[str], body: str) -> subprocess.CompletedProcess:
    script = BLOCKER.format(blocked=blocked) + textwrap.dedent(body)
    return subprocess.run(
        [sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=300,
        env={"PATH": "/usr/bin:/bin", "PYTHONPATH": f"{REPO}:{REPO / 'bench'}", "HOME": str(REPO)},
    )


def test_engine_benchmarks_and_kernel_tests_import_without_the_optional_extras(tmp_path: Path) -> None:
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text('{"id": "1", "title": "t", "text": "x"}\n')
    result = _run_blocked({"math_verify", "bm25s", "datasets", "scipy", "numba", "trl", "wandb"}, f"""
        import importlib, pkgutil
        import copes, copes_kernels
        for package in (copes, copes_kernels):
            for module in pkgutil.walk_packages(package.__path__, package.__name__ + "."):
                if not module.name.startswith("copes_kernels.backends.cpu"):  # the compiled CPU backend is numba
                    importlib.import_module(module.name)
        print("cpu tensors run on:", copes_kernels.backend_for("cpu"))
        for script in ("common.harness", "common.models", "common.memory_probe", "bench_kernels", "step_overhead",
                       "vs_naive", "memory", "eggroll_throughput", "sample_efficiency", "copes_vs_es_mlp",
                       "engine_overhead", "journal_cost", "sandbox_throughput", "vs_grpo", "openai_es_loop"):
            importlib.import_module(script)
        for test_module in ("test_rng", "test_perturb", "test_update", "test_lowrank", "test_multi_tensor",
                            "test_partition", "test_errors", "test_lowering", "test_examples", "test_embedding_api",
                            "test_openai_es_loop"):
            importlib.import_module("kernels_tests." + test_module)
        from copes.errors import UserError
        from copes.rewards import MathVerifierPool
        from copes.tools import BM25Search
        from copes.extras import require
        for make in (lambda: BM25Search({str(corpus)!r}), MathVerifierPool, lambda: require("datasets")):
            try:
                make()
            except UserError as error:
                print("error:", error)
        print("imported")
    """)
    assert result.returncode == 0, result.stderr[-3000:]
    lines = result.stdout.splitlines()
    assert lines[-1] == "imported"
    assert "cpu tensors run on: reference" in lines  # without numba, dispatch falls back to the reference
    assert "error: the local BM25 search tool needs the 'bm25s' package, which is not installed: " \
           "pip install 'copes[search]'" in lines
    assert any("'math-verify' package" in line and "copes[math]" in line for line in lines)
    assert any("'datasets' package" in line and "copes[hub]" in line for line in lines)


def test_gpu_check_installs_nothing_and_without_a_gpu_says_so_in_its_one_tarball(tmp_path: Path) -> None:
    """Without a GPU the script stops before its phases with one line, and still returns its one tarball."""
    script = REPO / "bench" / "gpu_check.sh"
    for source in (script, REPO / "bench" / "device" / "gpu_check.py"):
        assert not re.search(r"\bpip\b|install ", source.read_text().replace("installs nothing", "")), source
    result = subprocess.run(
        ["bash", str(script)], capture_output=True, text=True, timeout=120,
        env={"PATH": "/usr/bin:/bin", "OUT": str(tmp_path), "PYTHON": sys.executable, "CUDA_VISIBLE_DEVICES": "",
             "TMPDIR": str(tmp_path)},
    )
    assert result.returncode == 1
    lines = result.stdout.splitlines()
    assert lines[0] == "== env: FAILED (no CUDA device visible to torch; on a CPU machine use --cpu-dry-run)"
    assert lines[1].startswith(f"== bundle: {tmp_path}/gpu_check.tar.gz") and "gpu_check FAILED" in lines[1]
    assert [path.name for path in tmp_path.iterdir()] == ["gpu_check.tar.gz"]

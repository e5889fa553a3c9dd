"""numba's on-disk cache never serves a kernel built from stale sources: every kernel of the compiled CPU backend
is stamped with the files it is compiled from (the backend's kernel files and the contract's rng.py)."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("numba")
from copes_kernels.backends.cpu import numba_cache  # noqa: E402

PACKAGE = Path(__file__).resolve().parents[1] / "copes_kernels"
WORDS = (
    "import json, torch\n"
    "from copes_kernels.backends.cpu import kernels, ops\n"
    "from copes_kernels import rng\n"
    "counter = torch.tensor([[1, 2, 3, 4]]); key = torch.tensor([[5, 6]])\n"
    "stats = kernels.philox_kernel.stats\n"
    "compiled = ops.philox4x32_10(counter, key).tolist()\n"
    "print(json.dumps({'compiled': compiled, 'contract': rng.philox4x32_10(counter, key).tolist(),"
    " 'cache_hits': sum(stats.cache_hits.values())}))\n"
)


def words(tree: Path) -> dict:
    env = {key: value for key, value in os.environ.items() if not key.startswith("NUMBA_CACHE")}
    env.update(PYTHONPATH=str(tree), OMP_NUM_THREADS="1")
    result = subprocess.run([sys.executable, "-c", WORDS], cwd=tree, env=env, capture_output=True, text=True,
                            timeout=600)
    assert result.returncode == 0, result.stderr[-2000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


def test_a_changed_contract_constant_recompiles_the_cached_kernel(tmp_path: Path) -> None:
    """Philox's first Weyl constant changed in rng.py (kernels.py untouched): the next process must compile again
    and agree with the changed contract, not load the words of the old constant from the cache."""
    tree = tmp_path / "tree"
    shutil.copytree(PACKAGE, tree / "copes_kernels", ignore=shutil.ignore_patterns("__pycache__"))
    first = words(tree)
    assert first["compiled"] == first["contract"] and first["cache_hits"] == 0
    assert words(tree)["cache_hits"] == 1  # unchanged sources: served from the cache
    rng_file = tree / "copes_kernels" / "rng.py"
    rng_file.write_text(re.sub(r"PHILOX_W0 = 0x9E3779B9", "PHILOX_W0 = 0x9E3779BB", rng_file.read_text()))
    changed = words(tree)
    assert changed["cache_hits"] == 0, "a kernel compiled against the old constant was served from the cache"
    assert changed["compiled"] == changed["contract"] != first["contract"]


def test_every_file_that_defines_numba_code_is_in_the_stamp() -> None:
    package_dir = PACKAGE / "backends" / "cpu"
    defining = {path.name for path in package_dir.glob("*.py")
                if re.search(r"^@(numba\.njit|intrinsic|overload)", path.read_text(), re.MULTILINE)}
    assert defining <= set(numba_cache.KERNEL_FILES), f"add {sorted(defining - set(numba_cache.KERNEL_FILES))}"
    assert PACKAGE / "rng.py" in numba_cache.source_files()


def test_each_environment_caches_in_a_folder_of_its_own() -> None:
    """Two environments on one checkout (the vLLM virtualenv pins other numba and numpy versions) must not overwrite
    each other's cache index: the kernels' cache folder is named by numba's and numpy's versions."""
    from copes_kernels.backends.cpu import kernels

    cache = kernels.philox_kernel._cache
    assert type(cache._impl.locator) in (numba_cache.UserDirLocator, numba_cache.InTreeLocator)
    assert Path(cache._cache_path).name == numba_cache.ENVIRONMENT_TAG


@pytest.mark.slow
def test_a_child_compiles_and_the_process_only_loads_the_cache(tmp_path: Path) -> None:
    """warm_up(in_child=True) (the trainer's choice for a multi-GiB model): the compile, and the LLVM state numba keeps
    for the life of the process that compiles (~0.1 GiB), happen in a child; on a fresh tree this process then finds
    every kernel in the cache and compiles none."""
    tree = tmp_path / "tree"
    shutil.copytree(PACKAGE, tree / "copes_kernels", ignore=shutil.ignore_patterns("__pycache__"))
    script = (
        "import json, numba, torch\n"
        "from copes_kernels import warm_up\n"
        "from copes_kernels.backends.cpu import kernels, multi_kernels\n"
        "warm_up((torch.float32,), in_child=True)\n"
        "dispatchers = [f for m in (kernels, multi_kernels) for f in vars(m).values()\n"
        "               if isinstance(f, numba.core.registry.CPUDispatcher)]\n"
        "print(json.dumps({'hits': sum(sum(f.stats.cache_hits.values()) for f in dispatchers),\n"
        "                  'misses': sum(sum(f.stats.cache_misses.values()) for f in dispatchers)}))\n"
    )
    env = {key: value for key, value in os.environ.items() if not key.startswith("NUMBA_CACHE")}
    env.update(PYTHONPATH=str(tree), OMP_NUM_THREADS="1")
    result = subprocess.run([sys.executable, "-c", script], cwd=tree, env=env, capture_output=True, text=True,
                            timeout=600)
    assert result.returncode == 0, result.stderr[-2000:]
    counts = json.loads(result.stdout.strip().splitlines()[-1])
    assert counts["hits"] > 0 and counts["misses"] == 0, counts

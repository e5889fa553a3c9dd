"""numba's on-disk cache for this backend, stamped with the source of everything its kernels compile in.

numba stamps a cached kernel with the content of the one file that defines it: a kernel of `kernels.py` that
inlines code of `numerics.py` and constants of `copes_kernels.rng` would be served stale after either changed.
The locators here keep numba's place for the cache (`__pycache__` beside the source, or NUMBA_CACHE_DIR) but stamp
every kernel of this package with one digest of the files its kernels are compiled from (KERNEL_FILES, and the
contract's rng.py), so a change to any of them recompiles every kernel; host-side files (ops, multi_tensor, warm)
are not in it, and a test checks that every file defining a kernel is. Imported before any kernel is defined
(numba picks a kernel's locator then).

Each environment gets a folder of its own below numba's place (`ENVIRONMENT_TAG`: numba's and numpy's versions):
two environments on one checkout (the README's vLLM virtualenv pins other versions) would otherwise overwrite each
other's cache index, and each start would compile again.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import numba
import numpy
from numba.core import caching

PACKAGE_DIR = Path(__file__).resolve().parent
# The files of this package that define numba code, this one included (it decides the stamp).
KERNEL_FILES = ("numba_cache.py", "numerics.py", "kernels.py", "multi_kernels.py")
CONTRACT_FILES = (PACKAGE_DIR.parents[1] / "rng.py",)


def source_files() -> tuple[Path, ...]:
    """Every file whose content the kernels' machine code depends on."""
    return (*(PACKAGE_DIR / name for name in KERNEL_FILES), *CONTRACT_FILES)


def source_digest() -> str:
    digest = hashlib.sha256()
    for path in source_files():
        digest.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()


SOURCE_STAMP = source_digest()
ENVIRONMENT_TAG = f"numba-{numba.__version__}-numpy-{numpy.__version__}"


class _BackendStamp:
    """For this package's kernels only: numba's own locator, with the package-wide stamp."""

    @classmethod
    def from_function(cls, py_func, py_file):  # noqa: ANN001, ANN206 (numba's signature)
        if Path(py_file).resolve().parent != PACKAGE_DIR:
            return None
        return super().from_function(py_func, py_file)

    def get_source_stamp(self) -> str:
        return SOURCE_STAMP

    def get_cache_path(self) -> str:
        return os.path.join(super().get_cache_path(), ENVIRONMENT_TAG)


# numba renamed these in 0.61 (the leading underscore went); setup.py allows 0.60.
_USER_DIR = getattr(caching, "UserProvidedCacheLocator", None) or caching._UserProvidedCacheLocator
_IN_TREE = getattr(caching, "InTreeCacheLocator", None) or caching._InTreeCacheLocator
_CACHE_IMPL = getattr(caching, "CacheImpl", None) or caching._CacheImpl


class UserDirLocator(_BackendStamp, _USER_DIR):
    pass


class InTreeLocator(_BackendStamp, _IN_TREE):
    pass


if UserDirLocator not in _CACHE_IMPL._locator_classes:
    _CACHE_IMPL._locator_classes[0:0] = [UserDirLocator, InTreeLocator]

"""The user's code and files as a run names them: `MODULE:NAME` import paths (a task factory, a reward function),
the source file behind one, and the one SHA-256 helper the journal, the checkpoints and the plugins hash with.

A foundation module: tasks, rewards and the durable run all read user code through it, so none of them imports
another room for it.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import os
import sys
from pathlib import Path
from typing import Any

from copes.errors import ConfigError


def is_import_path(spec: str) -> bool:
    """`MODULE:NAME` with a dotted Python module name (not a file path, not a hub id)."""
    module, sep, name = spec.partition(":")
    return bool(sep) and name.isidentifier() and all(part.isidentifier() for part in module.split("."))


def _importable_from_cwd() -> None:
    """The working directory on sys.path, as `python -m` has it: user modules live beside the user's data."""
    if os.getcwd() not in sys.path and "" not in sys.path:
        sys.path.insert(0, os.getcwd())


def import_object(spec: str, what: str) -> Any:
    """The object `MODULE:NAME` names; a missing module or name is one ConfigError line."""
    if not is_import_path(spec):
        raise ConfigError(f"{what} {spec!r} is not MODULE:NAME")
    module_name, _, name = spec.partition(":")
    _importable_from_cwd()
    try:
        module = importlib.import_module(module_name)
    except ImportError as error:
        raise ConfigError(f"{what} {spec}: cannot import {module_name} from the working directory or "
                          f"PYTHONPATH ({error})") from None
    except Exception as error:  # noqa: BLE001 - the user's module failed while importing: one line, not a traceback
        raise ConfigError(f"{what} {spec}: importing {module_name} failed ({type(error).__name__}: {error})") from None
    if not hasattr(module, name):
        raise ConfigError(f"{what} {spec}: module {module_name} ({module.__file__}) has no {name!r}")
    return getattr(module, name)


def module_source(spec_or_module: str) -> Path | None:
    """The source file of the module in `MODULE:NAME` (or a bare module name), found without running it."""
    _importable_from_cwd()
    try:
        found = importlib.util.find_spec(spec_or_module.partition(":")[0])
    except (ImportError, ValueError):
        return None
    return Path(found.origin) if found is not None and found.origin and Path(found.origin).is_file() else None


def sha256_of(path: Path) -> str:
    """The hex SHA-256 of a file's bytes, or of a folder: every file under it by relative name and digest, in
    sorted order (a renamed, added or changed file changes it)."""
    if path.is_dir():
        digest = hashlib.sha256()
        for file in sorted(p for p in path.rglob("*") if p.is_file()):
            digest.update(f"{file.relative_to(path)}\0{sha256_of(file)}\0".encode())
        return digest.hexdigest()
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()

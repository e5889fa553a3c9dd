"""Pretend optional packages are installed or not: `importlib.util.find_spec` answers for the named modules."""

from __future__ import annotations

import importlib.util

import pytest


def pretend_installed(monkeypatch: pytest.MonkeyPatch, modules: dict[str, bool]) -> None:
    """find_spec finds each module of `modules` exactly when its value is True; other modules as they are."""
    real = importlib.util.find_spec

    def find_spec(name: str, *args):
        if name in modules:
            return object() if modules[name] else None
        return real(name, *args)

    monkeypatch.setattr(importlib.util, "find_spec", find_spec)

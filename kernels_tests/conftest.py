"""Kernel-suite setup: Triton's interpreter on machines without CUDA, the `gpu` marker, backend/device fixtures.

TRITON_INTERPRET must be set before copes_kernels' Triton modules are imported (their kernels become interpreted
functions at definition time), so it is set here, before any test module is imported. On a CUDA machine it
stays unset and the "triton" backend runs the compiled kernels on the GPU.
"""

from __future__ import annotations

import importlib.util
import os

import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402

BACKENDS = ("reference", "cpu", "triton")


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "gpu: needs a CUDA device (skipped without one)")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


@pytest.fixture(params=BACKENDS)
def backend(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Routes the public copes_kernels ops to one backend (through the real dispatcher)."""
    if request.param == "cpu" and torch.cuda.is_available():
        pytest.skip("the compiled CPU backend takes CPU tensors; on this machine the suite's device is CUDA")
    if request.param == "cpu" and importlib.util.find_spec("numba") is None:
        pytest.skip("the compiled CPU backend needs numba (installed with copes; absent on a bare GPU image)")
    monkeypatch.setenv("COPES_BACKEND", request.param)
    return request.param


@pytest.fixture
def device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")

"""Backend choice: CUDA tensors run the Triton kernels, CPU tensors the compiled CPU backend (`cpu.py`, numba).

Without numba, CPU tensors fall back to the torch reference. `COPES_BACKEND=cpu` forces the compiled CPU backend
(its tensors must be on the CPU); `COPES_BACKEND=triton` forces the Triton kernels everywhere (on CPU through Triton's interpreter, which needs
TRITON_INTERPRET=1 before the kernels are defined: set here when the kernel modules are first imported);
`COPES_BACKEND=reference` forces the reference, e.g. to bisect a suspected kernel bug.
"""

from __future__ import annotations

import functools
import importlib
import os
from collections.abc import Callable
from types import ModuleType
from typing import Any

import torch

from copes_kernels import reference

BACKENDS = ("auto", "reference", "cpu", "triton")
CPU_MODULE = "copes_kernels.cpu"  # every op, under its public name

# Where each op's Triton launcher lives (same name and signature as its reference twin).
TRITON_MODULES = {
    "philox4x32_10": "copes_kernels.triton_rng",
    "normal": "copes_kernels.triton_rng",
    "perturb_": "copes_kernels.perturb",
    "backup_chunks": "copes_kernels.perturb",
    "restore_chunks_": "copes_kernels.perturb",
    "accumulate_": "copes_kernels.update",
    "lowrank_factors": "copes_kernels.lowrank",
    "lowrank_linear": "copes_kernels.lowrank",
    "lowrank_accumulate_": "copes_kernels.lowrank",
    "multi_perturb_": "copes_kernels.multi_tensor",
    "multi_restore_": "copes_kernels.multi_tensor",
    "multi_accumulate_": "copes_kernels.multi_tensor",
}


@functools.cache
def _importable(module: str) -> bool:
    try:
        importlib.import_module(module)
    except ImportError:
        return False
    return True


def triton_available() -> bool:
    return _importable("triton")


def numba_available() -> bool:
    return _importable("numba")


@functools.cache
def _backend_choice(setting: str) -> str:
    """COPES_BACKEND's value, normalised and checked (cached: the dispatcher reads it on every call)."""
    choice = setting.strip().lower() or "auto"
    if choice not in BACKENDS:
        raise ValueError(f"COPES_BACKEND must be one of {BACKENDS}, got {choice!r}")
    return choice


# os.environ.get of an unset variable costs microseconds (it raises and catches KeyError twice), and every op call
# reads COPES_BACKEND: read CPython's underlying mapping directly where it exists.
_ENVIRON_DATA = getattr(os.environ, "_data", None)
_ENVIRON_KEY = os.environ.encodekey("COPES_BACKEND") if hasattr(os.environ, "encodekey") else None


def _backend_setting() -> str:
    if _ENVIRON_DATA is None or _ENVIRON_KEY is None:
        return os.environ.get("COPES_BACKEND", "auto")
    value = _ENVIRON_DATA.get(_ENVIRON_KEY)
    return "auto" if value is None else os.environ.decodevalue(value)


def backend_for(device: torch.device | str | None) -> str:
    """'triton', 'cpu' or 'reference' for data on `device`, honouring COPES_BACKEND."""
    return _backend(_backend_setting(), device)


@functools.cache
def _backend(setting: str, device: torch.device | str | None) -> str:
    """backend_for's answer for a COPES_BACKEND value and a device (cached: every op call asks, and reading a
    device's type costs as much as the rest of the dispatch)."""
    device_type = "cpu" if device is None else (device if isinstance(device, torch.device) else torch.device(device)).type
    choice = _backend_choice(setting)
    if choice == "auto":
        if device_type == "cuda" and triton_available():
            return "triton"
        return "cpu" if device_type == "cpu" and numba_available() else "reference"
    if choice == "triton" and not triton_available():
        raise RuntimeError("COPES_BACKEND=triton but triton is not installed (pip install 'copes[triton]')")
    if choice == "cpu" and not numba_available():
        raise RuntimeError("COPES_BACKEND=cpu but numba is not installed (pip install numba)")
    if choice == "cpu" and device_type != "cpu":
        raise ValueError(f"COPES_BACKEND=cpu runs on CPU tensors only, got data on {device_type}")
    return choice


def _triton_module(name: str, device: torch.device | str | None) -> ModuleType:
    module_name = TRITON_MODULES[name]
    # Pin fp fusion (a*b + c -> one FMA) to what the kernels were measured and tested with: Triton's default
    # changes in 3.10 (and it warns until then). An explicit TRITON_DEFAULT_FP_FUSION from the user still wins.
    os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    on_cpu = device is None or torch.device(device).type == "cpu"
    if on_cpu and module_name not in importlib.sys.modules:
        os.environ.setdefault("TRITON_INTERPRET", "1")
    if on_cpu and os.environ.get("TRITON_INTERPRET") != "1":
        raise RuntimeError("Triton kernels on CPU tensors need TRITON_INTERPRET=1 (set it before importing copes_kernels)")
    return importlib.import_module(module_name)


@functools.cache
def _compiled_cpu_op(name: str) -> Callable[..., Any]:
    """The compiled CPU twin of op `name` (imported on first use: numba loads only if a CPU op runs)."""
    return getattr(importlib.import_module(CPU_MODULE), name)


def dispatched(
    name: str, device_of: Callable[[tuple[Any, ...], dict[str, Any]], torch.device | str | None]
) -> Callable[..., Any]:
    """The public op `name`: routes each call to the Triton launcher or the reference twin."""
    reference_op = getattr(reference, name)

    @functools.wraps(reference_op)
    def op(*args: Any, **kwargs: Any) -> Any:
        device = device_of(args, kwargs)  # the packed arguments: unpacking them again costs a dict per call
        backend = backend_for(device)
        if backend == "reference":
            return reference_op(*args, **kwargs)
        if backend == "cpu":
            return _compiled_cpu_op(name)(*args, **kwargs)
        return getattr(_triton_module(name, device), name)(*args, **kwargs)

    return op


def _first_tensor_device(args: tuple[Any, ...], kwargs: dict[str, Any]) -> torch.device:
    first = args[0] if args else None
    if not isinstance(first, torch.Tensor):
        raise TypeError(f"expected a tensor as the first (positional) argument, got {type(first).__name__}")
    return first.device


def _table_device(args: tuple[Any, ...], kwargs: dict[str, Any]) -> torch.device:
    table = args[0] if args else None
    if not hasattr(table, "runs"):
        raise TypeError(f"expected a copes_kernels.RunTable as the first argument, got {type(table).__name__}")
    return table.device


def _device_keyword(args: tuple[Any, ...], kwargs: dict[str, Any]) -> torch.device | str | None:
    return kwargs.get("device")


philox4x32_10 = dispatched("philox4x32_10", _first_tensor_device)
normal = dispatched("normal", _device_keyword)
perturb_ = dispatched("perturb_", _first_tensor_device)
backup_chunks = dispatched("backup_chunks", _first_tensor_device)
restore_chunks_ = dispatched("restore_chunks_", _first_tensor_device)
accumulate_ = dispatched("accumulate_", _first_tensor_device)
lowrank_factors = dispatched("lowrank_factors", _device_keyword)
lowrank_linear = dispatched("lowrank_linear", _first_tensor_device)
lowrank_accumulate_ = dispatched("lowrank_accumulate_", _first_tensor_device)
multi_perturb_ = dispatched("multi_perturb_", _table_device)
multi_restore_ = dispatched("multi_restore_", _table_device)
multi_accumulate_ = dispatched("multi_accumulate_", _table_device)

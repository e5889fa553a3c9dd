"""The dispatcher: every public op routed to one backend package (copes_kernels/backends), by where its data lives.

CUDA tensors run the Triton backend, CPU tensors the compiled CPU backend (numba), or the torch reference where
numba is missing. `COPES_BACKEND=cpu` forces the compiled CPU backend (its tensors must be on the CPU);
`COPES_BACKEND=triton` forces the Triton kernels everywhere (on CPU through Triton's interpreter, which needs
TRITON_INTERPRET=1 before the kernels are defined: set here when the Triton package is first imported);
`COPES_BACKEND=reference` forces the reference, e.g. to bisect a suspected kernel bug. Triton launches run with
the data's GPU as the current device; in-place ops of the compiled backends bump the written tensors' version
counters. The routing table is derived from `backends.OP_NAMES`, the one list of op names.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import os
import sys
from collections.abc import Callable
from typing import Any

import torch

from copes_kernels.backends import OP_NAMES

BACKENDS = ("auto", "reference", "cpu", "triton")
# The package of each backend; each exports every name in OP_NAMES (imported on first use: numba and triton load
# only where an op runs on them).
BACKEND_PACKAGES = {
    "reference": "copes_kernels.backends.reference",
    "cpu": "copes_kernels.backends.cpu",
    "triton": "copes_kernels.backends.triton",
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
    device_type = ("cpu" if device is None
                   else (device if isinstance(device, torch.device) else torch.device(device)).type)
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


def _import_triton_backend(device: torch.device | str | None) -> None:
    """Import the Triton package, first choosing the interpreter when its data is on the CPU."""
    # Pin fp fusion (a*b + c -> one FMA) to what the kernels were measured and tested with: Triton's default
    # changes in 3.10 (and it warns until then). An explicit TRITON_DEFAULT_FP_FUSION from the user still wins.
    os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    on_cpu = device is None or torch.device(device).type == "cpu"
    if on_cpu and BACKEND_PACKAGES["triton"] not in sys.modules:
        os.environ.setdefault("TRITON_INTERPRET", "1")
    if on_cpu and os.environ.get("TRITON_INTERPRET") != "1":
        raise RuntimeError("Triton kernels on CPU tensors need TRITON_INTERPRET=1 "
                           "(set it before importing copes_kernels)")


@functools.cache
def _backend_op(backend: str, name: str) -> Callable[..., Any]:
    """Op `name` of one backend package (imported on first use)."""
    return getattr(importlib.import_module(BACKEND_PACKAGES[backend]), name)


def device_guard(device: torch.device | str | None) -> contextlib.AbstractContextManager[Any]:
    """Make `device` the current CUDA device while a kernel launches on its data: Triton launches on the current
    device, which need not be the tensors' (a second GPU of a process)."""
    if device is None:
        return contextlib.nullcontext()
    device = device if isinstance(device, torch.device) else torch.device(device)
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()


def _written_tensors(name: str) -> Callable[[tuple[Any, ...]], Any] | None:
    """What an in-place op (its name ends in `_`) writes: its first argument, or a run table's tensors."""
    if not name.endswith("_"):
        return None
    return (lambda args: args[0].tensors) if name.startswith("multi_") else (lambda args: args[0])


def dispatched(
    name: str, device_of: Callable[[tuple[Any, ...], dict[str, Any]], torch.device | str | None]
) -> Callable[..., Any]:
    """The public op `name`: routes each call to the backend its data's device (and COPES_BACKEND) picks.

    The compiled backends write through data pointers, which torch does not see: after their in-place ops the
    written tensors' version counters are bumped here, as torch's own in-place ops (the reference's) bump them.
    """
    reference_op = _backend_op("reference", name)
    written = _written_tensors(name)

    @functools.wraps(reference_op)
    def op(*args: Any, **kwargs: Any) -> Any:
        device = device_of(args, kwargs)  # the packed arguments: unpacking them again costs a dict per call
        backend = backend_for(device)
        if backend == "reference":
            return reference_op(*args, **kwargs)
        if backend == "cpu":
            result = _backend_op("cpu", name)(*args, **kwargs)
        else:
            _import_triton_backend(device)
            with device_guard(device):
                result = _backend_op("triton", name)(*args, **kwargs)
        if written is not None:
            torch.autograd.graph.increment_version(written(args))
        return result

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


# Where each op's data lives: the first positional tensor, a run table, or the `device` keyword.
_DEVICE_KEYWORD_OPS = ("normal", "lowrank_factors")


def _device_rule(name: str) -> Callable[[tuple[Any, ...], dict[str, Any]], torch.device | str | None]:
    if name.startswith("multi_"):
        return _table_device
    return _device_keyword if name in _DEVICE_KEYWORD_OPS else _first_tensor_device


PUBLIC_OPS = {name: dispatched(name, _device_rule(name)) for name in OP_NAMES}
# One module-level name per op, spelled out (not a globals() loop) so IDEs, type checkers and `from copes_kernels
# import perturb_` see them; each line is the same shape by design.
philox4x32_10 = PUBLIC_OPS["philox4x32_10"]
normal = PUBLIC_OPS["normal"]
perturb_ = PUBLIC_OPS["perturb_"]
backup_chunks = PUBLIC_OPS["backup_chunks"]
restore_chunks_ = PUBLIC_OPS["restore_chunks_"]
accumulate_ = PUBLIC_OPS["accumulate_"]
lowrank_factors = PUBLIC_OPS["lowrank_factors"]
lowrank_linear = PUBLIC_OPS["lowrank_linear"]
lowrank_accumulate_ = PUBLIC_OPS["lowrank_accumulate_"]
multi_perturb_ = PUBLIC_OPS["multi_perturb_"]
multi_restore_ = PUBLIC_OPS["multi_restore_"]
multi_accumulate_ = PUBLIC_OPS["multi_accumulate_"]

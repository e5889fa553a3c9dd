"""Count the distinct GPU compiles of each copes_kernels Triton kernel that a pytest run launches.

On CPU the suite runs the kernels in Triton's interpreter, which compiles nothing. This runs pytest in-process and
records, for every launch, the key a GPU launch compiles under: the constexpr arguments, and Triton's own
specialisation of every other argument (`native_specialize_impl`: its type, and, unless the kernel lists it in
do_not_specialize, whether an integer is 1 or divisible by 16 and whether a pointer is 16-byte aligned). The noise
kernels' BLOCK is left out of the key: on a GPU it is one fixed value per kernel (`triton_rng.noise_block`); only
the interpreter shrinks it for short runs. On a CUDA machine the kernels really compile, and the summary also
reports the size of each kernel's compile cache (bench/gpu_check.sh's kernels phase runs the kernel tests through
this module).

    python -m kernels_tests.count_compiles [pytest arguments]      # default: -q -p no:cacheprovider kernels_tests tests
"""

from __future__ import annotations

import inspect
import os
import sys
from collections import defaultdict
from collections.abc import Callable

import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported, as kernels_tests/conftest.py sets it

import pytest  # noqa: E402
import triton.language as tl  # noqa: E402
from triton.backends.compiler import BaseBackend  # noqa: E402
from triton.runtime.interpreter import InterpretedFunction  # noqa: E402
from triton.runtime.jit import JITFunction, native_specialize_impl  # noqa: E402

from copes_kernels.backends.triton import lowrank, multi_tensor, perturb, update  # noqa: E402
from copes_kernels.backends.triton import rng as triton_rng
from copes_kernels.backends.triton import shared as _shared

KERNEL_MODULES = (triton_rng, perturb, update, multi_tensor, _shared, lowrank)
# Kernels whose BLOCK follows triton_rng.noise_block (fixed on a GPU).
FIXED_BLOCK = {"_normal_rows_kernel", "_perturb_kernel", "_copy_runs_kernel", "_accumulate_kernel",
               "_multi_perturb_kernel", "_multi_restore_kernel", "_multi_accumulate_kernel", "_store_stochastic_kernel"}


Kernel = InterpretedFunction | JITFunction


def copes_kernels() -> dict[str, Kernel]:
    return {name: value for module in KERNEL_MODULES for name, value in vars(module).items()
            if isinstance(value, Kernel) and name.endswith("_kernel")}


def compile_key(kernel: Kernel, args: tuple, kwargs: dict) -> tuple:
    """What a GPU launch with these arguments compiles under (see the module docstring)."""
    signature = inspect.signature(kernel.fn)
    bound = signature.bind(*args, **kwargs)
    if isinstance(kernel, JITFunction):
        unspecialised = {param.name for param in kernel.params if param.do_not_specialize}
    else:
        unspecialised = set(kernel.kwargs.get("do_not_specialize") or ())
    key = []
    for name, value in bound.arguments.items():
        if signature.parameters[name].annotation in (tl.constexpr, "tl.constexpr"):
            if not (name == "BLOCK" and kernel.__name__ in FIXED_BLOCK):
                key.append((name, repr(value)))
        else:
            key.append((name, native_specialize_impl(BaseBackend, value, False, name not in unspecialised, True)))
    return tuple(key)


class CompileCounter:
    """A pytest plugin: wraps every kernel's launch for the session and prints the distinct keys per kernel."""

    def __init__(self) -> None:
        self.keys: dict[str, set[tuple]] = defaultdict(set)
        self.launches: dict[str, int] = defaultdict(int)

    def _recording(self, kernel: Kernel) -> Callable:
        run = kernel.run

        def recorded(*args, grid, warmup, **kwargs):
            self.keys[kernel.__name__].add(compile_key(kernel, args, kwargs))
            self.launches[kernel.__name__] += 1
            return run(*args, grid=grid, warmup=warmup, **kwargs)

        return recorded

    def pytest_sessionstart(self, session: pytest.Session) -> None:
        for kernel in copes_kernels().values():
            kernel.run = self._recording(kernel)

    def pytest_terminal_summary(self, terminalreporter) -> None:
        terminalreporter.section("GPU compiles per copes_kernels kernel")
        kernels = copes_kernels()
        compiled = {name: sum(len(cache) for cache, *_ in kernel.device_caches.values())
                    for name, kernel in kernels.items() if isinstance(kernel, JITFunction)}
        for name in sorted(kernels):
            cache = f"  compiled {compiled[name]:3d}" if name in compiled else ""
            terminalreporter.write_line(
                f"{name:28s} launches {self.launches[name]:6d}  compiles {len(self.keys[name]):3d}{cache}"
            )
        cache = f"  compiled {sum(compiled.values()):3d}" if compiled else ""
        terminalreporter.write_line(f"{'total':28s} launches {sum(self.launches.values()):6d}  "
                                    f"compiles {sum(len(keys) for keys in self.keys.values()):3d}{cache}")


def main() -> None:
    args = sys.argv[1:] or ["-q", "-p", "no:cacheprovider", "kernels_tests", "tests"]
    raise SystemExit(pytest.main(args, plugins=[CompileCounter()]))


if __name__ == "__main__":
    main()

"""Compile every copes_kernels Triton kernel for an NVIDIA target without a GPU (TTIR -> PTX -> cubin).

The CPU interpreter checks what the kernels compute; this checks that the real compiler accepts them (types,
tl.dot shapes, constexpr branches) on machines with no GPU. Run it without TRITON_INTERPRET:

    python -m kernels_tests.lower_kernels [--arch 90]
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import tempfile
from pathlib import Path

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from copes_kernels import _shared, lowrank, perturb, triton_rng, update

STREAM = {name: "i32" for name in triton_rng.STREAM_ARGS}


def _signature(kernel, **types: str) -> dict[str, str]:
    """Argument types in the kernel's parameter order (a renamed parameter fails loudly here)."""
    return {name: types[name] if name in types else STREAM[name] for name in kernel.arg_names}


def kernel_cases() -> list[tuple[str, object, dict[str, str], dict[str, object]]]:
    cases = [
        ("philox", triton_rng._philox_kernel,
         _signature(triton_rng._philox_kernel, counter_ptr="*i64", key_ptr="*i64", words_ptr="*i64", rows="i32",
                    BLOCK="constexpr"), {"BLOCK": triton_rng.PHILOX_ROWS}),
        ("normal_rows", triton_rng._normal_rows_kernel,
         _signature(triton_rng._normal_rows_kernel, out_ptr="*fp32", members_ptr="*i64", n="i32", tiles_per_row="i32",
                    BLOCK="constexpr"), {"BLOCK": triton_rng.GPU_NOISE_BLOCK}),
        ("copy_runs", perturb._copy_runs_kernel,
         _signature(perturb._copy_runs_kernel, chunked_ptr="*i16", packed_ptr="*i16", run_starts_ptr="*i64",
                    run_stops_ptr="*i64", packed_starts_ptr="*i64", tiles_per_run="i32", TO_PACKED="constexpr",
                    BLOCK="constexpr"), {"TO_PACKED": True, "BLOCK": 4 * triton_rng.GPU_NOISE_BLOCK}),
    ]
    for dtype in ("fp32", "bf16", "fp16"):
        cases += [
            (f"perturb[{dtype}]", perturb._perturb_kernel,
             _signature(perturb._perturb_kernel, dst_ptr=f"*{dtype}", src_ptr=f"*{dtype}", run_starts_ptr="*i64",
                        run_stops_ptr="*i64", tiles_per_run="i32", sigma="fp32", BLOCK="constexpr"),
             {"BLOCK": triton_rng.GPU_NOISE_BLOCK}),
            (f"accumulate[{dtype}]", update._accumulate_kernel,
             _signature(update._accumulate_kernel, target_ptr=f"*{dtype}", run_starts_ptr="*i64", run_stops_ptr="*i64",
                        run_first_member_ptr="*i64", run_end_member_ptr="*i64", members_ptr="*i64", coeffs_ptr="*fp32",
                        tiles_per_run="i32", STOCHASTIC="constexpr", BLOCK="constexpr"),
             {"STOCHASTIC": dtype != "fp32", "BLOCK": triton_rng.GPU_NOISE_BLOCK}),
            (f"lowrank_correction[{dtype}]", lowrank._lowrank_correction_kernel,
             _signature(lowrank._lowrank_correction_kernel, out_ptr=f"*{dtype}", x_ptr=f"*{dtype}", a_ptr="*fp32",
                        b_ptr="*fp32", row_member_ptr="*i64", tokens="i32", in_features="i32", out_features="i32",
                        rank="i32", scale="fp32", BLOCK_T="constexpr", BLOCK_K="constexpr", BLOCK_O="constexpr",
                        RANK="constexpr"),
             {"BLOCK_T": 16, "BLOCK_K": lowrank.BLOCK_IN, "BLOCK_O": lowrank.BLOCK_OUT, "RANK": lowrank.MIN_DOT}),
        ]
    for dtype in ("bf16", "fp16"):
        cases.append(
            (f"store_stochastic[{dtype}]", _shared._store_stochastic_kernel,
             _signature(_shared._store_stochastic_kernel, dst_ptr=f"*{dtype}", values_ptr="*fp32", n="i32",
                        BLOCK="constexpr"), {"BLOCK": 4 * triton_rng.GPU_NOISE_BLOCK})
        )
    return cases


def resource_usage(cubin: bytes) -> str:
    """Registers / stack / spills from cuobjdump (shipped with Triton's NVIDIA backend), or '' without it."""
    cuobjdump = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    if not cuobjdump.exists():
        return ""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as file:
        file.write(cubin)
        file.flush()
        command = [str(cuobjdump), "--dump-resource-usage", file.name]
        listing = subprocess.run(command, capture_output=True, text=True, check=True).stdout
    return " ".join(re.findall(r"(?:REG|STACK|LOCAL):\d+", listing))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", type=int, default=90, help="compute capability, e.g. 80 (A100) or 90 (H100/H200)")
    args = parser.parse_args()
    if os.environ.get("TRITON_INTERPRET") == "1":
        raise SystemExit("unset TRITON_INTERPRET: the interpreter replaces the compiler this script exercises")
    target = GPUTarget("cuda", args.arch, 32)
    for name, kernel, signature, constexprs in kernel_cases():
        # Constexprs keyed by (argument index,): the form every Triton 3.x accepts.
        by_index = {(kernel.arg_names.index(arg),): value for arg, value in constexprs.items()}
        compiled = triton.compile(ASTSource(fn=kernel, signature=signature, constexprs=by_index), target=target)
        usage = resource_usage(compiled.asm["cubin"]) if "cubin" in compiled.asm else "ptx only"
        print(f"{name:28s} sm_{args.arch}  {usage}")


if __name__ == "__main__":
    main()

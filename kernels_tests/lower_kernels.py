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

from copes_kernels.backends.triton import lowrank, multi_tensor, perturb, update
from copes_kernels.backends.triton import rng as triton_rng
from copes_kernels.backends.triton import shared as _shared

STREAM = dict.fromkeys(triton_rng.STREAM_ARGS, "i32")
BIN = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
THREADS = 4 * 32  # Triton's default num_warps=4
# Kernels whose BLOCK counts Philox counters (4 elements each) rather than elements.
NOISE_KERNELS = {"normal_rows", "perturb", "accumulate", "multi_perturb", "multi_restore", "multi_accumulate",
                 "store_stochastic"}
# A SASS instruction line of cuobjdump: /*0af0*/  @!P0 IMAD.WIDE R2, R3, ...
_SASS_LINE = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)\b(.*?);")


def _signature(kernel, **types: str) -> dict[str, str]:
    """Argument types in the kernel's parameter order (a renamed parameter fails loudly here)."""
    return {name: types[name] if name in types else STREAM[name] for name in kernel.arg_names}


def aligned_pointers(kernel, signature: dict[str, str]) -> dict[tuple[int], list[list[object]]]:
    """Every pointer argument 16-byte aligned: the specialisation a launch gets for tensors torch allocated."""
    return {(kernel.arg_names.index(name),): [["tt.divisibility", 16]] for name, kind in signature.items()
            if kind.startswith("*")}


def _triton_types(names: dict[str, str]) -> dict[str, object]:
    """Constexpr dtype arguments ("bf16", "i16", ...) as Triton dtypes."""
    by_name = {"fp32": triton.language.float32, "bf16": triton.language.bfloat16, "fp16": triton.language.float16,
               "i32": triton.language.int32, "i16": triton.language.int16}
    return {arg: by_name[value] for arg, value in names.items()}


def kernel_cases() -> list[tuple[str, object, dict[str, str], dict[str, object]]]:
    cases = [
        ("philox", triton_rng._philox_kernel,
         _signature(triton_rng._philox_kernel, counter_ptr="*i64", key_ptr="*i64", words_ptr="*i64", rows="i32",
                    BLOCK="constexpr"), {"BLOCK": triton_rng.PHILOX_ROWS}),
        ("normal_rows", triton_rng._normal_rows_kernel,
         _signature(triton_rng._normal_rows_kernel, out_ptr="*fp32", members_ptr="*i64", n="i32", tiles_per_row="i32",
                    ALIGNED="constexpr", BLOCK="constexpr"), {"ALIGNED": True, "BLOCK": triton_rng.GPU_NOISE_BLOCK}),
        ("copy_runs", perturb._copy_runs_kernel,
         _signature(perturb._copy_runs_kernel, chunked_ptr="*i16", packed_ptr="*i16", run_starts_ptr="*i64",
                    run_stops_ptr="*i64", packed_starts_ptr="*i64", tiles_per_run="i32", TO_PACKED="constexpr",
                    ALIGNED="constexpr", BLOCK="constexpr"),
         {"TO_PACKED": True, "ALIGNED": True, "BLOCK": 4 * triton_rng.GPU_NOISE_BLOCK}),
    ]
    for dtype in ("fp32", "bf16", "fp16"):
        cases += [
            (f"perturb[{dtype}]", perturb._perturb_kernel,
             _signature(perturb._perturb_kernel, dst_ptr=f"*{dtype}", src_ptr=f"*{dtype}", run_starts_ptr="*i64",
                        run_stops_ptr="*i64", tiles_per_run="i32", sigma="fp32", ALIGNED="constexpr",
                        BLOCK="constexpr"),
             {"ALIGNED": True, "BLOCK": triton_rng.GPU_NOISE_BLOCK}),
            (f"accumulate[{dtype}]", update._accumulate_kernel,
             _signature(update._accumulate_kernel, target_ptr=f"*{dtype}", run_starts_ptr="*i64", run_stops_ptr="*i64",
                        run_first_member_ptr="*i64", run_end_member_ptr="*i64", streams_ptr="*i64", coeffs_ptr="*fp32",
                        tiles_per_run="i32", STOCHASTIC="constexpr", ALIGNED="constexpr", BLOCK="constexpr"),
             {"STOCHASTIC": dtype != "fp32", "ALIGNED": True, "BLOCK": triton_rng.GPU_NOISE_BLOCK}),
        ]
        lowrank_signature = _signature(
            lowrank._lowrank_correction_kernel, out_ptr=f"*{dtype}", x_ptr=f"*{dtype}", a_ptr="*fp32", b_ptr="*fp32",
            row_member_ptr="*i64", tokens="i32", in_features="i32", out_features="i32", rank="i32", scale="fp32",
            BLOCK_T="constexpr", BLOCK_K="constexpr", BLOCK_O="constexpr", RANK="constexpr", USE_DOT="constexpr",
        )
        tiles = {"BLOCK_K": lowrank.BLOCK_IN, "BLOCK_O": lowrank.BLOCK_OUT}
        # tl.dot at its token tile (16: the smallest tl.dot allows; larger ones spill); the FMA path for decode
        # (1 token, rank 1) and for a rank-1 prefill tile.
        for label, token_tile, rank_tile, use_dot in (("dot", lowrank.MAX_TOKEN_TILE, 16, True),
                                                      ("decode", 1, 1, False), ("fma16", 16, 1, False)):
            cases.append((f"lowrank_{label}[{dtype}]", lowrank._lowrank_correction_kernel, lowrank_signature,
                          {**tiles, "BLOCK_T": token_tile, "RANK": rank_tile, "USE_DOT": use_dot}))
    # The variants odd offsets and sizes compile (no 128-bit promise): scalar accesses, both mask bounds.
    unaligned = [case for case in cases if case[0] in ("perturb[bf16]", "accumulate[bf16]")]
    for name, kernel, signature, constexprs in unaligned:
        cases.append((name.replace("]", ",unaligned]"), kernel, signature, {**constexprs, "ALIGNED": False}))
    bits = {"fp32": "i32", "bf16": "i16", "fp16": "i16"}
    for dtype in ("fp32", "bf16", "fp16"):
        types = {"DTYPE": dtype, "BITS": bits[dtype]}
        cases += [
            (f"multi_perturb[{dtype}]", multi_tensor._multi_perturb_kernel,
             _signature(multi_tensor._multi_perturb_kernel, runs_ptr="*i64", pointers_ptr="*i64", ids_ptr="*i64",
                        backup_ptr=f"*{bits[dtype]}", tiles_per_run="i32", sigma="fp32", DTYPE="constexpr",
                        BITS="constexpr", BACKUP="constexpr", ALIGNED="constexpr", BLOCK="constexpr"),
             {**_triton_types(types), "BACKUP": True, "ALIGNED": True, "BLOCK": triton_rng.GPU_NOISE_BLOCK}),
            (f"multi_restore[{dtype}]", multi_tensor._multi_restore_kernel,
             _signature(multi_tensor._multi_restore_kernel, runs_ptr="*i64", pointers_ptr="*i64",
                        backup_ptr=f"*{bits[dtype]}", tiles_per_run="i32", BITS="constexpr", ALIGNED="constexpr",
                        BLOCK="constexpr"),
             {"BITS": _triton_types(types)["BITS"], "ALIGNED": True, "BLOCK": triton_rng.GPU_NOISE_BLOCK}),
            (f"multi_accumulate[{dtype}]", multi_tensor._multi_accumulate_kernel,
             _signature(multi_tensor._multi_accumulate_kernel, runs_ptr="*i64", pointers_ptr="*i64", ids_ptr="*i64",
                        first_member_ptr="*i64", end_member_ptr="*i64", streams_ptr="*i64", coeffs_ptr="*fp32",
                        partials_ptr="*fp64", tiles_per_run="i32", DTYPE="constexpr", BITS="constexpr",
                        STOCHASTIC="constexpr", ALIGNED="constexpr", BLOCK="constexpr"),
             {**_triton_types(types), "STOCHASTIC": dtype != "fp32", "ALIGNED": True,
              "BLOCK": triton_rng.GPU_NOISE_BLOCK}),
        ]
    for dtype in ("bf16", "fp16"):
        cases.append(
            (f"store_stochastic[{dtype}]", _shared._store_stochastic_kernel,
             _signature(_shared._store_stochastic_kernel, dst_ptr=f"*{dtype}", values_ptr="*fp32", n="i32",
                        ALIGNED="constexpr", BLOCK="constexpr"), {"ALIGNED": True, "BLOCK": triton_rng.GPU_NOISE_BLOCK})
        )
    return cases


def elements_per_thread(name: str, constexprs: dict[str, object]) -> int:
    """Elements (noise kernels: 4 per Philox counter) one thread of a program owns."""
    if "BLOCK" not in constexprs:
        return 1
    block = int(constexprs["BLOCK"])
    counters_per_program = name.split("[")[0] in NOISE_KERNELS
    return max(1, (4 * block if counters_per_program else block) // THREADS)


def _cuobjdump(cubin: bytes, flag: str) -> str:
    with tempfile.NamedTemporaryFile(suffix=".cubin") as file:
        file.write(cubin)
        file.flush()
        return subprocess.run([str(BIN / "cuobjdump"), flag, file.name], capture_output=True, text=True,
                              check=True).stdout


def resource_usage(cubin: bytes) -> str:
    """Registers / stack / spills from cuobjdump (shipped with Triton's NVIDIA backend), or '' without it."""
    if not (BIN / "cuobjdump").exists():
        return ""
    return " ".join(re.findall(r"(?:REG|STACK|LOCAL):\d+", _cuobjdump(cubin, "--dump-resource-usage")))


def sass_counts(cubin: bytes, elements_per_thread: int) -> str:
    """Static SASS instructions (NOP padding and the final self-branch left out), and those of the outermost
    loop when there is one (the accumulate's per-member body), each also per element a thread owns."""
    if not (BIN / "cuobjdump").exists():
        return ""
    lines = [(int(address, 16), opcode, operands) for address, opcode, operands
             in _SASS_LINE.findall(_cuobjdump(cubin, "-sass"))]
    body = [(address, opcode, operands) for address, opcode, operands in lines if opcode != "NOP"]
    while body and body[-1][1] == "BRA":  # the trailing `BRA self` after EXIT
        body.pop()
    total = len(body)
    text = f"sass:{total} per-element:{total / elements_per_thread:.1f}"
    # 128-bit global accesses, and shared-memory traffic (a layout shuffle or a cross-warp reduction).
    text += f" ldg128+stg128:{sum(1 for _, opcode, _ in body if opcode in ('LDG.E.128', 'STG.E.128'))}"
    text += f" shared:{sum(1 for _, opcode, _ in body if opcode.startswith(('LDS', 'STS')))}"
    loops = []
    for address, opcode, operands in body:
        target = re.search(r"0x([0-9a-f]+)", operands)
        if opcode.startswith("BRA") and target and int(target.group(1), 16) < address:
            loops.append(sum(1 for a, *_ in body if int(target.group(1), 16) <= a <= address))
    if loops:
        loop = max(loops)  # the outermost: the per-member body of the accumulate kernels
        text += f" loop:{loop} loop-per-element:{loop / elements_per_thread:.1f}"
    return text


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", type=int, default=90, help="compute capability, e.g. 80 (A100) or 90 (H100/H200)")
    args = parser.parse_args()
    if os.environ.get("TRITON_INTERPRET") == "1":
        raise SystemExit("unset TRITON_INTERPRET: the interpreter replaces the compiler this script exercises")
    os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # as the dispatcher pins it
    target = GPUTarget("cuda", args.arch, 32)
    for name, kernel, signature, constexprs in kernel_cases():
        # Constexprs keyed by (argument index,): the form every Triton 3.x accepts.
        by_index = {(kernel.arg_names.index(arg),): value for arg, value in constexprs.items()}
        attrs = aligned_pointers(kernel, signature)
        source = ASTSource(fn=kernel, signature=signature, constexprs=by_index, attrs=attrs)
        compiled = triton.compile(source, target=target)
        if "cubin" in compiled.asm:
            cubin = compiled.asm["cubin"]
            usage = f"{resource_usage(cubin)} {sass_counts(cubin, elements_per_thread(name, constexprs))}"
        else:
            usage = "ptx only"
        print(f"{name:28s} sm_{args.arch}  {usage}")


if __name__ == "__main__":
    main()

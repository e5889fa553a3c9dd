"""The compiled CPU backend (copes_kernels/backends/cpu/) against the reference oracle, op by op, on the kernel suite's
shapes: odd sizes, offsets past 2^32, every storage dtype, NaN-poisoned outputs. Philox words, packed backups,
restores and stochastic rounding must be bit-identical to the reference; normals (and what is built from them)
agree within the contract's ~1e-6. Every op gives the same bits on 1 and on 2 threads.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable, Iterator

import numpy as np
import pytest
import torch

import copes_kernels as ck
from copes_kernels.backends import reference
from copes_kernels.rng import MASK32, ROUNDING_STREAM
from kernels_tests.helpers import BIG_OFFSET, DTYPES, ODD_SIZES, assert_close_in_ulps, bits, poisoned

# The compiled CPU backend is numba: installed with copes, absent on a bare GPU image (bench/gpu_check.sh).
numba = pytest.importorskip("numba")
from copes_kernels.backends import cpu  # noqa: E402
from copes_kernels.backends.cpu import numerics  # noqa: E402

IDS = dict(seed=(1 << 63) + 17, member=MASK32 - 2, tensor_id=0xDEADBEEF)
SIGMA = 0.5
NUM_SUBSPACES = 3
# Compiled float32 log / sin / cos vs numpy's: a few float32 ulps of the largest normals (|eps| < 6).
NORMAL_ATOL = 2e-6
OFFSETS = (0, 3, BIG_OFFSET)
# Small sizes at offsets past 2^32 with 1000-element chunks (runs start inside Philox blocks); 2^20 + 3 with the
# default 64K chunks from an unaligned offset.
CASES = [(n, BIG_OFFSET, 1000) for n in ODD_SIZES[:3]] + [(ODD_SIZES[3], 3, ck.DEFAULT_CHUNK_SIZE)]


def random_values(numel: int, dtype: torch.dtype, seed: int = 1) -> torch.Tensor:
    return torch.randn(numel, generator=torch.Generator().manual_seed(seed)).to(dtype)


def random_partition(numel: int, offset: int, chunk_size: int, seed: int = 0) -> torch.Tensor:
    chunks = ck.num_chunks(offset + numel, chunk_size)
    return torch.randint(0, NUM_SUBSPACES, (chunks,), generator=torch.Generator().manual_seed(seed)).to(torch.int16)


@pytest.fixture
def threads() -> Iterator[Callable[[int], None]]:
    """Sets torch's (and so the compiled loops') thread count; puts the original back afterwards."""
    original = torch.get_num_threads()

    def use(count: int) -> None:
        if count > numba.config.NUMBA_NUM_THREADS:
            pytest.skip(f"numba's pool has {numba.config.NUMBA_NUM_THREADS} thread(s) on this machine")
        torch.set_num_threads(count)
        assert cpu.use_torch_threads() == count

    yield use
    torch.set_num_threads(original)


def test_philox_words_are_bit_identical_to_the_contract() -> None:
    generator = torch.Generator().manual_seed(0)
    counters = torch.randint(0, 1 << 32, (3, 1000, 4), generator=generator, dtype=torch.int64)
    counters[0, :, 1] = torch.arange(1000) + 1  # q past 2^32: the counter's high word in use
    counters[1, :4] = torch.tensor([[0] * 4, [MASK32] * 4, [MASK32, 0, MASK32, 0], [0, MASK32, 0, MASK32]])
    keys = torch.randint(0, 1 << 32, (1000, 2), generator=generator, dtype=torch.int64)  # broadcast over dim 0
    keys[:2] = torch.tensor([[0, 0], [MASK32, MASK32]])
    words = cpu.philox4x32_10(counters, keys)
    assert words.shape == (3, 1000, 4) and words.dtype == torch.int64
    assert torch.equal(words, reference.philox4x32_10(counters, keys))


@pytest.mark.parametrize("offset", OFFSETS)
@pytest.mark.parametrize("n", ODD_SIZES)
def test_normals_agree_with_the_reference(n: int, offset: int) -> None:
    compiled = cpu.normal(n, offset=offset, **IDS)
    expected = reference.normal(n, offset=offset, **IDS)
    assert compiled.dtype == torch.float32 and compiled.shape == (n,)
    torch.testing.assert_close(compiled, expected, rtol=0, atol=NORMAL_ATOL)


def test_the_uniform_extremes_give_finite_radii() -> None:
    """Word 0 gives u = 2^-25 (the largest radius), word 2^32 - 1 rounds u to exactly 1.0 (radius 0, not NaN)."""
    assert numerics._uniform(np.uint64(0)) == np.float32(2.0**-25)
    assert numerics._uniform(np.uint64(MASK32)) == np.float32(1.0)
    assert numerics._log(np.float32(1.0)) == 0.0
    assert np.sqrt(-2.0 * numerics._log(np.float32(2.0**-25))) == pytest.approx(np.sqrt(50 * np.log(2)), rel=1e-6)


def test_compiled_transcendentals_are_within_two_float32_ulps() -> None:
    """The polynomial log, sin and cos on the uniforms' whole range, against float64 numpy."""
    u = np.concatenate([np.linspace(2.0**-25, 1.0, 200_003), np.geomspace(2.0**-25, 0.01, 20_000)]).astype(np.float32)
    log = np.array([numerics._log(value) for value in u[::50]], np.float64)
    exact = np.log(u[::50].astype(np.float64))
    assert np.all(np.abs(log - exact) <= 2 * np.spacing(np.abs(exact).astype(np.float32)) + 1e-12)
    angle = (np.float32(2 * np.pi) * u[::50]).astype(np.float32)
    sin_cos = np.array([numerics._sin_cos(value) for value in angle], np.float64)
    for got, exact in ((sin_cos[:, 0], np.sin(angle.astype(np.float64))),
                       (sin_cos[:, 1], np.cos(angle.astype(np.float64)))):
        assert np.max(np.abs(got - exact)) <= 2 * 2.0**-24  # two ulps of values in [0.5, 1)


def on_suite_cases(test: Callable[..., None]) -> Callable[..., None]:
    """Every dtype x every (size, offset, chunk size) case x whole tensor / one subspace."""
    for name, values, ids in (("dtype", DTYPES, str), ("numel, offset, chunk_size", CASES, None),
                              ("partitioned", [False, True], ["whole", "subspace"])):
        test = pytest.mark.parametrize(name, values, ids=ids)(test)
    return test


@on_suite_cases
def test_perturb_matches_the_reference(
    dtype: torch.dtype, numel: int, offset: int, chunk_size: int, partitioned: bool
) -> None:
    src = random_values(numel, dtype)
    chunking = dict(offset=offset, chunk_size=chunk_size)
    if partitioned:
        chunking.update(chunk_subspace=random_partition(numel, offset, chunk_size), subspace=1)
    compiled, expected = poisoned(numel, dtype, "cpu"), poisoned(numel, dtype, "cpu")
    assert cpu.perturb_(compiled, src=src, sigma=SIGMA, **chunking, **IDS) is compiled
    reference.perturb_(expected, src=src, sigma=SIGMA, **chunking, **IDS)
    untouched = torch.isnan(expected)
    assert torch.equal(bits(compiled)[untouched], bits(expected)[untouched]), (
        "an element outside the subspace was written")
    # Each side rounds src + sigma * eps once; the eps differ by at most NORMAL_ATOL.
    assert_close_in_ulps(compiled[~untouched], expected[~untouched].double(), ulps=1, atol=SIGMA * NORMAL_ATOL)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("offset", [0, BIG_OFFSET])
def test_backup_and_restore_are_bit_exact(dtype: torch.dtype, offset: int) -> None:
    numel, chunk_size = 9001, 256
    original = random_values(numel, dtype)
    original[::97] = float("nan")
    signalling_nan = {torch.float32: 0x7F800001, torch.bfloat16: 0x7F81, torch.float16: 0x7C01}[dtype]
    bits(original)[1::101] = signalling_nan  # a float operation would quiet it; a copy must not
    original[2::89] = -0.0
    chunking = dict(offset=offset, chunk_subspace=random_partition(numel, offset, chunk_size), chunk_size=chunk_size)
    for subspace in range(NUM_SUBSPACES):
        packed = cpu.backup_chunks(original, subspace=subspace, **chunking)
        assert torch.equal(bits(packed), bits(reference.backup_chunks(original, subspace=subspace, **chunking)))
        x = original.clone()
        cpu.perturb_(x, sigma=SIGMA, subspace=subspace, **chunking, **IDS)
        assert not torch.equal(bits(x), bits(original))
        cpu.restore_chunks_(x, packed, subspace=subspace, **chunking)
        assert torch.equal(bits(x), bits(original))


MEMBERS = [0, 3, 5, 8, MASK32]
COEFFS = [0.25, -1.0, 0.5, 2.0, -0.125]
MEMBER_SUBSPACES = [0, 2, 0, 1, 2]


@on_suite_cases
def test_accumulate_matches_the_reference(
    dtype: torch.dtype, numel: int, offset: int, chunk_size: int, partitioned: bool
) -> None:
    start = random_values(numel, dtype)
    args = dict(seed=IDS["seed"], members=MEMBERS, coeffs=COEFFS, tensor_id=IDS["tensor_id"], offset=offset,
                chunk_size=chunk_size)
    if partitioned:
        # Subspace 3 owns no member: its chunks must come back with the same (NaN) bits.
        chunk_subspace = torch.randint(0, 4, (ck.num_chunks(offset + numel, chunk_size),),
                                       generator=torch.Generator().manual_seed(4)).to(torch.int16)
        args.update(chunk_subspace=chunk_subspace, member_subspaces=MEMBER_SUBSPACES)
        memberless = chunk_subspace[(torch.arange(numel) + offset) // chunk_size] == 3
        start[memberless] = float("nan")
    compiled, expected = start.clone(), start.clone()
    cpu.accumulate_(compiled, **args)
    reference.accumulate_(expected, **args)
    untouched = torch.isnan(expected)
    assert torch.equal(bits(compiled)[untouched], bits(expected)[untouched])
    atol = sum(abs(c) for c in COEFFS) * NORMAL_ATOL
    assert_close_in_ulps(compiled[~untouched], expected[~untouched].double(), ulps=1, atol=atol)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("offset", OFFSETS)
def test_stochastic_rounding_is_bit_identical_to_the_reference(dtype: torch.dtype, offset: int) -> None:
    """Same float32 values, the same ROUNDING_STREAM uniforms: identical bits, zeros, tiny and huge values included."""
    values = torch.randn(5003, generator=torch.Generator().manual_seed(3)) * 3
    values[:6] = torch.tensor([0.0, -0.0, 1e-9, -1e-9, 1.0, -2.5])
    values[6] = torch.finfo(dtype).max * 0.9999
    values[7] = float("nan")
    compiled = poisoned(values.numel(), dtype, "cpu")
    cpu.store_stochastic_(compiled, values, seed=IDS["seed"], tensor_id=IDS["tensor_id"], offset=offset)
    uniforms = reference.uniform_stream(
        values.numel(), seed=IDS["seed"], stream=ROUNDING_STREAM, tensor_id=IDS["tensor_id"], offset=offset,
        device="cpu",
    )
    expected = reference.round_stochastic(values, dtype, uniforms)
    # A NaN stays a NaN; its bfloat16 bits are not comparable (torch's vector path stores 0xFFFF, its scalar 0x7FC0).
    assert torch.isnan(compiled[7]) and torch.isnan(expected[7])
    numbers = ~torch.isnan(values)
    assert torch.equal(bits(compiled)[numbers], bits(expected)[numbers])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_stochastic_accumulate_with_zero_noise_rounds_like_the_reference(dtype: torch.dtype) -> None:
    """Coefficients 0: both backends round the same float32 sum (the target itself) with the same uniforms."""
    target = (random_values(4097, torch.float32) * 3).to(dtype)
    compiled, expected = target.clone(), target.clone()
    args = dict(seed=9, members=[1, 2], coeffs=[0.0, 0.0], tensor_id=4, offset=BIG_OFFSET, rounding="stochastic")
    cpu.accumulate_(compiled, **args)
    reference.accumulate_(expected, **args)
    assert torch.equal(bits(compiled), bits(expected))


@pytest.mark.parametrize("single", [True, False], ids=["one member", "population"])
def test_lowrank_factors_match_the_reference(single: bool) -> None:
    shape = dict(seed=IDS["seed"], tensor_id=IDS["tensor_id"], out_features=37, in_features=1029, rank=3)
    member = 7 if single else [0, 7, MASK32]
    for compiled, expected in zip(cpu.lowrank_factors(member=member, **shape),
                                  reference.lowrank_factors(member=member, **shape)):
        assert compiled.shape == expected.shape
        torch.testing.assert_close(compiled, expected, rtol=0, atol=NORMAL_ATOL)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("x_shape", [(6, 29), (6, 5, 29)], ids=["2-D", "3-D"])
def test_lowrank_linear_matches_the_reference(dtype: torch.dtype, x_shape: tuple[int, ...]) -> None:
    A, B = reference.lowrank_factors(seed=3, member=[0, 1, 2], tensor_id=4, out_features=33, in_features=29, rank=2)
    x = random_values(int(torch.tensor(x_shape).prod()), dtype).view(x_shape)
    weight, bias = random_values(33 * 29, dtype, seed=2).view(33, 29), random_values(33, dtype, seed=3)
    args = dict(A=A, B=B, row_member=torch.tensor([0, 1, 2, 2, 1, 0]), sigma=0.3)
    compiled = cpu.lowrank_linear(x, weight, bias, **args)
    expected = reference.lowrank_linear(x, weight, bias, **args)
    assert compiled.dtype == dtype and compiled.shape == expected.shape
    # Same base GEMM; the float32 correction is summed in another order: one storage rounding apart at most.
    assert_close_in_ulps(compiled, expected.double(), ulps=1, atol=1e-5)


def test_lowrank_accumulate_stochastic_is_bit_identical_to_the_reference() -> None:
    A, B = reference.lowrank_factors(seed=3, member=[0, 1, 2], tensor_id=4, out_features=33, in_features=29, rank=2)
    start = random_values(33 * 29, torch.bfloat16).view(33, 29)
    compiled, expected = start.clone(), start.clone()
    args = dict(A=A, B=B, coeffs=[1.0, -1.0, 0.5], scale=1e-3, rounding="stochastic", seed=5, tensor_id=4)
    cpu.lowrank_accumulate_(compiled, **args)
    reference.lowrank_accumulate_(expected, **args)
    assert torch.equal(bits(compiled), bits(expected)) and not torch.equal(compiled, start)


def every_op_once() -> dict[str, torch.Tensor]:
    """Each compiled op on inputs big enough for many tiles per thread; outputs keyed by op."""
    numel, offset, chunk_size = (1 << 20) + 3, BIG_OFFSET, 4099
    chunking = dict(offset=offset, chunk_subspace=random_partition(numel, offset, chunk_size), chunk_size=chunk_size)
    src = random_values(numel, torch.bfloat16)
    perturbed = cpu.perturb_(poisoned(numel, torch.bfloat16, "cpu"), src=src, sigma=SIGMA, subspace=2, **chunking,
                             **IDS)
    accumulated = cpu.accumulate_(
        src.clone(), seed=IDS["seed"], members=MEMBERS, coeffs=COEFFS, tensor_id=1,
        member_subspaces=MEMBER_SUBSPACES, rounding="stochastic", **chunking,
    )
    A, B = cpu.lowrank_factors(seed=1, member=list(range(8)), tensor_id=2, out_features=96, in_features=80, rank=2)
    x = random_values(8 * 40 * 80, torch.float32).view(8, 40, 80)
    linear = cpu.lowrank_linear(x, random_values(96 * 80, torch.float32).view(96, 80), None, A=A, B=B,
                                row_member=torch.arange(8), sigma=0.1)
    counters = torch.randint(0, 1 << 32, (50_000, 4), generator=torch.Generator().manual_seed(1))
    return {
        "normal": cpu.normal(numel, offset=offset, **IDS),
        "perturb_": perturbed,
        "backup_chunks": cpu.backup_chunks(src, subspace=1, **chunking),
        "accumulate_": accumulated,
        "lowrank_factors": torch.cat([A.view(-1), B.view(-1)]),
        "lowrank_linear": linear,
        "philox4x32_10": cpu.philox4x32_10(counters, torch.tensor([3, 4])),
    }


def test_results_are_bitwise_identical_on_one_and_two_threads(threads: Callable[[int], None]) -> None:
    threads(1)
    one = every_op_once()
    threads(2)
    two = every_op_once()
    for op, result in one.items():
        assert torch.equal(bits(result) if result.is_floating_point() else result,
                           bits(two[op]) if result.is_floating_point() else two[op]), op


def test_dispatch_routes_cpu_tensors_to_the_compiled_backend(monkeypatch: pytest.MonkeyPatch) -> None:
    """Default on CPU: the compiled backend; COPES_BACKEND forces either one (their normals differ in low bits)."""
    n, ids = 4097, dict(seed=11, member=2, tensor_id=3)
    compiled, oracle = cpu.normal(n, **ids), reference.normal(n, **ids)
    assert not torch.equal(compiled, oracle)  # so the checks below can tell the two apart
    monkeypatch.delenv("COPES_BACKEND", raising=False)
    assert torch.equal(ck.normal(n, **ids), compiled)
    monkeypatch.setenv("COPES_BACKEND", "reference")
    assert torch.equal(ck.normal(n, **ids), oracle)
    monkeypatch.setenv("COPES_BACKEND", "cpu")
    assert torch.equal(ck.normal(n, **ids), compiled)
    with pytest.raises(ValueError, match="COPES_BACKEND=cpu runs on CPU tensors only"):
        ck.normal(n, device="meta", **ids)


def test_a_new_process_loads_the_compiled_kernels_from_disk_and_keeps_torch_threads() -> None:
    """numba's on-disk cache: after this process compiled `normal`, a fresh one loads it without compiling; and
    starting numba's OpenMP pool does not change torch's thread count (`--cpu-threads 1` must hold)."""
    cpu.normal(10, seed=1, member=2, tensor_id=3)
    script = (
        "import json, torch\n"
        "torch.set_num_threads(1)\n"
        "from copes_kernels.backends.cpu import kernels, ops\n"
        "ops.normal(10, seed=1, member=2, tensor_id=3)\n"
        "stats = kernels.normal_rows_kernel.stats\n"
        "print(json.dumps({'hits': sum(stats.cache_hits.values()), 'misses': sum(stats.cache_misses.values()),"
        " 'torch_threads': torch.get_num_threads()}))\n"
    )
    env = {**os.environ, "OMP_NUM_THREADS": "2"}
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=300)
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report == {"hits": 1, "misses": 0, "torch_threads": 1}

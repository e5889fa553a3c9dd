"""The compiled CPU backend's multi-tensor path (one numba call per member's perturb, its restore and each dtype
group's update) on the embedded tiny model (loaded with `from_pretrained`): the same weights bit for bit as the
per-tensor path, for 1 and 2 threads; restores exact; within the noise contract's tolerance of the reference."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator

import pytest
import torch
from transformers import AutoModelForCausalLM

import copes_kernels as ck
from copes.es.params import ParameterSpace
from copes.modeling import EMBEDDED_MODEL_DIR

numba = pytest.importorskip("numba")
from copes_kernels.backends import cpu  # noqa: E402

SEED = (1 << 40) + 123
SUBSPACES = 4
# 999-element chunks: rows start inside Philox blocks and off the tile grid; the model's 46 tensors span 1 to 133
# chunks, so some tensors have no chunk in a subspace.
CHUNK = 999
SIGMA = 0.01
MEMBERS = (0, 5, 2, 7, 3)
COEFFS = (0.5, -1.25, 0.75, 2.0, -0.3)
DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _bits(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.view(torch.int32 if tensor.dtype == torch.float32 else torch.int16)


def _state(space: ParameterSpace) -> list[torch.Tensor]:
    return [p.data.clone() for p in space.parameters]


def _run(dtype: torch.dtype, *, multi_tensor: bool, restore: str = "device") -> tuple[list[list[torch.Tensor]], float]:
    """Each member perturbed (weights recorded) and restored (checked exact), then one update: (states, norm)."""
    model = AutoModelForCausalLM.from_pretrained(EMBEDDED_MODEL_DIR, dtype=dtype)
    if restore == "subtract":
        with pytest.warns(UserWarning, match="inexact"):
            space = ParameterSpace(model, chunk_size=CHUNK, restore=restore, multi_tensor=multi_tensor)
    else:
        space = ParameterSpace(model, chunk_size=CHUNK, restore=restore, multi_tensor=multi_tensor)
    assert space._fused() == multi_tensor and len(space.parameters) == 46
    partition = space.partition(SEED, SUBSPACES)
    original = _state(space)
    states = []
    for member in MEMBERS:
        space.perturb(partition, seed=SEED, member=member, subspace=member % SUBSPACES, sigma=SIGMA)
        states.append(_state(space))
        space.restore()
        if restore == "device":
            for restored, before in zip(_state(space), original):
                assert torch.equal(_bits(restored), _bits(before))
    norm = space.apply_update(
        partition, seed=SEED, members=list(MEMBERS), coeffs=list(COEFFS),
        member_subspaces=[m % SUBSPACES for m in MEMBERS],
    )
    states.append(_state(space))
    return states, norm


def _assert_bitwise(left: list[list[torch.Tensor]], right: list[list[torch.Tensor]]) -> None:
    for left_state, right_state in zip(left, right, strict=True):
        for a, b in zip(left_state, right_state, strict=True):
            assert torch.equal(_bits(a), _bits(b))


@pytest.fixture
def threads() -> Iterator[None]:
    original = torch.get_num_threads()
    yield
    torch.set_num_threads(original)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_multi_tensor_weights_match_the_per_tensor_path_bit_for_bit(
    dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch, threads: None
) -> None:
    monkeypatch.setenv("COPES_BACKEND", "cpu")
    torch.set_num_threads(1)
    per_tensor, per_tensor_norm = _run(dtype, multi_tensor=False)
    fused, fused_norm = _run(dtype, multi_tensor=True)
    _assert_bitwise(fused, per_tensor)
    assert fused_norm == pytest.approx(per_tensor_norm, rel=1e-9) and fused_norm > 0
    if numba.config.NUMBA_NUM_THREADS >= 2:
        torch.set_num_threads(2)
        assert cpu.use_torch_threads() == 2
        two_threads, two_threads_norm = _run(dtype, multi_tensor=True)
        _assert_bitwise(two_threads, fused)
        assert two_threads_norm == fused_norm  # partial sums are added in tile order, whatever the thread count


def test_subtract_restore_matches_the_per_tensor_path_bit_for_bit(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("COPES_BACKEND", "cpu")
    _assert_bitwise(_run(torch.bfloat16, multi_tensor=True, restore="subtract")[0],
                    _run(torch.bfloat16, multi_tensor=False, restore="subtract")[0])


def test_multi_tensor_path_agrees_with_the_reference(monkeypatch: pytest.MonkeyPatch) -> None:
    """The reference (COPES_BACKEND=reference: numpy transcendentals) gives normals within 2e-6, so float32
    weights agree to 2e-6 times the largest noise scale (the update's sum of |coeffs|) plus a rounding."""
    monkeypatch.setenv("COPES_BACKEND", "reference")
    reference, reference_norm = _run(torch.float32, multi_tensor=False)
    monkeypatch.setenv("COPES_BACKEND", "cpu")
    compiled, compiled_norm = _run(torch.float32, multi_tensor=True)
    for compiled_state, reference_state in zip(compiled, reference, strict=True):
        for a, b in zip(compiled_state, reference_state, strict=True):
            torch.testing.assert_close(a, b, rtol=1.2e-7, atol=2e-6 * sum(map(abs, COEFFS)))
    assert compiled_norm == pytest.approx(reference_norm, rel=1e-4)


def test_a_table_that_does_not_match_its_tensors_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("COPES_BACKEND", "cpu")
    tensors = [torch.zeros(10), torch.zeros(3)]
    host = [torch.zeros(1, dtype=torch.int16), torch.zeros(1, dtype=torch.int16)]
    table = ck.build_run_table(tensors, tensor_ids=[1, 2], chunk_subspaces=host, host_chunk_subspaces=host,
                               subspace=0, num_subspaces=1, chunk_size=16)
    runs = table.runs.clone()
    runs[1, 2] = 4  # the 3-element tensor's row now stops at element 4
    with pytest.raises(ValueError, match="rows outside its tensors"):
        ck.multi_perturb_(dataclasses.replace(table, runs=runs), seed=1, member=0, sigma=0.1)
    pointers = table.pointers.clone()
    pointers[0] += 4
    with pytest.raises(ValueError, match="data pointers are not its tensors'"):
        ck.multi_restore_(dataclasses.replace(table, pointers=pointers), torch.zeros(13))

"""What an ES trainer embedding the kernels relies on, on every backend: per-member seeds in one pass, full-tensor
backups without a partition, defaults for K=1 run tables, any iterable of members, errors that name the fix, and
version counters bumped by every in-place op."""

from __future__ import annotations

import contextlib

import pytest
import torch

import copes_kernels as ck
from copes_kernels import dispatch
from kernels_tests.helpers import DTYPES, assert_close_in_ulps, bits

SEEDS = [7, (1 << 63) + 5, (1 << 64) - 1]
MEMBERS = [0, 5, 2]
COEFFS = [0.5, -1.25, 0.75]
TENSOR_ID = 11
N = 4097


def start(dtype: torch.dtype, device: torch.device, n: int = N) -> torch.Tensor:
    return (torch.arange(n, dtype=torch.float32) / n).to(device=device, dtype=dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_per_member_seeds_update_in_one_pass_as_the_members_one_by_one(
    backend: str, device: torch.device, dtype: torch.dtype
) -> None:
    """seeds=[...] gives member j the stream of (seeds[j], members[j]): the sum of those normals (materialised on
    the same backend), stored once -- within one rounding to storage (float32 sums may fuse multiply-adds)."""
    target = start(dtype, device)
    ck.accumulate_(target, seeds=SEEDS, members=MEMBERS, coeffs=COEFFS, tensor_id=TENSOR_ID)
    total = start(dtype, device).double()
    for seed, member, coeff in zip(SEEDS, MEMBERS, COEFFS):
        total += coeff * ck.normal(N, seed=seed, member=member, tensor_id=TENSOR_ID, device=device).double()
    assert_close_in_ulps(target, total, ulps=1, atol=1e-6)


def test_one_seed_for_all_is_seeds_of_that_seed(backend: str, device: torch.device) -> None:
    one, many = start(torch.bfloat16, device), start(torch.bfloat16, device)
    ck.accumulate_(one, seed=SEEDS[1], members=MEMBERS, coeffs=COEFFS, tensor_id=TENSOR_ID, rounding="stochastic")
    ck.accumulate_(many, seeds=[SEEDS[1]] * 3, members=MEMBERS, coeffs=COEFFS, tensor_id=TENSOR_ID,
                   rounding="stochastic")
    assert torch.equal(bits(one), bits(many))


@pytest.mark.parametrize("dtype", DTYPES)
def test_multi_accumulate_takes_per_member_seeds_and_defaults_member_subspaces_at_k1(
    backend: str, device: torch.device, dtype: torch.dtype
) -> None:
    tensors = [start(dtype, device, n) for n in (N, 12_289, 3)]  # 1 and 3 chunks and one element, part of one
    table = ck.build_run_table(tensors, tensor_ids=[1, 2, 3], chunk_size=1 << 12)
    ck.multi_accumulate_(table, seeds=SEEDS, members=iter(MEMBERS), coeffs=COEFFS)
    for tensor, tensor_id in zip(tensors, (1, 2, 3)):
        expected = start(dtype, device, tensor.numel())
        ck.accumulate_(expected, seeds=SEEDS, members=MEMBERS, coeffs=COEFFS, tensor_id=tensor_id, chunk_size=1 << 12)
        assert torch.equal(bits(tensor), bits(expected))


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_full_tensor_backup_needs_no_partition(backend: str, device: torch.device, dtype: torch.dtype) -> None:
    weights = start(dtype, device)
    original = weights.clone()
    backup = ck.backup_chunks(weights)
    assert torch.equal(bits(backup), bits(original))
    ck.perturb_(weights, seed=SEEDS[2], member=1, tensor_id=TENSOR_ID, sigma=0.1)
    ck.restore_chunks_(weights, backup)
    assert torch.equal(bits(weights), bits(original))


def test_a_k1_run_table_needs_no_partition_and_serves_backup_perturb_restore_and_update(
    backend: str, device: torch.device
) -> None:
    tensors = [start(torch.bfloat16, device, n) for n in (N, 5)]
    originals = [t.clone() for t in tensors]
    table = ck.build_run_table(tensors, tensor_ids=[1, 2])
    assert (table.subspace, table.num_subspaces, table.backup_numel) == (0, 1, N + 5)
    backup = torch.empty(table.backup_numel, dtype=torch.bfloat16, device=device)
    ck.multi_perturb_(table, seed=3, member=4, sigma=0.5, backup=backup)
    assert not torch.equal(bits(tensors[0]), bits(originals[0]))
    ck.multi_restore_(table, backup)
    assert all(torch.equal(bits(t), bits(o)) for t, o in zip(tensors, originals))


def test_host_tables_default_to_the_partition_itself(backend: str, device: torch.device) -> None:
    tensors = [start(torch.float32, device, n) for n in (N, 9000)]
    partition = ck.make_partition([ck.num_chunks(t.numel(), 1024) for t in tensors], num_subspaces=3, seed=5,
                                  device=device)
    table = ck.build_run_table(tensors, tensor_ids=[1, 2], chunk_subspaces=partition, subspace=2, chunk_size=1024)
    explicit = ck.build_run_table(tensors, tensor_ids=[1, 2], chunk_subspaces=partition,
                                  host_chunk_subspaces=[p.cpu() for p in partition], subspace=2, num_subspaces=3,
                                  chunk_size=1024)
    assert table.num_subspaces == 3
    assert torch.equal(table.runs.cpu(), explicit.runs.cpu()) and table.backup_numel == explicit.backup_numel


def test_k_above_1_still_needs_member_subspaces(backend: str, device: torch.device) -> None:
    tensors = [start(torch.float32, device)]
    partition = ck.make_partition([5], num_subspaces=2, seed=5, device=device)
    table = ck.build_run_table(tensors, tensor_ids=[1], chunk_subspaces=partition, chunk_size=1024)
    with pytest.raises(ValueError, match="pass member_subspaces="):
        ck.multi_accumulate_(table, seed=1, members=[0], coeffs=[1.0])


def test_generators_are_members_coeffs_and_seeds(backend: str, device: torch.device) -> None:
    from_lists, from_generators = start(torch.float32, device), start(torch.float32, device)
    ck.accumulate_(from_lists, seeds=SEEDS, members=MEMBERS, coeffs=COEFFS, tensor_id=1)
    ck.accumulate_(from_generators, seeds=(s for s in SEEDS), members=iter(MEMBERS),
                   coeffs=(c for c in COEFFS), tensor_id=1)
    assert torch.equal(from_lists, from_generators)


@pytest.mark.parametrize("call", ["perturb_", "accumulate_", "restore_chunks_", "multi_perturb_"])
def test_a_parameter_under_grad_mode_is_refused_with_the_fix(backend: str, device: torch.device, call: str) -> None:
    parameter = torch.nn.Parameter(start(torch.float32, device))
    with pytest.raises(ValueError, match=r"pass p\.data or use torch\.no_grad\(\)$"):
        if call == "perturb_":
            ck.perturb_(parameter, seed=1, member=0, tensor_id=1, sigma=0.1)
        elif call == "accumulate_":
            ck.accumulate_(parameter, seed=1, members=[0], coeffs=[1.0], tensor_id=1)
        elif call == "restore_chunks_":
            ck.restore_chunks_(parameter, parameter.detach().clone())
        else:
            table = ck.build_run_table([parameter], tensor_ids=[1])
            ck.multi_perturb_(table, seed=1, member=0, sigma=0.1)


def test_under_no_grad_a_parameter_is_written(backend: str, device: torch.device) -> None:
    parameter = torch.nn.Parameter(start(torch.float32, device))
    expected = start(torch.float32, device)
    ck.perturb_(expected, seed=1, member=0, tensor_id=1, sigma=0.1)
    with torch.no_grad():
        ck.perturb_(parameter, seed=1, member=0, tensor_id=1, sigma=0.1)
    assert torch.equal(parameter.detach(), expected)


def test_a_missing_partition_names_the_fix(backend: str, device: torch.device) -> None:
    with pytest.raises(ValueError, match="pass chunk_subspace= .*or neither for the whole tensor"):
        ck.perturb_(start(torch.float32, device), seed=1, member=0, tensor_id=1, sigma=0.1, subspace=1)
    with pytest.raises(ValueError, match="pass seed= .* or seeds= "):
        ck.accumulate_(start(torch.float32, device), members=[0], coeffs=[1.0], tensor_id=1)
    with pytest.raises(ValueError, match="pass one seed per member"):
        ck.accumulate_(start(torch.float32, device), seeds=[1, 2], members=[0], coeffs=[1.0], tensor_id=1)


def test_every_in_place_op_bumps_the_version_counter(backend: str, device: torch.device) -> None:
    weights = start(torch.bfloat16, device)
    A, B = ck.lowrank_factors(seed=1, member=[0, 1], tensor_id=1, out_features=17, in_features=241, rank=2,
                              device=device)
    matrix = weights[: 17 * 241].view(17, 241)
    table = ck.build_run_table([weights], tensor_ids=[1])
    backup = torch.empty(table.backup_numel, dtype=weights.dtype, device=device)
    calls = [
        lambda: ck.perturb_(weights, seed=1, member=0, tensor_id=1, sigma=0.1),
        lambda: ck.restore_chunks_(weights, ck.backup_chunks(weights)),
        lambda: ck.accumulate_(weights, seeds=[1], members=[0], coeffs=[0.1], tensor_id=1),
        lambda: ck.lowrank_accumulate_(matrix, A=A, B=B, coeffs=[0.1, 0.2], scale=1.0),
        lambda: ck.multi_perturb_(table, seed=1, member=0, sigma=0.1, backup=backup),
        lambda: ck.multi_restore_(table, backup),
        lambda: ck.multi_accumulate_(table, seed=1, members=[0], coeffs=[0.1]),
    ]
    for index, call in enumerate(calls):
        version = weights._version
        call()
        assert weights._version > version, f"in-place op {index} left the version counter at {version}"


def test_the_public_ops_say_what_their_ids_mean() -> None:
    for op in (ck.normal, ck.perturb_, ck.accumulate_):
        assert "tensor_id" in op.__doc__ and "member" in op.__doc__ and "seed" in op.__doc__
    assert "docs/noise-contract.md" in ck.normal.__doc__


def test_the_op_table_is_one_list_every_backend_exports() -> None:
    from copes_kernels.backends import OP_NAMES, reference

    assert set(dispatch.PUBLIC_OPS) == set(OP_NAMES) and set(OP_NAMES) <= set(ck.__all__)
    assert all(callable(getattr(reference, name)) for name in OP_NAMES)
    cpu = pytest.importorskip("copes_kernels.backends.cpu")
    assert all(callable(getattr(cpu, name)) for name in OP_NAMES)


def test_triton_launches_run_on_the_tensors_device(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without a GPU here, torch.cuda.device is replaced by a recorder (the one patch) and the Triton op by a probe:
    the dispatcher must enter the data's device (cuda:1, not the current cuda:0) around the launch."""
    entered: list[torch.device] = []
    launched_inside: list[bool] = []

    @contextlib.contextmanager
    def recording_device(device: torch.device):
        entered.append(device)
        yield
        entered.append(None)

    class FakeTable:  # what the dispatcher reads of a run table: where its data lives
        runs = torch.empty(0)
        device = torch.device("cuda", 1)
        tensors = ()

    def probe(*args, **kwargs) -> None:
        launched_inside.append(bool(entered) and entered[-1] == torch.device("cuda", 1))

    monkeypatch.setattr(torch.cuda, "device", recording_device)
    monkeypatch.setattr(dispatch, "_backend_op", lambda backend, name: probe)
    monkeypatch.setattr(dispatch, "backend_for", lambda device: "triton")
    op = dispatch.dispatched("multi_restore_", dispatch._device_rule("multi_restore_"))
    op(FakeTable(), torch.empty(0))
    assert launched_inside == [True] and entered == [torch.device("cuda", 1), None]
    assert isinstance(dispatch.device_guard(torch.device("cpu")), contextlib.nullcontext)


def test_the_documented_known_answers_hold() -> None:
    """docs/noise-contract.md prints the reference stream of two calls: they must be what the reference gives."""
    from pathlib import Path

    from copes_kernels.backends import reference

    text = (Path(__file__).resolve().parents[1] / "docs" / "noise-contract.md").read_text()
    calls = {
        "ck.normal(8, seed=1, member=2, tensor_id=3)": dict(n=8, seed=1, member=2, tensor_id=3),
        "ck.normal(4, seed=(1 << 40) + 123, member=7, tensor_id=0xDEADBEEF, offset=(1 << 32) + 5)":
            dict(n=4, seed=(1 << 40) + 123, member=7, tensor_id=0xDEADBEEF, offset=(1 << 32) + 5),
    }
    for call, kwargs in calls.items():
        printed = text.split(call + "\n", 1)[1].splitlines()[0]
        documented = torch.tensor([float(value) for value in printed.split()])
        torch.testing.assert_close(reference.normal(**kwargs), documented, rtol=0, atol=1e-8)


def test_a_run_table_refuses_a_non_contiguous_tensor_with_one_line() -> None:
    with pytest.raises(ValueError, match="tensor 0 must be contiguous float32, bfloat16 or float16, got a "
                                         "non-contiguous torch.float32 tensor"):
        ck.build_run_table([torch.zeros(4, 6).t()], tensor_ids=[1])

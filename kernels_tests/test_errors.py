"""Bad arguments fail the same way on every backend, with a message naming the argument; backend selection."""

from __future__ import annotations

import pytest
import torch

import copes_kernels as ck

IDS = dict(seed=1, member=2, tensor_id=3)


def x32(device: torch.device, n: int = 64) -> torch.Tensor:
    return torch.zeros(n, device=device)


def partition(device: torch.device, chunks: int = 4) -> torch.Tensor:
    return torch.zeros(chunks, dtype=torch.int16, device=device)


PERTURB_CASES = {
    "non-contiguous": (lambda d: dict(dst=x32(d, 128)[::2]), "dst must be contiguous"),
    "integer storage": (lambda d: dict(dst=torch.zeros(8, dtype=torch.int32, device=d)), "dst must be float32"),
    "src size": (lambda d: dict(dst=x32(d), src=x32(d, 65)), "src has 65 elements"),
    "src device": (lambda d: dict(dst=x32(d), src=torch.zeros(64, device="meta")), "src is on meta"),
    "short partition": (
        lambda d: dict(dst=x32(d), chunk_subspace=partition(d, 3), subspace=0, chunk_size=16),
        "chunk_subspace has 3 entries",
    ),
    "partition dtype": (
        lambda d: dict(dst=x32(d), chunk_subspace=partition(d).long(), subspace=0, chunk_size=16),
        "chunk_subspace must be an int16",
    ),
    "subspace alone": (lambda d: dict(dst=x32(d), subspace=0), "subspace was given without chunk_subspace"),
    "partition alone": (lambda d: dict(dst=x32(d), chunk_subspace=partition(d), chunk_size=16), "without subspace"),
    "negative offset": (lambda d: dict(dst=x32(d), offset=-1), "offset must be >= 0"),
    "zero chunk": (lambda d: dict(dst=x32(d), chunk_size=0), "chunk_size must be > 0"),
    "nan sigma": (lambda d: dict(dst=x32(d), sigma=float("nan")), "sigma must be finite"),
    "negative seed": (lambda d: dict(dst=x32(d), seed=-1), "seed must be a uint64"),
    "seed past 2^64": (lambda d: dict(dst=x32(d), seed=1 << 64), "seed must be a uint64"),
    "member past 2^32": (lambda d: dict(dst=x32(d), member=1 << 32), "member must be a uint32"),
}


@pytest.mark.parametrize("case", PERTURB_CASES, ids=str)
def test_perturb_rejects(backend: str, device: torch.device, case: str) -> None:
    make, message = PERTURB_CASES[case]
    kwargs = {**IDS, "sigma": 0.1, **make(device)}
    dst = kwargs.pop("dst")
    with pytest.raises(ValueError, match=message):
        ck.perturb_(dst, **kwargs)


ACCUMULATE_CASES = {
    "nan coeff": (dict(coeffs=[0.1, float("nan")]), "coeffs must be finite"),
    "length mismatch": (dict(coeffs=[0.1]), "members has 2 entries but coeffs has 1"),
    "member range": (dict(members=[0, 1 << 32]), "members must be uint32"),
    "subspaces length": (dict(member_subspaces=[0]), "member_subspaces has 1 entries"),
    "subspaces alone": (dict(chunk_subspace=None), "member_subspaces was given without chunk_subspace"),
    "stochastic fp32": (
        dict(rounding="stochastic", member_subspaces=None, chunk_subspace=None), "stochastic rounding applies"
    ),
    "rounding mode": (dict(rounding="up"), "rounding must be one of"),
}


@pytest.mark.parametrize("case", ACCUMULATE_CASES, ids=str)
def test_accumulate_rejects(backend: str, device: torch.device, case: str) -> None:
    change, message = ACCUMULATE_CASES[case]
    kwargs = dict(
        seed=1, members=[0, 1], coeffs=[0.1, 0.2], tensor_id=3, chunk_subspace=partition(device),
        member_subspaces=[0, 0], chunk_size=16,
    )
    kwargs.update(change)
    with pytest.raises(ValueError, match=message):
        ck.accumulate_(x32(device), **kwargs)


def test_restore_rejects_a_mismatched_backup(backend: str, device: torch.device) -> None:
    chunking = dict(chunk_subspace=partition(device), subspace=0, chunk_size=16)
    x = x32(device)
    backup = ck.backup_chunks(x, **chunking)
    with pytest.raises(ValueError, match="backup has 63 elements but subspace 0 covers 64"):
        ck.restore_chunks_(x, backup[1:], **chunking)
    with pytest.raises(ValueError, match="backup is torch.float16 but dst is torch.float32"):
        ck.restore_chunks_(x, backup.half(), **chunking)


def test_lowrank_ops_reject(backend: str, device: torch.device) -> None:
    shape = dict(seed=0, member=[0, 1], tensor_id=0, out_features=3, in_features=5, device=device)
    for rank in (0, -2):
        with pytest.raises(ValueError, match=f"rank must be >= 1, got {rank}"):
            ck.lowrank_factors(rank=rank, **shape)
    with pytest.raises(ValueError, match="out_features and in_features must be >= 1"):
        ck.lowrank_factors(**{**shape, "out_features": 0}, rank=1)
    A, B = ck.lowrank_factors(rank=2, **shape)
    weight, x = torch.zeros(3, 5, device=device), torch.zeros(2, 5, device=device)
    rows = torch.tensor([0, 1], device=device)
    with pytest.raises(ValueError, match=r"x must be \[batch, ..., 5\]"):
        ck.lowrank_linear(torch.zeros(2, 4, device=device), weight, None, A=A, B=B, row_member=rows, sigma=0.1)
    with pytest.raises(ValueError, match="row_member values must index the population of 2"):
        ck.lowrank_linear(x, weight, None, A=A, B=B, row_member=torch.tensor([0, 2], device=device), sigma=0.1)
    with pytest.raises(ValueError, match="A must be float32"):
        ck.lowrank_linear(x, weight, None, A=A.half(), B=B, row_member=rows, sigma=0.1)
    with pytest.raises(ValueError, match="coeffs must be finite"):
        ck.lowrank_accumulate_(weight, A=A, B=B, coeffs=[float("inf"), 0.0], scale=0.1)


def test_stream_ops_reject(backend: str, device: torch.device) -> None:
    with pytest.raises(ValueError, match="n must be >= 0"):
        ck.normal(-1, seed=0, member=0, tensor_id=0, device=device)
    with pytest.raises(ValueError, match="tensor_id must be a uint32"):
        ck.normal(4, seed=0, member=0, tensor_id=-1, device=device)
    key = torch.zeros(1, 2, dtype=torch.int64, device=device)
    with pytest.raises(ValueError, match=r"counter must be \[..., 4\]"):
        ck.philox4x32_10(torch.zeros(1, 3, dtype=torch.int64, device=device), key)
    with pytest.raises(ValueError, match=r"must lie in \[0, 2\^32\)"):
        ck.philox4x32_10(torch.full((1, 4), 1 << 32, device=device), key)


def test_backend_selection(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("COPES_BACKEND", raising=False)
    assert ck.backend_for("cpu") == "cpu"  # the compiled CPU backend (numba is a dependency)
    assert ck.backend_for(torch.device("cuda")) == "triton"
    monkeypatch.setenv("COPES_BACKEND", "reference")
    assert ck.backend_for("cpu") == "reference"
    monkeypatch.setenv("COPES_BACKEND", "reference")
    assert ck.backend_for("cuda") == "reference"
    monkeypatch.setenv("COPES_BACKEND", "Triton ")
    assert ck.backend_for("cpu") == "triton"
    monkeypatch.setenv("COPES_BACKEND", "cuda")
    with pytest.raises(ValueError, match="COPES_BACKEND must be one of"):
        ck.backend_for("cpu")
    with pytest.raises(ValueError, match="COPES_BACKEND must be one of"):
        ck.normal(4, seed=0, member=0, tensor_id=0)


# The ops whose signature, docstring and checks come from one template in copes_kernels._public_ops.
TEMPLATED_OPS = ("perturb_", "accumulate_", "backup_chunks", "restore_chunks_", "lowrank_factors", "lowrank_linear",
                 "lowrank_accumulate_", "multi_accumulate_")


@pytest.mark.parametrize("backend", ["cpu", "triton"])
def test_every_backend_op_has_the_reference_signature_and_docstring(backend: str) -> None:
    """Every backend's ops take the reference's keywords and defaults, and the templated ones carry its docstring:
    a backend that drifted (a renamed keyword, another default) would take the same call differently."""
    import importlib
    import inspect

    from copes_kernels.backends import OP_NAMES, reference

    package = importlib.import_module(f"copes_kernels.backends.{backend}")
    for name in OP_NAMES:
        ours, theirs = getattr(package, name), getattr(reference, name)
        assert inspect.signature(ours) == inspect.signature(theirs), name
    for name in TEMPLATED_OPS:
        summary = inspect.cleandoc(getattr(reference, name).__doc__).splitlines()[0]
        assert inspect.cleandoc(getattr(package, name).__doc__).splitlines()[0] == summary, name

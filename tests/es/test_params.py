"""ParameterSpace: selection, noise ids, chunking, perturb / restore per mode, update precision, streaming."""

from __future__ import annotations

import zlib

import pytest
import torch
from torch import nn

from copes.es.params import ParameterSpace
from copes.es.selection import tensor_id_for

from helpers.es_helpers import DTYPES, dense_member_noise, flat_weights, toy_mlp

SEED = 0x1234_5678_9ABC_DEF0


class TiedToy(nn.Module):
    """Embedding and output head sharing one weight, like an LM with tie_word_embeddings."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(50, 8)
        self.norm = nn.LayerNorm(8)
        self.head = nn.Linear(8, 50, bias=False)
        self.head.weight = self.embed.weight


# Two valid parameter names with the same CRC-32, found once by a birthday search over "w<i>".
CRC32_TWINS = ("w29685295", "w32060020")


# ---------------------------------------------------------------- selection and ids



def test_exact_names_select_those_parameters_in_model_order():
    model = toy_mlp()
    assert ParameterSpace(model, names=["2.weight", "0.bias"]).names == ["0.bias", "2.weight"]
    with pytest.raises(ValueError, match="the model has no parameter named 'missing'"):
        ParameterSpace(model, names=["0.bias", "missing"])

def test_include_exclude_use_fnmatch_on_parameter_names():
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4), nn.LayerNorm(4))
    assert ParameterSpace(model).names == ["0.weight", "0.bias", "1.weight", "1.bias", "2.weight", "2.bias"]
    assert ParameterSpace(model, include="*.weight", exclude=["2.*"]).names == ["0.weight", "1.weight"]
    assert ParameterSpace(model, include=["1.*", "2.bias"]).names == ["1.weight", "1.bias", "2.bias"]
    with pytest.raises(ValueError, match="select no parameter"):
        ParameterSpace(model, include="encoder.*")


def test_tied_weights_appear_once_and_requires_grad_is_ignored():
    model = TiedToy()
    model.norm.requires_grad_(False)
    space = ParameterSpace(model)
    assert space.names == ["embed.weight", "norm.weight", "norm.bias"]
    assert space.numel == 50 * 8 + 8 + 8


def test_tensor_ids_are_crc32_of_the_name():
    # Pinned values: a different hash would silently change every run's noise.
    assert tensor_id_for("model.embed_tokens.weight") == 0x15DA8852
    assert tensor_id_for("0.weight") == zlib.crc32(b"0.weight")
    space = ParameterSpace(toy_mlp())
    assert [p.tensor_id for p in space.parameters] == [zlib.crc32(n.encode()) for n in space.names]


def test_colliding_tensor_ids_are_rejected():
    first, second = CRC32_TWINS
    assert zlib.crc32(first.encode()) == zlib.crc32(second.encode())
    model = nn.ParameterDict({first: nn.Parameter(torch.zeros(3)), second: nn.Parameter(torch.zeros(3))})
    with pytest.raises(ValueError, match="CRC-32 collision"):
        ParameterSpace(model)
    assert ParameterSpace(model, exclude=second).names == [first]


def test_unsupported_parameters_fail_clearly():
    model = nn.ParameterDict({"counts": nn.Parameter(torch.zeros(3, dtype=torch.int64), requires_grad=False)})
    with pytest.raises(ValueError, match="'counts' is torch.int64"):
        ParameterSpace(model)
    with pytest.raises(TypeError, match="model must be a torch.nn.Module"):
        ParameterSpace(torch.zeros(3))


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (dict(chunk_size=0), "chunk_size"),
        (dict(restore="disk"), "restore"),
        (dict(update_precision="fp8"), "update_precision"),
        (dict(stream_elements=0), "stream_elements"),
        (dict(include=["0.*", 3]), "include"),
    ],
)
def test_invalid_options_raise(kwargs, match):
    with pytest.raises(ValueError, match=match):
        ParameterSpace(toy_mlp(), **kwargs)


# ---------------------------------------------------------------- chunking and partition


def test_fit_chunk_size_shrinks_to_the_largest_size_with_enough_chunks():
    space = ParameterSpace(toy_mlp(), chunk_size=1 << 16)  # 85 + 17 + 51 + 3 elements: 4 chunks
    assert sum(space.chunk_counts) == 4
    assert space.fit_chunk_size(4) == 1 << 16  # already enough: untouched, no warning
    # At 28 elements per chunk: 4 + 1 + 2 + 1 = 8 chunks; at 29: 3 + 1 + 2 + 1 = 7.
    with pytest.warns(UserWarning, match="using chunk_size=28"):
        assert space.fit_chunk_size(8) == 28
    assert space.chunk_counts == [4, 1, 2, 1]


def test_fit_chunk_size_fails_when_even_single_elements_are_too_few():
    space = ParameterSpace(nn.Linear(2, 1))  # 3 elements
    with pytest.raises(ValueError, match="num_subspaces=4 exceeds the 3 trainable elements"):
        space.fit_chunk_size(4)


def test_partition_covers_every_chunk_and_is_balanced():
    space = ParameterSpace(toy_mlp(), chunk_size=4)
    parts = space.partition(SEED, 4)
    assert [p.numel() for p in parts] == space.chunk_counts
    owned = torch.bincount(torch.cat(parts).to(torch.int64), minlength=4)
    assert int(owned.max() - owned.min()) <= 1
    assert all(torch.equal(a, b) for a, b in zip(parts, space.partition(SEED, 4)))


# ---------------------------------------------------------------- perturb and restore


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("restore", ["device", "host"])
def test_perturb_matches_dense_noise_and_restore_is_bit_exact(dtype, restore):
    space = ParameterSpace(toy_mlp(dtype), chunk_size=6, restore=restore, stream_elements=13)
    original = flat_weights(space)
    parts = space.partition(SEED, 3)
    for member, subspace in [(0, 0), (1, 1), (7, 2)]:
        space.perturb(parts, seed=SEED, member=member, subspace=subspace, sigma=0.05)
        for param, before, after, part in zip(space.parameters, original, flat_weights(space), parts):
            noise = dense_member_noise(
                param.numel, part, chunk_size=6, subspace=subspace, seed=SEED, member=member, tensor_id=param.tensor_id
            )
            expected = (before.float() + 0.05 * noise).to(dtype)
            torch.testing.assert_close(after, expected, rtol=0, atol=0)
            assert torch.equal(after[noise == 0], before[noise == 0]), "elements outside the subspace were touched"
        space.restore()
        assert all(torch.equal(a, b) for a, b in zip(flat_weights(space), original))


def test_subtract_restore_warns_and_is_only_approximate():
    with pytest.warns(UserWarning, match="inexact"):
        space = ParameterSpace(toy_mlp(torch.bfloat16), chunk_size=8, restore="subtract")
    original = flat_weights(space)
    parts = space.partition(SEED, 2)
    space.perturb(parts, seed=SEED, member=3, subspace=1, sigma=0.1)
    space.restore()
    restored = flat_weights(space)
    for before, after in zip(original, restored):
        torch.testing.assert_close(after.float(), before.float(), rtol=0, atol=0.02)
    assert not all(torch.equal(a, b) for a, b in zip(restored, original)), "bf16 round trip is expected to drift"


def test_perturb_and_restore_must_alternate():
    space = ParameterSpace(toy_mlp(), chunk_size=8)
    parts = space.partition(SEED, 2)
    with pytest.raises(RuntimeError, match="without an applied perturbation"):
        space.restore()
    space.perturb(parts, seed=SEED, member=0, subspace=0, sigma=0.1)
    with pytest.raises(RuntimeError, match="call restore"):
        space.perturb(parts, seed=SEED, member=1, subspace=1, sigma=0.1)
    with pytest.raises(RuntimeError, match="call restore"):
        space.apply_update(parts, seed=SEED, members=[0], coeffs=[1.0], member_subspaces=[0])


@pytest.mark.parametrize("multi_tensor", [True, False])
def test_every_write_bumps_the_weights_version_counters(multi_tensor):
    """The kernels write through raw addresses, which torch does not see: ParameterSpace bumps the counters itself,
    so a reader caching something derived from the weights (vLLM's packed GEMM copies) knows they changed."""
    model = toy_mlp()
    space = ParameterSpace(model, chunk_size=8, multi_tensor=multi_tensor)
    parts = space.partition(SEED, 2)
    writes = [
        lambda: space.perturb(parts, seed=SEED, member=0, subspace=1, sigma=0.1),
        space.restore,
        lambda: space.apply_update(parts, seed=SEED, members=[0], coeffs=[1.0], member_subspaces=[0]),
    ]
    for write in writes:
        versions = [param._version for param in model.parameters()]
        write()
        assert all(param._version > version for param, version in zip(model.parameters(), versions))


# ---------------------------------------------------------------- update


def test_update_matches_the_dense_sum_and_reports_its_norm():
    space = ParameterSpace(toy_mlp(), chunk_size=5)
    original = flat_weights(space)
    parts = space.partition(SEED, 2)
    members, coeffs, groups = [0, 1, 2, 3], [0.3, -0.1, 0.05, 0.2], [0, 1, 0, 1]
    norm = space.apply_update(parts, seed=SEED, members=members, coeffs=coeffs, member_subspaces=groups)
    squared = 0.0
    for param, before, after, part in zip(space.parameters, original, flat_weights(space), parts):
        delta = sum(
            c
            * dense_member_noise(
                param.numel, part, chunk_size=5, subspace=k, seed=SEED, member=m, tensor_id=param.tensor_id
            )
            for m, c, k in zip(members, coeffs, groups)
        )
        torch.testing.assert_close(after, before + delta, rtol=1e-6, atol=1e-6)
        squared += float(((after - before).double() ** 2).sum())
    assert norm == pytest.approx(squared**0.5, rel=1e-9)


def _sub_ulp_update(precision: str, steps: int = 5) -> tuple[ParameterSpace, torch.Tensor, torch.Tensor]:
    """Apply `steps` identical-scale updates far below half a bf16 ulp to weights that all equal 1.0.

    Returns the space, the bf16 weights after, and the exact fp32 trajectory of the same updates.
    """
    shape = (16384,)
    model = nn.ParameterDict({"w": nn.Parameter(torch.ones(shape, dtype=torch.bfloat16))})
    exact = nn.ParameterDict({"w": nn.Parameter(torch.ones(shape))})
    space = ParameterSpace(model, chunk_size=256, update_precision=precision)
    reference = ParameterSpace(exact, chunk_size=256)
    # |delta| ~ 2e-4 per step, vs half an ulp of 1.0 in bf16 = 2^-8 ~ 3.9e-3.
    for step in range(steps):
        parts = space.partition(SEED + step, 2)
        update = dict(seed=SEED + step, members=[0, 1], coeffs=[2e-4, -1e-4], member_subspaces=[0, 1])
        space.apply_update(parts, **update)
        reference.apply_update(parts, **update)
    return space, model["w"].detach(), exact["w"].detach()


def test_native_bf16_loses_sub_ulp_updates():
    space, weights, exact = _sub_ulp_update("native")
    assert torch.equal(weights, torch.ones_like(weights)), "round-to-nearest should drop every tiny step"
    assert float((exact - 1).abs().mean()) > 1e-4, "the reference did move"
    assert (
        space.apply_update(space.partition(SEED, 2), seed=SEED, members=[0], coeffs=[1e-5], member_subspaces=[0]) == 0.0
    ), "the reported norm is the change actually applied"


def test_stochastic_rounding_keeps_sub_ulp_updates_unbiased():
    _, weights, exact = _sub_ulp_update("stochastic", steps=1)
    moved = weights.float() - 1
    intended = exact - 1
    assert int((moved != 0).sum()) > 200, "some elements must round to the neighbouring bf16 value"
    # A moved element goes to the bf16 neighbour on the side of its exact value, never the other way.
    assert bool((torch.sign(moved[moved != 0]) == torch.sign(intended[moved != 0])).all())
    # Unbiased: the total displacement matches the exact one within 5 standard errors of the rounding noise
    # (an element moves by one gap <= 2^-7 with probability |delta| / gap: variance <= |delta| * 2^-7).
    standard_error = float((intended.abs() * 2.0**-7).sum()) ** 0.5
    assert abs(float(moved.sum() - intended.sum())) < 5 * standard_error


@pytest.mark.parametrize("precision", ["master_device", "master_host"])
def test_master_weights_keep_sub_ulp_updates_exactly(precision):
    space, weights, exact = _sub_ulp_update(precision)
    master = space.parameters[0].master
    assert master.dtype == torch.float32
    torch.testing.assert_close(master, exact, rtol=0, atol=1e-7)
    assert torch.equal(weights, master.to(torch.bfloat16)), "the model holds the rounded master"


def test_fp32_parameters_always_update_natively():
    model = nn.ModuleDict({"full": nn.Linear(3, 3), "low": nn.Linear(3, 3).to(torch.bfloat16)})
    space = ParameterSpace(model, update_precision="master_host")
    assert {p.name: p.precision for p in space.parameters} == {
        "full.weight": "native",
        "full.bias": "native",
        "low.weight": "master_host",
        "low.bias": "master_host",
    }
    assert [p.master is None for p in space.parameters] == [True, True, False, False]
    assert {p.precision for p in ParameterSpace(model).parameters} == {"native", "stochastic"}


def test_update_rule_receives_the_gradient_estimate_per_slice():
    space = ParameterSpace(toy_mlp(), chunk_size=5, stream_elements=11)
    original = flat_weights(space)
    parts = space.partition(SEED, 2)
    seen: list[tuple[int, int, int]] = []

    def halve(index: int, offset: int, gradient: torch.Tensor) -> torch.Tensor:
        seen.append((index, offset, gradient.numel()))
        return 0.5 * gradient

    space.apply_update(parts, seed=SEED, members=[4], coeffs=[0.1], member_subspaces=[1], rule=halve)
    assert seen[:3] == [(0, 0, 11), (0, 11, 11), (0, 22, 11)] and seen[-1] == (3, 0, 3)
    for param, before, after, part in zip(space.parameters, original, flat_weights(space), parts):
        noise = dense_member_noise(
            param.numel, part, chunk_size=5, subspace=1, seed=SEED, member=4, tensor_id=param.tensor_id
        )
        torch.testing.assert_close(after, before + 0.05 * noise, rtol=1e-6, atol=1e-7)


def test_update_rule_needs_a_precision_that_can_apply_it():
    space = ParameterSpace(toy_mlp(torch.bfloat16), chunk_size=8, update_precision="stochastic")
    with pytest.raises(ValueError, match="update_precision='stochastic'"):
        space.apply_update(
            space.partition(SEED, 2), seed=SEED, members=[0], coeffs=[1.0], member_subspaces=[0], rule=lambda i, o, g: g
        )


# ---------------------------------------------------------------- streaming


@pytest.mark.filterwarnings("ignore:restore='subtract':UserWarning")
@pytest.mark.parametrize(
    ("dtype", "precision", "restore"),
    [
        (torch.float32, "auto", "device"),
        (torch.bfloat16, "stochastic", "host"),
        (torch.float16, "master_host", "device"),
        (torch.bfloat16, "master_device", "subtract"),
    ],
)
def test_streaming_slices_give_bit_identical_results(dtype, precision, restore):
    results = []
    for stream_elements in (None, 7, 40):
        space = ParameterSpace(
            toy_mlp(dtype), chunk_size=6, restore=restore, update_precision=precision, stream_elements=stream_elements
        )
        for step in range(2):
            parts = space.partition(SEED + step, 3)
            space.perturb(parts, seed=SEED + step, member=5, subspace=2, sigma=0.03)
            perturbed = flat_weights(space)
            space.restore()
            space.apply_update(
                parts, seed=SEED + step, members=[1, 2, 5], coeffs=[0.01, -0.02, 0.005], member_subspaces=[0, 1, 2]
            )
        masters = [p.master.clone() for p in space.parameters if p.master is not None]
        results.append((perturbed, flat_weights(space), masters))
    for perturbed, weights, masters in results[1:]:
        assert all(torch.equal(a, b) for a, b in zip(perturbed, results[0][0]))
        assert all(torch.equal(a, b) for a, b in zip(weights, results[0][1]))
        assert all(torch.equal(a, b) for a, b in zip(masters, results[0][2]))


def test_sub_ulp_16bit_tensors_are_left_out_by_name():
    """bf16 norm weights of 1.0 have an ulp of 2^-7: noise at sigma_k = 2e-3 (sigma 1e-3, K = 4) rounds away on
    almost all their elements, so ES would see nothing and the update would random-walk them."""
    import warnings

    from copes.es.selection import rounds_away_fraction
    from copes.es.strategies import CoPES

    from helpers.tiny_models import tiny_qwen3

    model = tiny_qwen3(dtype=torch.bfloat16)
    norm = model.model.norm.weight
    torch.manual_seed(0)
    noisy = (norm.float() + 2e-3 * torch.randn(norm.shape)).to(torch.bfloat16)
    kept = float((noisy == norm).float().mean())
    assert kept > 0.7 and abs(rounds_away_fraction(norm, 2e-3) - 0.81) < 0.01  # (erf(1.38) + erf(0.69)) / 2
    with pytest.warns(UserWarning, match=r"not perturbing 9 16-bit tensors .*: "
                                         r".*model\.layers\.\*\.input_layernorm\.weight \(2\).*model\.norm\.weight"):
        es = CoPES(model, sigma=1e-3, num_subspaces=4)
    assert not [name for name in es.space.names if "norm" in name]
    assert {"model.embed_tokens.weight", "model.layers.0.mlp.up_proj.weight"} <= set(es.space.names)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no notice: the user's include, or fp32 weights, keep every tensor
        assert "model.norm.weight" in CoPES(model, sigma=1e-3, num_subspaces=4, include="*").space.names
        fp32 = CoPES(tiny_qwen3(), sigma=1e-3, num_subspaces=4)
        assert len(fp32.space.names) == len(list(tiny_qwen3().parameters()))

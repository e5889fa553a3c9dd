"""WeightSet refuses what would break exact restore or perturb dead memory: two entries on one storage (a tied
embedding from `state_dict()` or `named_parameters(remove_duplicate=False)`), tensors reallocated after the set was
built (`model.to(...)`), a name given twice; a dtype error names the tensor (issue #37)."""

from __future__ import annotations

import pytest
import torch

import copes_kernels as ck


class TiedModel(torch.nn.Module):
    """An embedding tied to the output projection, as Qwen's small models and GPT-2 have it."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(64, 16)
        self.norm = torch.nn.LayerNorm(16)
        self.lm_head = torch.nn.Linear(16, 64, bias=False)
        self.lm_head.weight = self.embed.weight


def test_tied_weights_from_state_dict_are_refused_naming_both() -> None:
    """Guards: state_dict() of a tied model was accepted, and restore was then not exact for either name."""
    model = TiedModel()
    with pytest.raises(ValueError, match=r"embed\.weight and lm_head\.weight share storage"):
        ck.WeightSet.from_named(model.state_dict().items())
    with pytest.raises(ValueError, match="share storage"):
        ck.WeightSet.from_named(model.named_parameters(remove_duplicate=False))


def test_overlapping_views_are_refused() -> None:
    base = torch.zeros(100)
    with pytest.raises(ValueError, match="tensor 0 and tensor 1 share storage"):
        ck.WeightSet([base[:60], base[40:]], [1, 2])


def test_named_parameters_of_a_tied_model_restore_bit_for_bit() -> None:
    model = TiedModel()
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    weights = ck.WeightSet.from_named(model.named_parameters())
    weights.perturb(seed=3, member=1, sigma=0.1)
    assert not torch.equal(model.lm_head.weight, before["embed.weight"])
    weights.restore()
    for name, p in model.named_parameters():
        assert torch.equal(p.detach().view(torch.int32), before[name].view(torch.int32)), name


def test_reallocated_parameters_are_an_error_at_the_next_op() -> None:
    """Guards: after model.to(...) reallocated the parameters, an old WeightSet perturbed dead tensors silently."""
    model = TiedModel()
    weights = ck.WeightSet.from_named(model.named_parameters())
    weights.perturb(seed=0, member=0, sigma=0.01)
    weights.restore()
    model.to(torch.bfloat16)
    with pytest.raises(RuntimeError, match=r"embed\.weight was reallocated"):
        weights.perturb(seed=0, member=1, sigma=0.01)
    with pytest.raises(RuntimeError, match="was reallocated"):
        weights.update([1.0], members=[0], seed=0)


def test_a_name_given_twice_is_named_not_a_hash_collision() -> None:
    tensor = torch.zeros(8)
    with pytest.raises(ValueError, match="the name 'w' is given twice"):
        ck.WeightSet.from_named([("w", tensor), ("w", torch.zeros(8))])


def test_a_dtype_error_names_the_tensor() -> None:
    with pytest.raises(ValueError, match=r"norm\.bias must be a contiguous float32.*torch\.float64"):
        ck.WeightSet.from_named([("norm.weight", torch.zeros(4)), ("norm.bias", torch.zeros(4, dtype=torch.float64))])

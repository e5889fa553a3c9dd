"""Checkpoints: nested state round-trips bit-exactly, `latest` moves last, corruption is caught on load."""

import json

import pytest
import torch
from transformers import AutoModelForCausalLM

from copes.errors import UserError
from copes.run import checkpoint as ckpt
from tests.helpers.live_bytes import LiveBytes
from tests.helpers.tiny_models import tiny_qwen3


class _Saveable:
    """The two save_pretrained-style writers a checkpoint needs, writing one small file each."""

    def __init__(self, name: str) -> None:
        self.name = name

    def save_pretrained(self, folder, **_):
        (folder / f"{self.name}.json").write_text(json.dumps({"name": self.name}))


def _save(root, step, state):
    return ckpt.save_checkpoint(root, step, model=_Saveable("model"), tokenizer=_Saveable("tokenizer"),
                                es_state=state, trainer_state={"step": step})


def test_state_round_trips_bit_exactly(tmp_path):
    state = {"step": 3, "adam": {"m": torch.randn(5, dtype=torch.float64), "v": [torch.arange(4), 1.5]},
             "master": torch.randn(7).bfloat16(), "name": "copes"}
    folder = _save(tmp_path, 3, state)
    loaded, trainer_state = ckpt.load_checkpoint(folder)
    assert trainer_state == {"step": 3}
    assert loaded["step"] == 3 and loaded["name"] == "copes" and loaded["adam"]["v"][1] == 1.5
    for a, b in ((state["adam"]["m"], loaded["adam"]["m"]), (state["adam"]["v"][0], loaded["adam"]["v"][0]),
                 (state["master"], loaded["master"])):
        assert a.dtype == b.dtype and torch.equal(a, b)


def test_latest_points_at_newest_and_find_accepts_every_level(tmp_path):
    _save(tmp_path / "checkpoints", 1, {})
    newest = _save(tmp_path / "checkpoints", 2, {})
    assert ckpt.find_checkpoint(tmp_path) == newest
    assert ckpt.find_checkpoint(tmp_path / "checkpoints") == newest
    assert ckpt.find_checkpoint(newest) == newest
    assert not list((tmp_path / "checkpoints").glob(".*partial"))


def test_a_half_written_checkpoint_leaves_the_previous_one_current(tmp_path):
    root = tmp_path / "checkpoints"
    first = _save(root, 1, {"x": torch.ones(2)})
    # A crash mid-write leaves only a staging folder behind: `latest` still names the complete one.
    (root / ".step-000002.partial").mkdir()
    (root / ".step-000002.partial" / "model.json").write_text("{")
    assert ckpt.find_checkpoint(tmp_path) == first
    _save(root, 2, {"x": torch.zeros(2)})  # the retry replaces the leftover staging folder
    assert ckpt.find_checkpoint(tmp_path).name == "step-000002"


def test_corruption_and_non_checkpoints_are_clear_errors(tmp_path):
    folder = _save(tmp_path, 1, {"x": torch.ones(3)})
    (folder / "es_state.safetensors").write_bytes(b"garbage")
    with pytest.raises(UserError, match="is corrupt: es_state.safetensors"):
        ckpt.load_checkpoint(folder)
    with pytest.raises(UserError, match="is not a checkpoint"):
        ckpt.find_checkpoint(tmp_path / "nothing-here")


def test_views_of_one_storage_are_saved_without_a_copy(tmp_path):
    """The vLLM engine's HF model holds views into fused weights (gate and up in one gate_up storage, the embedding
    a view of a padded one); `save_pretrained` would clone each (4.7 GiB at 4B). The checkpoint writes them in place
    and loads back equal, the tied output layer still tied."""
    model = tiny_qwen3(tie_word_embeddings=True, intermediate_size=1024)
    expected = {name: tensor.clone() for name, tensor in model.state_dict().items()}
    with torch.no_grad():
        for layer in model.model.layers:
            mlp = layer.mlp
            fused = torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight])
            rows = mlp.gate_proj.weight.shape[0]
            mlp.gate_proj.weight = torch.nn.Parameter(fused[:rows], requires_grad=False)
            mlp.up_proj.weight = torch.nn.Parameter(fused[rows:], requires_grad=False)
        embedding = model.get_input_embeddings().weight
        padded = torch.cat([embedding, torch.zeros(3, embedding.shape[1])])
        model.get_input_embeddings().weight = torch.nn.Parameter(padded[: embedding.shape[0]], requires_grad=False)
        model.tie_weights()
    with LiveBytes(model.state_dict().values()) as live:
        folder = ckpt.save_checkpoint(tmp_path, 1, model=model, tokenizer=_Saveable("tokenizer"), es_state={},
                                      trainer_state={"step": 1})
    one_view = model.model.layers[0].mlp.gate_proj.weight.nbytes
    assert live.peak < one_view, f"saving allocated {live.peak} bytes (one view is {one_view})"
    loaded = AutoModelForCausalLM.from_pretrained(folder)
    for name, tensor in loaded.state_dict().items():
        assert torch.equal(tensor, expected[name]), name
    assert loaded.lm_head.weight.data_ptr() == loaded.get_input_embeddings().weight.data_ptr()

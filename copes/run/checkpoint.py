"""Checkpoints that survive `kill -9`: written to a temporary folder, fsynced, renamed, then verified on load.

Layout of `<output_dir>/checkpoints/step-000010/`: the model through `save_pretrained` (safetensors, loadable by
`AutoModelForCausalLM.from_pretrained` and vLLM), the tokenizer, `es_state.safetensors` + `es_state.json` (the
strategy's tensors and plain values), `trainer_state.json` (step, config, metrics so far) and `MANIFEST.json`
(sha256 of every file). `checkpoints/latest` names the newest complete checkpoint; it is replaced atomically last,
so a crash at any point leaves the previous checkpoint current. Resume writes again the checkpoints a crash cut short
or that are corrupt (`copes.run.replay.rebuild_weights`), older ones included: `latest` never moves back.

Checkpoints are exports: a run's durability rests on its journal (`copes.run.journal`). Resume starts from the newest
intact checkpoint that carries the journal's `run_id` in trainer_state.json, only to shorten the replay.
"""

from __future__ import annotations

import errno
import json
import os
import re
import shutil
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from copes.errors import UserError
from copes.failpoints import failpoint
from copes.user_code import sha256_of

MANIFEST = "MANIFEST.json"
LATEST = "latest"
TENSOR_MARK = "__tensor__"


def flatten_state(state: Any, prefix: str = "") -> tuple[Any, dict[str, torch.Tensor]]:
    """Split a nested dict/list of tensors and plain values into (JSON-able skeleton, named tensors)."""
    tensors: dict[str, torch.Tensor] = {}

    def walk(value: Any, path: str) -> Any:
        if isinstance(value, torch.Tensor):
            tensors[path] = value.detach().cpu().contiguous()
            return {TENSOR_MARK: path}
        if isinstance(value, dict):
            return {str(k): walk(v, f"{path}.{k}" if path else str(k)) for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            return [walk(v, f"{path}.{i}") for i, v in enumerate(value)]
        return value

    return walk(state, prefix), tensors


def unflatten_state(skeleton: Any, tensors: dict[str, torch.Tensor]) -> Any:
    if isinstance(skeleton, dict):
        if set(skeleton) == {TENSOR_MARK}:
            return tensors[skeleton[TENSOR_MARK]]
        return {k: unflatten_state(v, tensors) for k, v in skeleton.items()}
    if isinstance(skeleton, list):
        return [unflatten_state(v, tensors) for v in skeleton]
    return skeleton


def _fsync_tree(folder: Path) -> None:
    for path in folder.iterdir():
        with path.open("rb") as handle:
            os.fsync(handle.fileno())
    descriptor = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


def write_text_atomic(path: Path, text: str) -> None:
    temporary = path.with_name(f".{path.name}.tmp")
    with temporary.open("w", encoding="utf-8") as handle:
        handle.write(text)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(temporary, path)


def views_on_their_own_storage(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The model's state dict with every tensor that is a view into a larger storage (the vLLM engine's HF-named
    views of its fused and padded weights) re-wrapped over a storage of its own through DLPack: the same memory, no
    copy. `save_pretrained` clones each tensor that shares a storage with another, which at Qwen3.5-4B on vLLM
    was a 4.7 GiB transient (gate_up, qkv and qkvz views); tied weights still share one region and stay tied."""
    return {name: torch.from_dlpack(tensor) if tensor.untyped_storage().nbytes() > tensor.nbytes else tensor
            for name, tensor in model.state_dict().items()}


def save_checkpoint(
    root: Path, step: int, *, model: Any, tokenizer: Any, es_state: dict[str, Any], trainer_state: dict[str, Any]
) -> Path:
    """Write checkpoint `step` under `root` (= <output_dir>/checkpoints) and point `latest` at it."""
    root.mkdir(parents=True, exist_ok=True)
    name = f"step-{step:06d}"
    final, staging = root / name, root / f".{name}.partial"
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir()
    state_dict = views_on_their_own_storage(model) if isinstance(model, torch.nn.Module) else None
    try:
        model.save_pretrained(staging, safe_serialization=True, state_dict=state_dict)
        tokenizer.save_pretrained(staging)
        skeleton, tensors = flatten_state(es_state)
        save_file(tensors, str(staging / "es_state.safetensors"))
    except SafetensorError as error:  # its I/O errors arrive as text: "... (os error 28)"
        code = re.search(r"os error (\d+)", str(error))
        number = int(code.group(1)) if code else errno.EIO
        raise OSError(number, os.strerror(number), str(staging)) from None
    (staging / "es_state.json").write_text(json.dumps(skeleton, indent=1), encoding="utf-8")
    (staging / "trainer_state.json").write_text(json.dumps(trainer_state, indent=1), encoding="utf-8")
    failpoint("checkpoint")  # crash tests: die with a checkpoint half written
    manifest = {path.name: sha256_of(path) for path in sorted(staging.iterdir())}
    (staging / MANIFEST).write_text(json.dumps(manifest, indent=1), encoding="utf-8")
    _fsync_tree(staging)
    shutil.rmtree(final, ignore_errors=True)  # a re-run of the same step replaces its own old copy
    os.replace(staging, final)
    current = root / LATEST
    if not current.is_file() or current.read_text(encoding="utf-8").strip() <= name:  # an older one written again
        write_text_atomic(current, name)  # on resume leaves `latest` at the newest
    return final


def remove_partial_checkpoints(root: Path) -> None:
    """Delete staging folders a crash left mid-write (a resumed run may never write that step again)."""
    for staging in root.glob(".step-*.partial"):
        shutil.rmtree(staging, ignore_errors=True)


def find_checkpoint(path: str | Path) -> Path:
    """Accept a run's output dir, its checkpoints/ folder, or one checkpoint folder."""
    path = Path(path)
    for root in (path / "checkpoints", path):
        latest = root / LATEST
        if latest.is_file():
            return root / latest.read_text(encoding="utf-8").strip()
    if (path / MANIFEST).is_file():
        return path
    raise UserError(f"{path} is not a checkpoint (no checkpoints/latest and no {MANIFEST} found)")


def verify_checkpoint(folder: Path) -> None:
    try:
        manifest = json.loads((folder / MANIFEST).read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as error:
        raise UserError(f"checkpoint {folder} has no readable {MANIFEST}: {error}") from None
    for name, expected in manifest.items():
        file = folder / name
        if not file.is_file() or sha256_of(file) != expected:
            raise UserError(f"checkpoint {folder} is corrupt: {name} is missing or does not match its checksum")


def load_checkpoint(folder: Path, *, verified: bool = False) -> tuple[dict[str, Any], dict[str, Any]]:
    """(es_state, trainer_state) of a checkpoint, verified first unless it was; the model itself loads through
    from_pretrained."""
    if not verified:
        verify_checkpoint(folder)
    skeleton = json.loads((folder / "es_state.json").read_text(encoding="utf-8"))
    es_state = unflatten_state(skeleton, load_file(str(folder / "es_state.safetensors")))
    trainer_state = json.loads((folder / "trainer_state.json").read_text(encoding="utf-8"))
    return es_state, trainer_state

"""Hugging Face-named views of a vLLM model's weights, found by asking vLLM's own weight loader where each
checkpoint tensor goes.

vLLM renames (`language_model.` under a multimodal wrapper), fuses (`qkv_proj`, `gate_up_proj`, Qwen3.5's
`in_proj_qkvz` = in_proj_qkv's 3 row blocks + in_proj_z's 1), pads (vocabularies) and re-types (fp32 `A_log`)
checkpoint tensors, and every architecture does it in its own `load_weights`. Instead of re-deriving those rules
(by zipping `packed_modules_mapping` names with `output_sizes`, which is wrong as soon as one HF tensor spans
several shard ids), `trace_checkpoint` feeds every checkpoint tensor once more through `vllm_model.load_weights`
under a dispatch mode that records, and does not perform, every copy into a parameter: the copies say which
parameter and which elements hold that tensor. A tensor whose copies form one contiguous run of one parameter
(rows of a fused matrix, the first rows of a padded vocabulary, a reshaped conv weight) becomes a view of that
run under the checkpoint's shape; anything else (a transpose, a transform, a write that is not a copy) is an
error, never a silent mismatch.

Every traced view is then checked against the checkpoint, bit for bit, after the cast vLLM applied: a layout vLLM
changes after loading (`process_weights_after_loading`) is an error. Checkpoint tensors vLLM does not load at all
(a vision tower, `mtp.*` draft layers) are counted and named by their prefix.

A parameter vLLM keeps wider than the model dtype (Qwen3.5's `A_log` in fp32 beside bf16 weights) is handed to the
trainer in the engine's dtype: the HF parameter *is* the fp32 tensor the engine computes with, so a perturbation
lands where the forward reads it (a bf16 view of fp32 storage cannot exist, and a bf16 shadow copy would need a
sync after every write); the checkpoint's bf16 values are exact in fp32, and a `save_pretrained` export writes
that tensor in fp32.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from torch.utils._python_dispatch import TorchDispatchMode

from copes.errors import UserError

# The segment transformers and vLLM both strip from a multimodal checkpoint's text model
# (`model.language_model.layers.0...` -> `model.layers.0...`, `language_model.lm_head` -> `lm_head`).
WRAPPER_SEGMENT = "language_model."
WIDER_DTYPES = {torch.float32}
# Writes of a constant (a padded vocabulary's spare rows zeroed): no checkpoint data goes through them.
CONSTANT_FILLS = {torch.ops.aten.fill_.Scalar, torch.ops.aten.zero_.default}


@dataclass
class _Copy:
    """One copy vLLM's loader made into a parameter: destination and source runs, in elements."""

    parameter: str
    dest_start: int
    source_start: int
    numel: int
    contiguous: bool  # both sides one contiguous run, the source a run of the checkpoint tensor itself


class _CopyRecorder(TorchDispatchMode):
    """Records (and drops) every write into a parameter's storage while one checkpoint tensor loads."""

    def __init__(self, storages: dict[int, tuple[str, torch.Tensor]]) -> None:
        super().__init__()
        self.storages = storages
        self.source: torch.Tensor | None = None
        self.copies: list[_Copy] = []
        self.other_writes: list[str] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if func._schema.is_mutable and args and isinstance(args[0], torch.Tensor):
            owner = self.storages.get(args[0].untyped_storage().data_ptr())
            if owner is not None:
                if func is torch.ops.aten.copy_.default:
                    self._record(owner, args[0], args[1])
                elif func not in CONSTANT_FILLS:
                    self.other_writes.append(str(func))
                return args[0]
        return func(*args, **kwargs)

    def _record(self, owner: tuple[str, torch.Tensor], dest: torch.Tensor, source: torch.Tensor) -> None:
        name, parameter = owner
        ours = (self.source is not None and isinstance(source, torch.Tensor)
                and source.untyped_storage().data_ptr() == self.source.untyped_storage().data_ptr())
        contiguous = ours and dest.is_contiguous() and source.is_contiguous() and dest.numel() == source.numel()
        self.copies.append(_Copy(name, dest.storage_offset() - parameter.storage_offset(),
                                 source.storage_offset() - self.source.storage_offset() if ours else 0,
                                 dest.numel(), contiguous))


@dataclass(frozen=True)
class CheckpointTrace:
    """What vLLM did with each checkpoint tensor: `views` (checkpoint name -> engine view under the checkpoint's
    shape, checked bit for bit), `skipped` (names vLLM does not load) and `holders` (checkpoint name -> the vLLM
    parameter that holds it: where a LoRA adapter for it must be named)."""

    views: dict[str, torch.Tensor]
    skipped: list[str]
    holders: dict[str, str] = field(default_factory=dict)


def checkpoint_tensors(path: Path) -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor of the safetensors checkpoint folder `path`, one at a time, under its stored name. The file is
    opened anew for each tensor: pages read through one open handle stay mapped (and in RSS) until it closes, which
    at Qwen3.5-4B put the whole 7.8 GiB checkpoint beside vLLM's own copy of it; this way one tensor's are."""
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise UserError(f"--rollout-engine vllm needs safetensors weights in {path}")
    for file in files:
        with safe_open(str(file), framework="pt") as handle:
            names = list(handle.keys())
        for name in names:
            with safe_open(str(file), framework="pt") as handle:
                tensor = handle.get_tensor(name)
            yield name, tensor


def stored_tensors(path: Path, names: set[str]) -> dict[str, torch.Tensor]:
    """The tensors `names` of the safetensors checkpoint folder `path`, in their stored dtype (only those are read)."""
    found: dict[str, torch.Tensor] = {}
    for file in sorted(Path(path).glob("*.safetensors")) if names else ():
        with safe_open(str(file), framework="pt") as handle:
            found.update({name: handle.get_tensor(name) for name in names & set(handle.keys())})
    return found


def _view_of_copies(name: str, tensor: torch.Tensor, copies: list[_Copy],
                    parameters: dict[str, torch.Tensor]) -> tuple[torch.Tensor, str]:
    """The engine view that holds checkpoint tensor `name`, and its parameter's name, from the copies its load
    made."""
    owners = {copy.parameter for copy in copies}
    offsets = {copy.dest_start - copy.source_start for copy in copies}
    covered = sorted((copy.source_start, copy.numel) for copy in copies)
    runs_tile = all(start == sum(n for _, n in covered[:i]) for i, (start, _) in enumerate(covered))
    if not (len(owners) == 1 and len(offsets) == 1 and all(c.contiguous for c in copies) and runs_tile
            and sum(n for _, n in covered) == tensor.numel()):
        raise UserError(f"vLLM loads {name} in a layout ES cannot view under its HF name "
                        f"(into {sorted(owners)}, not one contiguous run); use --rollout-engine hf")
    owner = owners.pop()
    parameter = parameters[owner]
    if not parameter.is_contiguous():
        raise UserError(f"vLLM keeps {name} in non-contiguous storage; use --rollout-engine hf")
    start = offsets.pop()
    return parameter.view(-1)[start:start + tensor.numel()].view(tensor.shape), owner


def _same_bits(expected: torch.Tensor, view: torch.Tensor) -> bool:
    return torch.equal(expected.to(view.dtype).reshape(-1).view(torch.uint8), view.cpu().reshape(-1).view(torch.uint8))


def trace_checkpoint(vllm_model: torch.nn.Module, tensors: Iterable[tuple[str, torch.Tensor]]) -> CheckpointTrace:
    """Views of `vllm_model`'s weights under the checkpoint's names, by replaying its weight loader (see the
    module docstring). Every tensor vLLM loads is checked against the engine's storage bit for bit."""
    parameters = {name: param.detach() for name, param in vllm_model.named_parameters()}  # detach: shares versions
    recorder = _CopyRecorder({param.untyped_storage().data_ptr(): (name, param) for name, param in parameters.items()})
    views: dict[str, torch.Tensor] = {}
    holders: dict[str, str] = {}
    skipped: list[str] = []
    for name, tensor in tensors:
        recorder.source, recorder.copies, recorder.other_writes = tensor, [], []
        with torch.no_grad(), recorder:
            vllm_model.load_weights([(name, tensor)])
        if recorder.other_writes:
            raise UserError(f"vLLM transforms {name} while loading it ({recorder.other_writes[0]}); ES cannot "
                            "perturb it under its HF name")
        if not recorder.copies:
            skipped.append(name)
            continue
        view, holders[name] = _view_of_copies(name, tensor, recorder.copies, parameters)
        if not _same_bits(tensor, view):
            raise UserError(f"vLLM changed {name} while loading it; ES cannot perturb it under its HF name")
        views[name] = view
    return CheckpointTrace(views, skipped, holders)


def hf_name(checkpoint_name: str, hf_names: set[str]) -> str | None:
    """The HF model's name for a checkpoint tensor: the same name, or the name without the multimodal wrapper's
    `language_model.` segment (None when neither is an HF parameter)."""
    candidates = (checkpoint_name, checkpoint_name.replace(f".{WRAPPER_SEGMENT}", ".", 1),
                  checkpoint_name.removeprefix(WRAPPER_SEGMENT))
    return next((name for name in candidates if name in hf_names), None)


def engine_holders(hf_model: torch.nn.Module, trace: CheckpointTrace) -> dict[str, str]:
    """{HF parameter name: the vLLM parameter that holds it} for every parameter `trace` found."""
    hf_names = {name for name, _ in hf_model.named_parameters(remove_duplicate=False)}
    holders = {}
    for name, holder in trace.holders.items():
        target = hf_name(name, hf_names)
        if target is not None:
            holders[target] = holder
    return holders


def bind_views(hf_model: torch.nn.Module, trace: CheckpointTrace) -> list[str]:
    """Make every parameter of the meta-device `hf_model` a traced engine view (tied parameters stay one
    Parameter). Returns the names of those kept in the engine's wider dtype. Fails on an HF parameter vLLM holds
    nowhere, on a shape that differs, on a narrower engine dtype, and on a checkpoint tensor vLLM loads that the
    HF model has no parameter for (it could be neither trained nor exported)."""
    meta = dict(hf_model.named_parameters(remove_duplicate=False))
    hf_names = set(meta)
    by_hf_name: dict[str, torch.Tensor] = {}
    for name, view in trace.views.items():
        target = hf_name(name, hf_names)
        if target is None:
            raise UserError(f"vLLM loads {name}, which {type(hf_model).__name__} has no parameter for")
        by_hf_name[target] = view
    unmapped = [name for name in trace.skipped if hf_name(name, hf_names) is not None]
    if unmapped:
        raise UserError(f"vLLM does not load {unmapped[0]} (and {len(unmapped) - 1} more HF parameters)")
    bound: dict[int, torch.nn.Parameter] = {}
    wider: list[str] = []
    for name, param in meta.items():
        if id(param) not in bound:
            view = by_hf_name.get(name)
            if view is None or view.shape != param.shape:
                found = "nothing" if view is None else f"{tuple(view.shape)} {view.dtype}"
                raise UserError(f"vLLM's layout of {type(hf_model).__name__} is not mapped to HF names: {name} is "
                                f"{tuple(param.shape)} {param.dtype} in HF, {found} in vLLM")
            if view.dtype != param.dtype:
                if view.dtype not in WIDER_DTYPES or param.dtype.itemsize >= view.dtype.itemsize:
                    raise UserError(f"vLLM keeps {name} in {view.dtype}, the model is {param.dtype}")
                wider.append(name)
            bound[id(param)] = torch.nn.Parameter(view, requires_grad=False)
        module_name, _, leaf = name.rpartition(".")
        setattr(hf_model.get_submodule(module_name), leaf, bound[id(param)])
    return wider

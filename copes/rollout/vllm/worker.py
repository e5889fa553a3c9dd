"""The vLLM worker extension: plain linear weights on CPU, and the model's parameters handed to the trainer.

Stock vLLM-CPU packs every linear weight into a private oneDNN (or sgl-kernel) copy when the model loads and
leaves `layer.weight` empty, so there is nothing to perturb. `keep_plain_linear_weights()`, called before the
model loads, wraps `vllm.model_executor.layers.utils.dispatch_cpu_unquantized_gemm` so every 2-D linear layer
keeps its weight and computes `F.linear(x, layer.weight, bias)`: a write into `layer.weight` is what the next
forward uses. Other layers (MoE expert stacks, conv weights) keep vLLM's dispatch. On CUDA the dispatch is never
called and vLLM keeps plain weight tensors anyway. vLLM is imported only when called (it is an optional extra).

`PackedLinearWeights` is the faster CPU mode (`vllm_cpu_weights: packed`): the plain weights stay the ones the
trainer writes, and each linear layer also holds vLLM's own packed copy (vLLM's dispatch with
`remove_weight=False`), rebuilt before a generation for the layers whose weight changed since its last pack. A
change is seen through the tensors' autograd version counters: torch's in-place ops bump them, and
`ParameterSpace` bumps them for its kernels' raw-address writes, so no write is missed.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.nn.functional as F

from copes.errors import UserError

WORKER_EXTENSION = "copes.rollout.vllm.worker.CoPESWorkerExtension"
EMBEDDING_MODULES = {"embed_tokens", "lm_head"}


def keep_plain_linear_weights() -> None:
    """Install the plain-weight dispatch (idempotent)."""
    from vllm.model_executor.layers import utils as layer_utils

    vllm_dispatch = layer_utils.dispatch_cpu_unquantized_gemm
    if getattr(vllm_dispatch, "keeps_plain_weights", False):
        return

    def plain_linear_dispatch(layer: torch.nn.Module, remove_weight: bool) -> None:
        if layer.weight.ndim == 2 and not layer.weight.is_meta:
            layer.cpu_linear = F.linear  # called as cpu_linear(x, layer.weight, bias)
            return
        plain = layer.weight.data
        vllm_dispatch(layer, remove_weight)
        if layer.weight.data.data_ptr() != plain.data_ptr():  # a packed conv weight: see PackedConvWeights
            layer.weight.data = plain
            layer.copes_plain_weight = plain

    plain_linear_dispatch.keeps_plain_weights = True  # type: ignore[attr-defined]
    plain_linear_dispatch.vllm_dispatch = vllm_dispatch  # type: ignore[attr-defined]
    layer_utils.dispatch_cpu_unquantized_gemm = plain_linear_dispatch


def _vllm_linear_dispatch() -> Callable[[torch.nn.Module, bool], None]:
    """vLLM's own CPU GEMM dispatch, the one the plain-weight patch wraps."""
    from vllm.model_executor.layers import utils as layer_utils

    dispatch = layer_utils.dispatch_cpu_unquantized_gemm
    return getattr(dispatch, "vllm_dispatch", dispatch)


class PackedLinearWeights:
    """vLLM's packed GEMM copies of `vllm_model`'s plain linear weights, kept current by `refresh()`.

    Costs one more copy of every linear weight, and a repack of each layer whose weight changed; a layer's first
    pack is at the first refresh."""

    def __init__(self, vllm_model: torch.nn.Module) -> None:
        from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding

        def runs_gemms(module: torch.nn.Module) -> bool:  # an input embedding has a cpu_linear it never calls
            return not isinstance(module, VocabParallelEmbedding) or isinstance(module, ParallelLMHead)

        # A LoRA wrapper (engine started with LoRA: copes.rollout.vllm.lora) shows its base layer's weight and
        # cpu_linear; the base layer is the one that runs the GEMM, and it is listed on its own.
        self.layers = {name: module for name, module in vllm_model.named_modules()
                       if getattr(module, "cpu_linear", None) is F.linear and module.weight.ndim == 2
                       and runs_gemms(module) and not hasattr(module, "base_layer")}
        self._packed_versions: dict[str, int] = {}  # layer name -> its weight's version when it was packed
        self._dispatch = _vllm_linear_dispatch()
        self.repacked_layers = 0  # layer packs so far, first packs included
        self.repack_seconds = 0.0

    def refresh(self) -> int:
        """Repack every layer whose weight was written since its last pack; returns how many were."""
        started = time.perf_counter()
        repacked = 0
        for name, layer in self.layers.items():
            version = layer.weight._version
            if self._packed_versions.get(name) != version:
                self._pack(name, layer)
                self._packed_versions[name] = version
                repacked += 1
        self.repacked_layers += repacked
        self.repack_seconds += time.perf_counter() - started
        return repacked

    def _pack(self, name: str, layer: torch.nn.Module) -> None:
        bias = getattr(layer, "bias", None)
        bias_address = None if bias is None else bias.data_ptr()
        self._dispatch(layer, False)  # remove_weight=False: the plain weight stays, and stays the trainer's
        # vLLM's sgl-kernel path (CPUs with AMX) moves a 16-bit bias into new float32 storage: the trainer's view
        # of the bias would then no longer be what the layer adds.
        if bias is not None and layer.bias.data_ptr() != bias_address:
            raise UserError(f"vLLM's packed GEMM for {name} moves its bias to new storage the trainer cannot "
                            "perturb; use vllm_cpu_weights: plain")


class PackedConvWeights:
    """vLLM-CPU's packed causal-conv weights (Qwen3.5 / Qwen3-Next linear attention on AVX-512-BF16 and Arm-BF16
    CPUs), whose C++ kernel reads only the packed layout. The plain weight stays the layer's (and the trainer's)
    tensor; `during_generation()` packs it again, with vLLM's own dispatch, when it was written since the last
    pack, lends the packed copy to the layer for the generation and puts the plain weight back after, so a write
    between generations lands in the plain weight and the next generation runs on it."""

    def __init__(self, vllm_model: torch.nn.Module) -> None:
        self.layers = {name: module for name, module in vllm_model.named_modules()
                       if getattr(module, "copes_plain_weight", None) is not None}
        self._packed: dict[str, tuple[int, torch.Tensor]] = {}  # layer -> (weight version when packed, packed copy)
        self._dispatch = _vllm_linear_dispatch()

    @contextlib.contextmanager
    def during_generation(self) -> Iterator[None]:
        for name, layer in self.layers.items():
            version = layer.weight._version  # the Parameter's counter, which the trainer's view shares (not .data's)
            if self._packed.get(name, (None,))[0] != version:
                self._dispatch(layer, False)  # packs the plain weight and lends the copy to the layer
                self._packed[name] = (version, layer.weight.data)
            layer.weight.data = self._packed[name][1]
        try:
            yield
        finally:
            for layer in self.layers.values():
                layer.weight.data = layer.copes_plain_weight


class CoPESWorkerExtension:
    """Mixed into vLLM's worker class; the engine calls these methods through `llm.collective_rpc`."""

    def copes_model(self) -> Any:
        """The loaded torch model (in-process, the very object whose storage the trainer writes)."""
        return self.model_runner.model  # type: ignore[attr-defined]

    def copes_serve_adapters(self, store: dict[int, tuple[dict[str, torch.Tensor], int]]) -> None:
        """Load the LoRA adapters whose ids are in `store` ({id: (PEFT-named tensors, rank)}, filled by the engine
        in this process: copes.rollout.vllm.lora) from those tensors instead of from a folder. The tensors are
        named by vLLM's own modules already, so no checkpoint-name mapper applies."""
        from vllm.lora.lora_model import LoRAModel
        from vllm.lora.peft_helper import PEFTHelper

        manager = self.model_runner.lora_manager  # type: ignore[attr-defined]
        load_from_folder = manager._load_adapter
        def load_adapter(request: Any) -> Any:
            if request.lora_int_id not in store:
                return load_from_folder(request)
            tensors, rank = store[request.lora_int_id]
            # alpha = r: scaling 1, the member's scale is already in lora_B.
            peft = PEFTHelper.from_dict({"r": rank, "lora_alpha": rank, "target_modules": [],
                                         "vllm_max_position_embeddings": manager.max_position_embeddings})
            peft.validate_legal(manager.lora_config)
            return LoRAModel.from_lora_tensors(request.lora_int_id, tensors, peft, device="cpu",
                                               dtype=manager.lora_config.lora_dtype,
                                               model_vocab_size=manager.vocab_size)

        manager._load_adapter = load_adapter

    def copes_lora_modules(self) -> set[str]:
        """Every module name vLLM's LoRA manager looks an adapter's weights up under: each LoRA layer's full name,
        a fused layer's by its parts (`...qkv_proj` -> `...q_proj`, `...k_proj`, `...v_proj`). vLLM also offers
        LoRA on embed_tokens and lm_head; a tied lm_head is the embedding matrix, whose per-row correction also
        enters the input lookup, so those two stay out."""
        adapters = self.model_runner.lora_manager._adapter_manager  # type: ignore[attr-defined]
        names = {part for module in adapters.modules for part in adapters.packed_modules.get(module, [module])}
        return {name for name in names if name.rpartition(".")[2] not in EMBEDDING_MODULES}

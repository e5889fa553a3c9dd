"""Loading a causal LM and its tokenizer through `from_pretrained`, with device and dtype fallback."""

from __future__ import annotations

import ctypes
import functools
import sys
import types
from pathlib import Path

import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

from copes.downloads import DOWNLOADABLE_MODELS, fetch_model
from copes.errors import UserError
from copes.extras import warn_missing_gpu_kernels
from copes.gguf_io import check_gguf, dense_folder, is_gguf_path

EMBEDDED_MODEL = "tiny"  # the name that picks the model shipped in copes/assets
EMBEDDED_MODEL_DIR = Path(__file__).resolve().parent / "assets" / "tiny"
# Every model shipped in copes/assets by name: the default, the tool-using one of configs/tiny-agent-*.yaml, and
# the larger one of the paper-claims ablations (arithmetic and Countdown).
EMBEDDED_MODELS = {name: EMBEDDED_MODEL_DIR.parent / name for name in (EMBEDDED_MODEL, "tiny-agent", "small")}
PRESET_FILE = "copes.yaml"  # a model folder's own recommended ES settings
WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin",
                "pytorch_model.bin.index.json")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_model_path(model: str) -> str:
    """An embedded model's name -> its folder; a downloadable model's name -> its cached file (fetched once per
    machine); a `.gguf` path stays a file; an existing folder must hold weights; anything else is a hub id."""
    if model in EMBEDDED_MODELS:
        return str(EMBEDDED_MODELS[model])
    if model in DOWNLOADABLE_MODELS:
        return str(fetch_model(model))
    path = Path(model).expanduser()
    if is_gguf_path(model):
        check_gguf(path)  # whole, GGUF, an architecture transformers reads: else one sentence, before anything loads
        return str(path)
    looks_like_path = path.exists() or model.startswith((".", "/", "~")) or model.count("/") != 1
    if not looks_like_path:
        return _hub_model_path(model)
    if not path.is_dir():
        raise UserError(f"model path {model} does not exist (give a model folder or a hub id like Qwen/Qwen3.5-4B)")
    if not any((path / name).exists() for name in WEIGHT_FILES):
        raise UserError(f"model folder {model} has no weights (expected one of: {', '.join(WEIGHT_FILES)})")
    return str(path)


def model_folder(model: str) -> str:
    """`resolve_model_path`, with a GGUF file (or a downloadable model's) as its dense folder, converted once per
    machine: every loader (transformers, vLLM, the memory plan) reads a folder."""
    path = resolve_model_path(model)
    return str(dense_folder(Path(path))) if is_gguf_path(path) else path


def _hub_model_path(model_id: str) -> str:
    """A cached hub model's local snapshot (no network), else the id after one quick check that the hub answers:
    offline, transformers would spend about 40 s in retries before failing with a traceback."""
    import huggingface_hub
    from huggingface_hub.errors import GatedRepoError, LocalEntryNotFoundError, RepositoryNotFoundError

    try:
        return huggingface_hub.snapshot_download(model_id, local_files_only=True)
    except LocalEntryNotFoundError:
        pass
    download = (f"download it first where there is network (`hf download {model_id}`, into the same HF_HOME) "
                "or pass --model with a local folder")
    if huggingface_hub.constants.HF_HUB_OFFLINE:
        raise UserError(f"model {model_id} is not in the Hugging Face cache and HF_HUB_OFFLINE is set: {download}")
    try:
        huggingface_hub.model_info(model_id, timeout=10)
    except (RepositoryNotFoundError, GatedRepoError) as error:
        raise UserError(f"model {model_id} cannot be read from the hub ({type(error).__name__}): check the id, "
                          "or log in (`hf auth login`) for a gated model") from None
    except Exception as error:  # DNS, refused connection, proxy, timeout: any way of not reaching the hub
        raise UserError(f"model {model_id} is not in the Hugging Face cache and the hub cannot be reached "
                          f"({type(error).__name__}): {download}") from None
    return model_id


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        resolved = torch.device(device)
    except RuntimeError:
        raise UserError(f"unknown device {device!r} (use auto, cpu, cuda or cuda:N)") from None
    if resolved.type == "cuda" and not torch.cuda.is_available():
        raise UserError(f"device {device!r} asks for CUDA but no CUDA GPU is visible")
    return resolved


def resolve_dtype(dtype: str, device: torch.device) -> torch.dtype:
    if dtype == "auto":
        # bf16 halves memory and ES needs no gradients; on CPU fp32 is both faster and exact.
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return DTYPES[dtype]


def load_model(
    model: str, *, device: str = "auto", dtype: str = "auto"
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase, torch.device]:
    """Model in eval mode without gradients, and a left-padding tokenizer (batched generation needs it)."""
    resolved_device = resolve_device(device)
    torch_dtype = resolve_dtype(dtype, resolved_device)
    try:
        path = model_folder(model)
        tokenizer = AutoTokenizer.from_pretrained(path)
        # A GPU model loads straight onto its device: no host copy of the weights first (transformers' device_map).
        placement = {} if resolved_device.type == "cpu" else {"device_map": {"": resolved_device}}
        lm = AutoModelForCausalLM.from_pretrained(path, dtype=torch_dtype, **placement)
    except OSError as error:
        raise UserError(f"cannot load model {model!r}: {str(error).splitlines()[0]}") from None
    tokenizer.padding_side = "left"
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    lm.eval().requires_grad_(False)
    warn_missing_gpu_kernels(lm.config.model_type, resolved_device.type)
    prepare_for_cpu(lm)
    return lm, tokenizer, resolved_device


def prepare_for_cpu(lm: torch.nn.Module) -> None:
    """torch's CPU kernels, steered around two slow or memory-hungry paths in a bf16 model; the same bits."""
    widen_cpu_depthwise_conv(lm)
    fold_cpu_output_layer(lm)


def _conv1d_widening_depthwise(input, weight, bias=None, stride=1, padding=0, dilation=1, groups=1):
    """F.conv1d, but a depthwise conv of bfloat16/float16 on a CPU runs in float32 and is rounded back. torch's
    CPU kernel for that case takes a slow path: 46 ms for 2 rows x 8192 channels x 4 taps against 0.3 ms in float32,
    and at Qwen3.5-4B's shape it was 97% of a bf16 decode step (24 gated delta-net layers, one conv each). The
    products of two bf16 values are exact in float32 and both kernels accumulate in float32, so the result is the
    same bits (tests/rollout/test_rollout.py)."""
    if input.device.type == "cpu" and input.dtype in (torch.bfloat16, torch.float16) and groups == input.shape[-2] > 1:
        widened_bias = None if bias is None else bias.float()
        out = F.conv1d(input.float(), weight.float(), widened_bias, stride, padding, dilation, groups)
        return out.to(input.dtype)
    return F.conv1d(input, weight, bias, stride, padding, dilation, groups)


def widen_cpu_depthwise_conv(lm: torch.nn.Module) -> None:
    """Gives the gated delta-net layers of `lm` (transformers' torch fallback for causal_conv1d, the only path on a
    CPU) a conv1d that is fast in bfloat16 on a CPU. It replaces the `F` those layers' modeling module sees, once;
    every other op of that module is torch's own."""
    for module_name in {type(layer).__module__ for layer in lm.modules()}:
        modeling = sys.modules.get(module_name)
        functional = getattr(modeling, "F", None)
        if not hasattr(modeling, "causal_conv1d_update") or getattr(functional, "conv1d", None) is not F.conv1d:
            continue  # not a gated delta-net module, or widened already
        widened = types.ModuleType(f"{F.__name__} (CPU depthwise conv1d in float32)")
        widened.__dict__.update(vars(F))
        widened.conv1d = _conv1d_widening_depthwise
        modeling.F = widened


def _linear_on_rows(self: torch.nn.Linear, input: torch.Tensor) -> torch.Tensor:
    """Linear.forward with the input's leading dimensions folded into rows: torch's CPU matmul takes a 3-D input
    through a batched GEMM that copies the weight first, a 1.2 GiB transient for Qwen3.5-4B's output layer at every
    prefill (docs/dress-rehearsal.md); the 2-D GEMM reads it in place and gives the same bits."""
    rows = F.linear(input.reshape(-1, input.shape[-1]), self.weight, self.bias)
    return rows.reshape(*input.shape[:-1], rows.shape[-1])


def fold_cpu_output_layer(lm: torch.nn.Module) -> None:
    """The output layer of `lm`, on a CPU, computes on rows (`_linear_on_rows`); once."""
    head = lm.get_output_embeddings() if hasattr(lm, "get_output_embeddings") else None
    if (isinstance(head, torch.nn.Linear) and head.weight.device.type == "cpu"
            and getattr(head.forward, "__func__", None) is torch.nn.Linear.forward):
        head.forward = types.MethodType(_linear_on_rows, head)


@functools.cache
def _glibc() -> ctypes.CDLL | None:
    try:
        libc = ctypes.CDLL("libc.so.6")
        return libc if hasattr(libc, "malloc_trim") else None
    except OSError:  # not glibc (macOS, musl)
        return None


def release_free_heap() -> None:
    """Hand the C heap's free pages back to the OS (glibc's `malloc_trim`). On a CPU, torch's transients below
    glibc's dynamic mmap threshold (up to 32 MiB: a 4B layer's activations) come from the heap, which keeps what is
    freed: over four Qwen3.5-4B members the rollout peak crept from 10.69 to 10.82 GiB RSS. A trim between members
    returns it (a fixed low threshold would too, at 39% of the decode's speed). A no-op off glibc."""
    libc = _glibc()
    if libc is not None:
        libc.malloc_trim(0)


def read_preset(model: str, algorithm: str | None = None) -> Path | None:
    """The model's own recommended ES settings, if it ships them: `copes.<algorithm>.yaml` in its folder where the
    algorithm has its own (EGGROLL wants other settings than CoPES), else `copes.yaml`."""
    try:
        path = Path(resolve_model_path(model))
    except UserError:
        return None
    own = [path / f"{Path(PRESET_FILE).stem}.{algorithm}.yaml"] if algorithm else []
    return next((preset for preset in [*own, path / PRESET_FILE] if preset.is_file()), None)

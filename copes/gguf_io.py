"""GGUF in and out.

In: a `.gguf` file (any quantisation transformers reads, dequantised) loads as a dense model in the run's dtype, with
the tokenizer and chat template it carries; checkpoints of such a run are then plain Hugging Face folders.
Out: a model folder (a checkpoint, a replayed step) written as a GGUF of float32, float16 or bfloat16 tensors, in
llama.cpp's tensor names and layouts, with the pre-tokenizer llama.cpp is to split text with: llama.cpp runs it as
the model (bench/gguf_llama_cpp.py), and transformers reads it back (`gguf_file=`).
"""

from __future__ import annotations

import functools
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from copes.downloads import cache_dir
from copes.errors import UserError
from copes.user_code import sha256_of

GGUF_MAGIC = b"GGUF"
# --type of copes-export -> the GGUF tensor type of every matrix (norms and other 1-D tensors stay float32, which
# llama.cpp requires of them).
EXPORT_TYPES = ("f32", "f16", "bf16")
# The architectures copes-export writes: transformers' model_type -> llama.cpp's architecture name. Llama-style
# checkpoints rotate interleaved pairs in llama.cpp, so their q/k rows are permuted on the way out.
EXPORT_ARCHITECTURES = {"llama": "llama", "mistral": "llama", "qwen2": "qwen2", "qwen3": "qwen3"}
PERMUTED_ROTARY = {"llama"}
# llama.cpp's token types (llama_token_type): a vocabulary entry, a special (control) token, a user-added token.
NORMAL_TOKEN, CONTROL_TOKEN, USER_DEFINED_TOKEN = 1, 3, 4
# How a byte-level tokenizer splits text before its merges, as tokenizer.json spells it, -> the name llama.cpp gives
# the same split (`tokenizer.ggml.pre`; llama.cpp's llama-vocab.cpp runs these regexes). With any other name llama.cpp
# splits its own default way: "+" apart from the space before it, for one, so its tokens differ from the model's.
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
                r"|\s+(?!\S)|\s+")
_LLAMA3_SPLIT = _QWEN2_SPLIT.replace(r"|\p{N}|", r"|\p{N}{1,3}|")
LLAMA_CPP_PRE_TOKENIZERS = {
    ("gpt-2 regex",): "gpt-2",  # ByteLevel with its own (GPT-2) regex
    ("each digit", "gpt-2 regex"): "smollm",
    (_QWEN2_SPLIT, "bytes"): "qwen2",  # Qwen2, Qwen2.5, Qwen3
    (_LLAMA3_SPLIT, "bytes"): "llama-bpe",  # Llama 3
}


def is_gguf_path(model: str) -> bool:
    return model.lower().endswith(".gguf")


def read_gguf(path: Path) -> Any:
    """The file's reader, after checking it is a whole GGUF that transformers can read; else one sentence."""
    import gguf
    from transformers.modeling_gguf_pytorch_utils import GGUF_SUPPORTED_ARCHITECTURES

    if not path.is_file():
        raise UserError(f"model file {path} does not exist")
    with path.open("rb") as handle:
        if handle.read(4) != GGUF_MAGIC:
            raise UserError(f"model file {path} is not a GGUF file (it does not start with the GGUF magic bytes)")
    try:
        reader = gguf.GGUFReader(path)
        architecture = str(reader.fields["general.architecture"].contents())
    except (ValueError, KeyError, IndexError, OSError) as error:  # a cut file: offsets and shapes point past its end
        raise UserError(f"model file {path} is truncated or damaged ({type(error).__name__}: "
                        f"{str(error).splitlines()[0] if str(error) else 'unreadable header'})") from None
    if architecture not in GGUF_SUPPORTED_ARCHITECTURES:
        raise UserError(f"model file {path} holds a {architecture!r} model, which transformers cannot read from GGUF "
                        f"(it reads: {', '.join(sorted(GGUF_SUPPORTED_ARCHITECTURES))})")
    return reader


def load_gguf_config(path: Path) -> Any:
    """The model's transformers config, read from the file's metadata. transformers does not read a Qwen3 file's
    `attention.key_length` and falls back to Qwen3Config's head_dim of 128; the file's own value is taken here."""
    from transformers import AutoConfig

    reader = read_gguf(path)
    try:
        config = AutoConfig.from_pretrained(str(path.parent), gguf_file=path.name)
    except (ValueError, NotImplementedError, KeyError) as error:
        raise UserError(f"cannot read the config of model file {path}: {str(error).splitlines()[0]}") from None
    config.__dict__.pop("quantization_config", None)
    architecture = str(reader.fields["general.architecture"].contents())
    key_length = reader.fields.get(f"{architecture}.attention.key_length")
    if key_length is not None and hasattr(config, "head_dim"):
        config.head_dim = int(key_length.contents())
    return config


def load_gguf(path: Path, dtype: torch.dtype) -> tuple[torch.nn.Module, Any]:
    """(dense model in `dtype`, tokenizer with the file's chat template). transformers dequantises into float32 (asked
    for bfloat16 it keeps the tensors packed) and marks the model GGUF-quantised, which `save_pretrained` refuses; the
    model is rebuilt from its config around the same tensors, so checkpoints are plain folders."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    config = load_gguf_config(path)
    folder, name = str(path.parent), path.name
    try:
        tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
        unpacked = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, config=config, dtype=torch.float32)
    except (ValueError, NotImplementedError, KeyError) as error:
        raise UserError(f"cannot load model file {path}: {str(error).splitlines()[0]}") from None
    config.dtype = dtype
    model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    model.load_state_dict({key: value.to(dtype) for key, value in unpacked.state_dict().items()})
    model.generation_config = unpacked.generation_config
    return model, tokenizer


@functools.cache
def _digest(path: Path, size: int, modified_ns: int) -> str:
    return sha256_of(path)


def cached_folder(path: Path) -> Path:
    """Where the dense copy of the GGUF `path` lives in this machine's cache (keyed by its SHA-256, hashed once per
    process while the file is unchanged)."""
    stat = path.stat()
    return cache_dir() / "gguf" / _digest(path.resolve(), stat.st_size, stat.st_mtime_ns)[:32]


def check_gguf(path: Path) -> None:
    """`read_gguf`'s checks, skipped for a file whose dense copy is cached (it passed them when converted): parsing
    SmolLM2's vocabulary through gguf's reader took 5-19 s, and a run names its model several times."""
    if not path.is_file():
        raise UserError(f"model file {path} does not exist")
    if not (cached_folder(path) / "config.json").is_file():
        read_gguf(path)


def dense_folder(path: Path) -> Path:
    """The GGUF as a dense float32 model folder (config, safetensors, tokenizer with its chat template), converted
    once per machine into the cache: reading a GGUF through transformers parses its whole vocabulary in Python twice
    (config, then tokenizer), 30-100 s for SmolLM2 on two busy cores, against ~1 s for the folder."""
    check_gguf(path)
    folder = cached_folder(path)
    if (folder / "config.json").is_file():
        return folder
    model, tokenizer = load_gguf(path, torch.float32)
    staging = folder.with_name(f".{folder.name}.{os.getpid()}.partial")
    shutil.rmtree(staging, ignore_errors=True)
    model.save_pretrained(staging)
    tokenizer.save_pretrained(staging)
    try:
        os.replace(staging, folder)  # whole or absent; another process that converted first has won
    except OSError:
        shutil.rmtree(staging, ignore_errors=True)
    return folder


# ---------------------------------------------------------------- out


def _metadata(writer: Any, config: Any, architecture: str) -> None:
    """The hyperparameters llama.cpp reads for `architecture`, from the transformers config."""
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    rope = getattr(config, "rope_parameters", None) or {}
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_rope_freq_base(float(rope.get("rope_theta", getattr(config, "rope_theta", 10000.0))))
    writer.add_layer_norm_rms_eps(float(config.rms_norm_eps))
    writer.add_vocab_size(config.vocab_size)
    writer.add_rope_dimension_count(head_dim)
    if architecture != "llama":  # Qwen's head_dim need not be hidden_size / heads
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)


def _byte_level_spelling(token: str) -> str:
    """A token as a byte-level BPE vocabulary spells it (a space is 'Ġ'): GGUF's gpt2 tokenizer model stores that."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    spelling = bytes_to_unicode()
    alphabet = set(spelling.values())
    return token if set(token) <= alphabet else "".join(spelling[byte] for byte in token.encode("utf-8"))


def llama_cpp_pre_tokenizer(spec: dict[str, Any] | None) -> str | None:
    """llama.cpp's name for the split a tokenizer.json `pre_tokenizer` makes, or None when llama.cpp has none that
    splits text the same way."""
    if spec is None:
        return None
    steps = spec["pretokenizers"] if spec["type"] == "Sequence" else [spec]
    kinds = []
    for step in steps:
        if step["type"] == "ByteLevel" and not step.get("add_prefix_space", False):
            kinds.append("gpt-2 regex" if step.get("use_regex", True) else "bytes")
        elif step["type"] == "Digits" and step.get("individual_digits"):
            kinds.append("each digit")
        elif step["type"] == "Split" and step.get("behavior") == "Isolated" and not step.get("invert"):
            kinds.append(step["pattern"].get("Regex"))
        else:
            return None
    return LLAMA_CPP_PRE_TOKENIZERS.get(tuple(kinds))


def _tokenizer_metadata(writer: Any, tokenizer: Any) -> str | None:
    """The vocabulary as GGUF's byte-level BPE (`gpt2`) model: tokens in id order, their types, merges, the
    pre-tokenizer llama.cpp is to split text with, special ids and the chat template. A character-level (WordLevel)
    vocabulary is the same model without merges. Returns that pre-tokenizer's name, None where llama.cpp has none
    that splits as this tokenizer does (the file then names llama.cpp's default)."""
    import json

    spec = json.loads(tokenizer.backend_tokenizer.to_str())
    model = spec["model"]
    if model["type"] not in ("BPE", "WordLevel"):
        raise UserError(f"copes-export writes byte-level BPE tokenizers; this one is {model['type']}")
    added = {entry["id"]: entry for entry in spec.get("added_tokens", [])}
    by_id = {index: token for token, index in model["vocab"].items()} | {i: e["content"] for i, e in added.items()}
    size = max(by_id) + 1
    if sorted(by_id) != list(range(size)):
        raise UserError("copes-export needs a tokenizer whose ids run 0..N-1 without gaps")
    tokens, types = [], []
    for index in range(size):
        entry = added.get(index)
        if entry is None:
            tokens.append(by_id[index] if model["type"] == "BPE" else _byte_level_spelling(by_id[index]))
            types.append(NORMAL_TOKEN)
        else:
            tokens.append(entry["content"])
            types.append(CONTROL_TOKEN if entry["special"] else USER_DEFINED_TOKEN)
    merges = [merge if isinstance(merge, str) else " ".join(merge) for merge in model.get("merges", [])]
    pre_tokenizer = llama_cpp_pre_tokenizer(spec.get("pre_tokenizer"))
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre_tokenizer or "default")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_scores([0.0] * size)  # without merges, transformers derives them from the scores (none here)
    if merges:
        writer.add_token_merges(merges)
    for name, add in (("bos", writer.add_bos_token_id), ("eos", writer.add_eos_token_id),
                      ("unk", writer.add_unk_token_id), ("pad", writer.add_pad_token_id)):
        token_id = getattr(tokenizer, f"{name}_token_id")
        if token_id is not None:
            add(token_id)
    writer.add_add_bos_token(False)
    if tokenizer.chat_template:
        writer.add_chat_template(tokenizer.chat_template)
    return pre_tokenizer


def _permute_rotary_rows(weight: np.ndarray, heads: int) -> np.ndarray:
    """HF's rotate-half rows of a q/k projection in llama.cpp's interleaved order (its converter's `permute`)."""
    return weight.reshape(heads, 2, weight.shape[0] // heads // 2, *weight.shape[1:]).swapaxes(1, 2).reshape(
        weight.shape)


@dataclass(frozen=True)
class GGUFExport:
    """What `export_gguf` wrote: how many tensors, and the pre-tokenizer llama.cpp splits text with (None: llama.cpp
    has none that splits as the model's tokenizer does, so its tokens can differ; transformers reads the file as
    the model's tokenizer)."""

    tensors: int
    pre_tokenizer: str | None


def export_gguf(model_dir: Path, output: Path, tensor_type: str = "f32") -> GGUFExport:
    """Write the model folder `model_dir` as the GGUF `output`."""
    import gguf
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if tensor_type not in EXPORT_TYPES:
        raise UserError(f"--type must be one of {', '.join(EXPORT_TYPES)}, got {tensor_type!r}")
    if not (model_dir / "config.json").is_file():
        raise UserError(f"{model_dir} is not a model folder (no config.json)")
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    config = model.config
    architecture = EXPORT_ARCHITECTURES.get(config.model_type)
    if architecture is None:
        raise UserError(f"copes-export writes {', '.join(sorted(EXPORT_ARCHITECTURES))} models; {model_dir} holds a "
                        f"{config.model_type!r} model")
    arch_id = next(key for key, name in gguf.MODEL_ARCH_NAMES.items() if name == architecture)
    names = gguf.get_tensor_name_map(arch_id, config.num_hidden_layers)
    quant = {"f32": gguf.GGMLQuantizationType.F32, "f16": gguf.GGMLQuantizationType.F16,
             "bf16": gguf.GGMLQuantizationType.BF16}[tensor_type]
    output.parent.mkdir(parents=True, exist_ok=True)
    writer = gguf.GGUFWriter(str(output), architecture)
    writer.add_name(model_dir.name)
    writer.add_file_type({"f32": gguf.LlamaFileType.ALL_F32, "f16": gguf.LlamaFileType.MOSTLY_F16,
                          "bf16": gguf.LlamaFileType.MOSTLY_BF16}[tensor_type])
    _metadata(writer, config, architecture)
    pre_tokenizer = _tokenizer_metadata(writer, tokenizer)
    written = 0
    for hf_name, tensor in model.state_dict().items():
        if hf_name == "lm_head.weight" and config.tie_word_embeddings:
            continue  # the file ties the output layer to token_embd by leaving it out
        base, _, suffix = hf_name.rpartition(".")
        gguf_name = names.get_name(base)
        if gguf_name is None:
            raise UserError(f"copes-export has no GGUF name for tensor {hf_name} of the {architecture} model")
        data = tensor.detach().float().numpy()
        if architecture in PERMUTED_ROTARY and gguf_name.endswith((".attn_q", ".attn_k")):
            heads = config.num_attention_heads if gguf_name.endswith(".attn_q") else config.num_key_value_heads
            data = _permute_rotary_rows(data, heads)
        if data.ndim > 1 and quant != gguf.GGMLQuantizationType.F32:
            writer.add_tensor(f"{gguf_name}.{suffix}", gguf.quants.quantize(data, quant), raw_dtype=quant)
        else:
            writer.add_tensor(f"{gguf_name}.{suffix}", data)
        written += 1
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return GGUFExport(tensors=written, pre_tokenizer=pre_tokenizer)

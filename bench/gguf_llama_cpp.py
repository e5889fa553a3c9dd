"""llama.cpp runs a `copes-export` GGUF as the model it was written from: the same tokens for the same text, the same
next token at every position, and the same greedy answers.

For each --types, the model (--model: a folder, a GGUF file or a downloadable name; by default SmolLM2-135M-Instruct's
dense folder, converted once per machine) is exported with copes-export's writer and loaded in llama.cpp (the
llama-cpp-python package). transformers runs the reference: the folder in float32, its matrices rounded to the
export's type for f16 and bf16 (as the file holds them). Texts: --prompts held-out chat sums of docs/real-model.md
through the model's chat template, and one text that exercises the pre-tokenizer (runs of spaces and newlines,
digits, contractions, punctuation, accents, CJK and emoji). Per type it reports:

  texts_same_tokens   texts llama.cpp tokenizes exactly as the model's tokenizer does (the file's
                      tokenizer.ggml.pre, below, names the split llama.cpp makes before its merges)
  argmax_agree        positions, over every text, where both pick the same next token
  max_logit_diff      the largest |logit difference| anywhere, beside max_logit (the largest |logit|): llama.cpp
                      computes with its own kernels, so float32 agrees to rounding, not to the bit
  greedy_same         prompts whose --new-tokens greedy tokens (EOS ignored) are the same on both

    pip install llama-cpp-python          # builds llama.cpp (about 4 minutes on 2 cores)
    python bench/gguf_llama_cpp.py        # SmolLM2, f32 f16 bf16

Writes results/gguf_llama_cpp_<model>_<device>.csv.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from copes.gguf_io import EXPORT_TYPES, export_gguf
from copes.modeling import model_folder

from common.harness import machine_note, pin_one_thread, report

EVAL_FILE = Path(__file__).resolve().parent / "results" / "real_model" / "chat-sums" / "eval.jsonl"
TORCH_DTYPES = {"f32": torch.float32, "f16": torch.float16, "bf16": torch.bfloat16}
# Where pre-tokenizers differ: whitespace runs, digit groups, contractions, punctuation runs, non-Latin scripts.
PRE_TOKENIZER_TEXT = ("\n \n\n \t\t x  \n   y 3 33 333 3333 3.14 1,000 +7 -2*(4/5)=x I've he's 'RE we'LL "
                      "ok...!!?? ``` \"\"\" café naïve Привет 我想在apple工作1314天 🦙🚀 a\u200db end  ")


def reference_model(folder: Path, tensor_type: str) -> torch.nn.Module:
    """The folder's model in float32, with its matrices rounded to `tensor_type` as the export stores them."""
    model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    with torch.no_grad():
        for tensor in model.state_dict().values():
            if tensor.ndim > 1:
                tensor.copy_(tensor.to(TORCH_DTYPES[tensor_type]).float())
    return model


def hf_greedy(model: torch.nn.Module, ids: list[int], new_tokens: int) -> list[int]:
    generated: list[int] = []
    with torch.no_grad():
        out = model(torch.tensor([ids]), use_cache=True)
        for _ in range(new_tokens):
            generated.append(int(out.logits[0, -1].argmax()))
            out = model(torch.tensor([generated[-1:]]), past_key_values=out.past_key_values, use_cache=True)
    return generated


def llama_cpp_greedy(llm: object, ids: list[int], new_tokens: int) -> list[int]:
    llm.reset()
    llm.eval(ids)
    generated: list[int] = []
    for _ in range(new_tokens):
        generated.append(int(np.argmax(llm.scores[llm.n_tokens - 1])))
        llm.eval(generated[-1:])
    return generated


def compare(folder: Path, tokenizer: object, gguf_file: Path, tensor_type: str, texts: list[str], prompts: int,
            new_tokens: int) -> dict[str, object]:
    from llama_cpp import Llama

    written = export_gguf(folder, gguf_file, tensor_type)
    model = reference_model(folder, tensor_type)
    llm = Llama(str(gguf_file), logits_all=True, n_ctx=1024, n_threads=torch.get_num_threads(), verbose=False)
    same_tokens = argmax_agree = positions = greedy_same = 0
    max_diff = max_logit = 0.0
    for index, text in enumerate(texts):
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        same_tokens += llm.tokenize(text.encode(), add_bos=False, special=True) == ids
        llm.reset()
        llm.eval(ids)
        theirs = np.asarray(llm.scores[: len(ids)])
        with torch.no_grad():
            ours = model(torch.tensor([ids])).logits[0].numpy()
        argmax_agree += int((theirs.argmax(-1) == ours.argmax(-1)).sum())
        positions += len(ids)
        max_diff = max(max_diff, float(np.abs(theirs - ours).max()))
        max_logit = max(max_logit, float(np.abs(ours).max()))
        if index < prompts:
            greedy_same += llama_cpp_greedy(llm, ids, new_tokens) == hf_greedy(model, ids, new_tokens)
    llm.close()
    return {"type": tensor_type, "pre_tokenizer": written.pre_tokenizer, "texts": len(texts),
            "texts_same_tokens": same_tokens, "positions": positions, "argmax_agree": argmax_agree,
            "max_logit_diff": max_diff, "max_logit": max_logit, "prompts": prompts, "new_tokens": new_tokens,
            "greedy_same": greedy_same}


def chat_texts(tokenizer: object, count: int) -> list[str]:
    """The first `count` held-out chat sums, through the model's chat template, ready for the assistant's turn."""
    rows = [json.loads(line) for line in EVAL_FILE.read_text().splitlines()[:count]]
    return [tokenizer.apply_chat_template([{"role": "user", "content": row["prompt"]}], tokenize=False,
                                          add_generation_prompt=True) for row in rows]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m-instruct",
                        help="a model folder, a GGUF file or a downloadable model's name")
    parser.add_argument("--types", nargs="+", default=list(EXPORT_TYPES), choices=EXPORT_TYPES)
    parser.add_argument("--prompts", type=int, default=8, help="held-out chat sums compared")
    parser.add_argument("--new-tokens", type=int, default=32, help="greedy tokens compared per prompt")
    args = parser.parse_args(argv)
    pin_one_thread()
    started = time.perf_counter()
    folder = Path(model_folder(args.model))
    tokenizer = AutoTokenizer.from_pretrained(str(folder))
    texts = [*chat_texts(tokenizer, args.prompts), PRE_TOKENIZER_TEXT]
    with tempfile.TemporaryDirectory() as scratch:
        rows = [compare(folder, tokenizer, Path(scratch) / f"model-{tensor_type}.gguf", tensor_type, texts,
                        args.prompts, args.new_tokens) for tensor_type in args.types]
    report(f"gguf_llama_cpp_{Path(args.model).stem.lower()}", rows,
           f"copes-export's GGUF in llama.cpp vs the model in transformers, {args.model}; {machine_note()}; "
           f"{time.perf_counter() - started:.0f}s")


if __name__ == "__main__":
    main()

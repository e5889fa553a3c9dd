"""The dress rehearsal's model: a random bf16 Qwen3.5-4B at the released shape, in the released wrapper layout.

    python bench/common/rehearsal_model.py --out /work/4b

The text model is read from the config fixture (tests/fixtures/qwen3.5-4b); the vision tower, which the fixture
does not describe and which both rollout engines skip, is a 24-block ViT of width 1024 whose merger projects to the
text width. Built directly in bf16 (~9 GB of RAM, never the 18 GB an fp32 build would need) and saved once.

The tokenizer is the tests' byte-level BPE with the Qwen3.5-style chat template (XML tool calls): the released
tokenizer cannot be downloaded here. Two changes to the random weights, none to any shape: the embedding rows of ids
the tokenizer does not have are zero (so every sampled id decodes to text), and the row of `</tool_call>` is scaled
by STOP_ROW_SCALE, so the random model ends a turn on a tool call often enough for the agent to take tool turns.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch
from transformers import GenerationConfig, Qwen3_5Config, Qwen3_5ForConditionalGeneration

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tests"))
from helpers.tiny_models import build_tiny_tokenizer  # noqa: E402

FIXTURE = REPO / "tests" / "fixtures" / "qwen3.5-4b" / "config.json"
VISION_TOWER = dict(depth=24, hidden_size=1024, intermediate_size=4096, num_heads=16, patch_size=16,
                    spatial_merge_size=2, temporal_patch_size=2, num_position_embeddings=2304,
                    deepstack_visual_indexes=[])
DONE_MARK = "rehearsal-model.json"
STOP_TOKEN = "</tool_call>"
# Random logits are ~N(0, 1) over ~600 ids (their max ~3); a row scaled 4x wins a step about one time in five.
STOP_ROW_SCALE = 4.0
# The reduced width of the slow-lane test and the GPU check's CPU dry run: the same layer kinds (three gated delta-net
# layers, then full attention), every width small.
REDUCED_TEXT = dict(hidden_size=256, intermediate_size=512, num_hidden_layers=4, vocab_size=4096,
                    num_attention_heads=2, num_key_value_heads=1, head_dim=128, linear_num_key_heads=1,
                    linear_num_value_heads=2, layer_types=["linear_attention"] * 3 + ["full_attention"])


def rehearsal_config(*, text_overrides: dict | None = None) -> Qwen3_5Config:
    """The fixture's wrapper config (tied embeddings); `text_overrides` shrink the text model for the slow-lane
    test (counts and widths there are the test's, never the rehearsal's)."""
    fixture = json.loads(FIXTURE.read_text())
    text = dict(fixture["text_config"]) | (text_overrides or {})
    vision = VISION_TOWER | {"out_hidden_size": text["hidden_size"]}
    if text_overrides:
        vision |= dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=1, num_position_embeddings=16)
    top = {key: value for key, value in fixture.items() if key not in ("text_config", "architectures")}
    return Qwen3_5Config(text_config=text, vision_config=vision, **top)


def build_rehearsal_model(out: Path, *, seed: int = 0, text_overrides: dict | None = None,
                          device: str = "cpu") -> Path:
    """Builds and saves the random model to `out` (weights + config); returns `out`. Reuses a finished folder.
    `device`: where the random weights are drawn (a GPU draws 4B of them in seconds; other values than the CPU's)."""
    if (out / DONE_MARK).exists():
        return out
    tokenizer = build_tiny_tokenizer(Path(tempfile.mkdtemp()), chat_template="qwen35")
    eos, pad = tokenizer.convert_tokens_to_ids("<|im_end|>"), tokenizer.pad_token_id
    config = rehearsal_config(text_overrides=text_overrides)
    config.text_config.eos_token_id, config.text_config.pad_token_id = eos, pad
    started = time.perf_counter()
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.random.fork_rng(devices=[]), torch.device(device):
            torch.manual_seed(seed)
            model = Qwen3_5ForConditionalGeneration(config)
    finally:
        torch.set_default_dtype(previous)
    model = model.to(torch.bfloat16).eval()
    with torch.no_grad():  # tied: the input and output rows at once
        embedding = model.get_input_embeddings().weight
        embedding[len(tokenizer):] = 0
        embedding[tokenizer.convert_tokens_to_ids(STOP_TOKEN)] *= STOP_ROW_SCALE
    model.config.dtype = "bfloat16"
    model.generation_config = GenerationConfig(eos_token_id=eos, pad_token_id=pad)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    parameters = sum(p.numel() for p in model.parameters())
    (out / DONE_MARK).write_text(json.dumps({"parameters": parameters, "seed": seed,
                                             "build_seconds": round(time.perf_counter() - started, 1)}))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True, help="folder to save the model in (outside git trees)")
    args = parser.parse_args()
    print(build_rehearsal_model(args.out))


if __name__ == "__main__":
    main()

"""The Qwen3.5-4B (hybrid) and Qwen3-4B (full attention) fixtures' architectures at 1/10 width and 4 layers
(Qwen3.5: 3 gated delta-net + 1 full attention): the memory plan's tests and benches measure peaks on them."""

from __future__ import annotations

from pathlib import Path

from transformers import AutoConfig

from helpers.paths import FIXTURES

QWEN35, QWEN3 = FIXTURES / "qwen3.5-4b", FIXTURES / "qwen3-4b"
REDUCED = {
    "qwen3.5": (QWEN35, dict(hidden_size=256, intermediate_size=922, num_hidden_layers=4, num_attention_heads=4,
                             num_key_value_heads=1, head_dim=64, linear_num_key_heads=4, linear_num_value_heads=8,
                             linear_key_head_dim=32, linear_value_head_dim=32, vocab_size=4096)),
    "qwen3": (QWEN3, dict(hidden_size=256, intermediate_size=973, num_hidden_layers=4, num_attention_heads=8,
                          num_key_value_heads=2, head_dim=32, vocab_size=4096)),
}


def reduced(path: Path, **widths) -> AutoConfig:
    """`path`'s config with `widths` set on its text config, its layer types cut to the layers kept."""
    config = AutoConfig.from_pretrained(path)
    text = config.get_text_config()
    for name, value in widths.items():
        setattr(text, name, value)
    if getattr(text, "layer_types", None):
        text.layer_types = text.layer_types[: text.num_hidden_layers]
    return config

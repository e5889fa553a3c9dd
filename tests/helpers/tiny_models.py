"""Tiny real Hugging Face models for tests: a locally trained byte-level BPE tokenizer with a Qwen-style chat
template, a random-weight Qwen3 causal LM, and a scripted policy that speaks predetermined turns.

Nothing here touches the network. Every builder goes through the real save/load path the engine uses with
downloaded checkpoints (`save_pretrained` -> `AutoTokenizer` / `AutoModelForCausalLM.from_pretrained`).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    GenerationConfig,
    PreTrainedTokenizerFast,
    Qwen3Config,
    Qwen3ForCausalLM,
)

PAD_TOKEN = "<|endoftext|>"
EOS_TOKEN = "<|im_end|>"
SPECIAL_TOKENS = [PAD_TOKEN, "<|im_start|>", EOS_TOKEN]
# Qwen keeps these as added tokens that are NOT special, so decoding with skip_special_tokens keeps them.
MARKUP_TOKENS = ["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>", "<think>", "</think>"]

# A Qwen3-style ChatML template: a tools block in the system turn, `<tool_call>{json}</tool_call>` calls, tool
# results folded into a user turn as `<tool_response>` blocks.
QWEN_STYLE_TEMPLATE = r"""
{%- if tools %}
    {{- '<|im_start|>system\n' }}
    {%- if messages[0].role == 'system' %}
        {{- messages[0].content + '\n\n' }}
    {%- endif %}
    {{- '# Tools\n\nYou may call one or more functions to assist with the user query.\n\n' }}
    {{- 'You are provided with function signatures within <tools></tools> XML tags:\n<tools>' }}
    {%- for tool in tools %}
        {{- '\n' + (tool | tojson) }}
    {%- endfor %}
    {{- '\n</tools>\n\nFor each function call, return a json object with function name and arguments within ' }}
    {{- '<tool_call></tool_call> XML tags:\n<tool_call>\n{"name": <function-name>, ' }}
    {{- '"arguments": <args-json-object>}\n</tool_call><|im_end|>\n' }}
{%- elif messages[0].role == 'system' %}
    {{- '<|im_start|>system\n' + messages[0].content + '<|im_end|>\n' }}
{%- endif %}
{%- for message in messages %}
    {%- if message.role == 'user' or (message.role == 'system' and not loop.first) %}
        {{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>\n' }}
    {%- elif message.role == 'assistant' %}
        {{- '<|im_start|>assistant\n' + (message.content or '') }}
        {%- for call in message.tool_calls or [] %}
            {%- set fn = call.function if call.function is defined else call %}
            {{- '\n<tool_call>\n{"name": "' + fn.name + '", "arguments": ' }}
            {{- fn.arguments if fn.arguments is string else fn.arguments | tojson }}
            {{- '}\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\n' }}
    {%- elif message.role == 'tool' %}
        {%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\n<tool_response>\n' + message.content + '\n</tool_response>' }}
        {%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}
            {{- '<|im_end|>\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
{%- endif %}
"""

# A Qwen3.5-style template: tools block first in the system turn, XML calls
# (`<tool_call><function=name><parameter=key>value</parameter></function></tool_call>`), contents trimmed, and a
# generation prompt that opens a think block (closed at once when `enable_thinking` is false).
QWEN35_STYLE_TEMPLATE = r"""
{%- if tools %}
    {{- '<|im_start|>system\n# Tools\n\nYou have access to the following functions:\n\n<tools>' }}
    {%- for tool in tools %}
        {{- '\n' + (tool | tojson) }}
    {%- endfor %}
    {{- '\n</tools>\n\nTo call a function, reply with:\n<tool_call>\n<function=name>\n<parameter=key>\nvalue\n' }}
    {{- '</parameter>\n</function>\n</tool_call>' }}
    {%- if messages[0].role == 'system' %}
        {{- '\n\n' + messages[0].content | trim }}
    {%- endif %}
    {{- '<|im_end|>\n' }}
{%- elif messages[0].role == 'system' %}
    {{- '<|im_start|>system\n' + messages[0].content | trim + '<|im_end|>\n' }}
{%- endif %}
{%- for message in messages %}
    {%- set content = message.content | trim %}
    {%- if message.role == 'user' or message.role == 'assistant' %}
        {{- '<|im_start|>' + message.role + '\n' + content + '<|im_end|>\n' }}
    {%- elif message.role == 'tool' %}
        {%- if loop.previtem and loop.previtem.role != 'tool' %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\n<tool_response>\n' + content + '\n</tool_response>' }}
        {%- if loop.last or loop.nextitem.role != 'tool' %}
            {{- '<|im_end|>\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n<think>\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}
        {{- '\n</think>\n\n' }}
    {%- endif %}
{%- endif %}
"""

# Plain ChatML that silently ignores `tools` (like many older chat models): tool support must be detected.
PLAIN_CHATML_TEMPLATE = r"""
{%- for message in messages %}
    {{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>\n' }}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
{%- endif %}
"""

CHAT_TEMPLATES = {
    "qwen": QWEN_STYLE_TEMPLATE,
    "qwen35": QWEN35_STYLE_TEMPLATE,
    "plain": PLAIN_CHATML_TEMPLATE,
    None: None,
}

_CORPUS_LINES = [
    "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May.",
    "How many clips did Natalia sell altogether in April and May? She sold 48 / 2 = 24 clips in May.",
    "Weng earns $12 an hour for babysitting. Yesterday, she just did 50 minutes of babysitting.",
    "Let me compute this step by step. First, 12 / 60 = 0.2 dollars per minute, so 0.2 * 50 = 10.",
    "The final answer is <answer>\\boxed{72}</answer> and the other one is <answer>\\boxed{10}</answer>.",
    "Find the value of $x$ such that $\\frac{x}{3} + 2 = 5$. So $x = 9$ and we write \\boxed{9}.",
    "<python>print(sum(range(1, 101)))</python>\n<result>\n5050\n</result>",
    "<python>import math\nprint(math.comb(10, 3))</python>\n<result>\n120\n</result>",
    "<search>Which country is the Eiffel Tower in?</search>\n<result>\n"
    "Doc 1 (Title: Eiffel Tower) Paris, France\n</result>",
    '<tool_call>\n{"name": "python", "arguments": {"code": "print(2 ** 10)"}}\n</tool_call>',
    '<tool_call>\n{"name": "search", "arguments": {"query": "capital of Australia"}}\n</tool_call>',
    "<tool_response>\n1024\n</tool_response>\n"
    "<tool_response>\nCanberra is the capital city of Australia.\n</tool_response>",
    "<think>\nI should check the arithmetic with Python before answering.\n</think>",
    "Were Scott Derrickson and Ed Wood of the same nationality? Both were American film directors.",
    "def solve(n):\n    total = 0\n    for i in range(n):\n        total += i * i\n    return total\n",
    "Question: What is 37 + 485? Answer: 522. Question: What is 91 - 17? Answer: 74.",
    "You are a helpful assistant. Reason step by step and put the final answer in the answer tags.",
]


def _corpus() -> list[str]:
    # Arithmetic lines make the digit merges realistic; the hand-written lines cover prose, code and markup.
    arithmetic = [f"{a} + {b} = {a + b}, {a} * {b} = {a * b}" for a in range(3, 97, 7) for b in range(11, 400, 53)]
    return _CORPUS_LINES * 4 + arithmetic


# Qwen2's split before the byte-level step (its tokenizer.json's; Qwen2.5 and Qwen3 keep it).
QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
               r"|\s+(?!\S)|\s+")


def build_tiny_tokenizer(
    tmp_path: Path, *, chat_template: str | None = "qwen", vocab_size: int = 600, split: str = "gpt-2"
) -> PreTrainedTokenizerFast:
    """Train a byte-level BPE tokenizer (any text encodes, no UNK), save it, and load it back via AutoTokenizer.

    `chat_template`: "qwen" (Qwen3-style, JSON tool calls), "qwen35" (Qwen3.5-style, XML tool calls, think
    block), "plain" (ChatML that ignores tools) or None (no template). `split`: how text is split before the
    merges, "gpt-2" (GPT-2's regex) or "qwen2" (Qwen2's).
    """
    if chat_template not in CHAT_TEMPLATES:
        raise ValueError(f"chat_template must be one of {list(CHAT_TEMPLATES)}, got {chat_template!r}")
    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = {
        "gpt-2": pre_tokenizers.ByteLevel(add_prefix_space=False),
        "qwen2": pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(QWEN2_SPLIT), behavior="isolated"),
                                          pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]),
    }[split]
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    backend.train_from_iterator(_corpus(), trainer)
    backend.add_tokens([AddedToken(token, special=False, normalized=False) for token in MARKUP_TOKENS])
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        eos_token=EOS_TOKEN,
        pad_token=PAD_TOKEN,
        extra_special_tokens=["<|im_start|>"],
        chat_template=CHAT_TEMPLATES[chat_template],
        padding_side="left",
    )
    out_dir = Path(tmp_path) / f"tokenizer-{chat_template}-{split}"
    tokenizer.save_pretrained(out_dir)
    return AutoTokenizer.from_pretrained(out_dir)


# The strategy tests' model: hidden 32, 2 layers, 64-token vocabulary, tied embeddings.
SMALL_QWEN3 = dict(
    vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, head_dim=8, max_position_embeddings=64, tie_word_embeddings=True,
)


def tiny_qwen3(
    tokenizer: PreTrainedTokenizerFast | None = None, *, seed: int = 0, dtype: torch.dtype = torch.float32,
    **config: Any,
) -> Qwen3ForCausalLM:
    """The tests' one random-weight Qwen3 builder; `config` overrides Qwen3Config fields.

    Without a tokenizer: SMALL_QWEN3 (the strategy tests). With one: hidden 64, sized to it, its pad/eos ids in
    the config and the generation config, and logits wide enough for clear greedy argmaxes (generation tests).
    """
    settings: dict[str, Any] = dict(SMALL_QWEN3)
    if tokenizer is not None:
        settings.update(
            vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, head_dim=16, max_position_embeddings=4096,
            # Wider than the 0.02 default so random logits have clear argmaxes (no near-ties for greedy tests).
            initializer_range=0.2,
            pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id, bos_token_id=None,
        )
    settings.update(config)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Qwen3ForCausalLM(Qwen3Config(**settings)).to(dtype)
    if tokenizer is not None:
        model.generation_config = GenerationConfig(
            eos_token_id=[tokenizer.eos_token_id, tokenizer.pad_token_id], pad_token_id=tokenizer.pad_token_id
        )
    return model.eval()


def build_tiny_checkpoint(tmp_path: Path, *, seed: int = 0, chat_template: str | None = "qwen",
                          split: str = "gpt-2") -> Path:
    """Save a tiny tokenizer + random model into one directory, as a downloaded checkpoint would look."""
    tokenizer = build_tiny_tokenizer(tmp_path, chat_template=chat_template, split=split)
    model = tiny_qwen3(tokenizer, seed=seed)
    out_dir = Path(tmp_path) / "checkpoint"
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    return out_dir


def load_checkpoint(path: Path) -> tuple[Any, PreTrainedTokenizerFast]:
    return AutoModelForCausalLM.from_pretrained(path).eval(), AutoTokenizer.from_pretrained(path)


Script = Callable[[str], str]


class ScriptedPolicy:
    """A stand-in for a HF causal LM whose `generate` emits predetermined text: `script(prompt) -> reply`.

    It follows the HF `generate` contract the rollout code relies on: left-padded `input_ids` in, prompt + new
    tokens out, one token per step, a row stops at EOS or when a stopping criterion (stop strings, per-row
    limits) flags it, finished rows are filled with the pad token. Every call is logged: `calls` holds the
    decoded prompts of each batch (which rows were continued), `configs` the GenerationConfig it was given.
    """

    def __init__(self, tokenizer: PreTrainedTokenizerFast, script: Script) -> None:
        self.tokenizer = tokenizer
        self.script = script
        self.device = torch.device("cpu")
        self.generation_config = GenerationConfig(
            eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id
        )
        self.calls: list[list[str]] = []
        self.configs: list[GenerationConfig] = []

    def generate(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        generation_config: GenerationConfig,
        stopping_criteria: Any = (),
        **_: Any,
    ) -> torch.Tensor:
        prompts = [
            self.tokenizer.decode(ids[mask.bool()], skip_special_tokens=False)
            for ids, mask in zip(input_ids, attention_mask)
        ]
        self.calls.append(prompts)
        self.configs.append(generation_config)
        eos, pad = self.tokenizer.eos_token_id, generation_config.pad_token_id
        replies = [self.tokenizer.encode(self.script(prompt), add_special_tokens=False) + [eos] for prompt in prompts]
        sequences = input_ids
        unfinished = torch.ones(len(prompts), dtype=torch.bool)
        for step in range(generation_config.max_new_tokens):
            next_tokens = torch.tensor([reply[step] if step < len(reply) else eos for reply in replies])
            next_tokens = torch.where(unfinished, next_tokens, torch.full_like(next_tokens, pad))
            sequences = torch.cat([sequences, next_tokens[:, None]], dim=1)
            unfinished &= next_tokens != eos
            for criterion in stopping_criteria:
                unfinished &= ~criterion(sequences, None)
            if not unfinished.any():
                break
        return sequences

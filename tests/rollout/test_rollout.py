"""Batched generation on a tiny random-weight Qwen3, chat templates, and tool-call parsing."""

from __future__ import annotations

import re

import pytest
import torch

from copes.es.strategies import EGGROLL
from copes.modeling import load_model
from copes.rollout.generate import Generation, generate_batch, prompt_token_counts
from copes.rollout.hf_engine import SYNC_EVERY, HFEngine, decode_mode
from copes.rollout.templates import (
    ParsedCall,
    parse_tool_calls,
    render_prompt,
    resolve_tool_format,
    tag_results_suffix,
    tool_results_suffix,
    tool_stop_strings,
)
from copes.tools import BM25Search, PythonTool, SearchTool, tool_schema

from helpers.tiny_models import build_tiny_checkpoint, build_tiny_tokenizer, load_checkpoint, tiny_qwen3

PROMPTS = [
    "What is 37 + 485?",
    "Hi",
    "Natalia sold clips to 48 of her friends in April. <python>print(48 / 2)</python> so",
    "The final answer is",
]


class _SchemaOnlyTool:
    """A tool with a typed (non-string) argument, to check Qwen3.5 XML values are typed by the schema."""

    name = "lookup"
    description = "Look up a row."
    parameters = {
        "type": "object",
        "properties": {"row": {"type": "integer"}, "label": {"type": "string"}},
        "required": ["row"],
    }

    def call(self, arguments: dict) -> str:
        return str(arguments)


@pytest.fixture(scope="module")
def tools(tmp_path_factory):
    corpus = tmp_path_factory.mktemp("corpus") / "corpus.jsonl"
    corpus.write_text('{"id": "0", "title": "Paris", "text": "Paris is the capital of France."}\n')
    return [PythonTool(), SearchTool(BM25Search(corpus))]


# ---------------------------------------------------------------- generation


def test_batch_gives_each_prompt_its_single_prompt_greedy_output(model, tokenizer):
    batched = generate_batch(model, tokenizer, PROMPTS, max_new_tokens=12)
    alone = [generate_batch(model, tokenizer, [prompt], max_new_tokens=12)[0] for prompt in PROMPTS]
    assert batched == alone
    assert generate_batch(model, tokenizer, PROMPTS, max_new_tokens=12, batch_size=3) == alone
    lengths = prompt_token_counts(tokenizer, PROMPTS)
    assert len(set(lengths)) > 1, "prompts of different lengths are what exercises the left padding"
    assert all(g.num_tokens == 12 and g.finished_by == "length" and g.text for g in batched)


def test_per_row_token_limits_stop_each_row_at_its_own_limit(model, tokenizer):
    full = generate_batch(model, tokenizer, PROMPTS, max_new_tokens=10)
    limited = generate_batch(model, tokenizer, PROMPTS, max_new_tokens=[2, 10, 5, 1])
    assert [g.num_tokens for g in limited] == [2, 10, 5, 1]
    assert all(g.finished_by == "length" for g in limited)
    for short, long in zip(limited, full):
        assert long.text.startswith(short.text.rstrip("\ufffd"))  # a cut can split a multi-byte character


def _first_word(text: str) -> str | None:
    match = re.search(r"[A-Za-z]{3,}", text[2:])
    return match.group() if match else None


def test_stop_strings_stop_the_row_and_cut_the_text(model, tokenizer):
    full = generate_batch(model, tokenizer, PROMPTS, max_new_tokens=24)
    stops = [_first_word(g.text) for g in full]
    chosen = [(index, stop) for index, stop in enumerate(stops) if stop]
    assert len(chosen) >= 2, f"the random model's outputs hold too few words to pick stop strings: {full}"
    stop_strings = [stop for _, stop in chosen]
    stopped = generate_batch(model, tokenizer, PROMPTS, max_new_tokens=24, stop_strings=stop_strings)
    for row, generation in enumerate(stopped):
        cuts = [full[row].text.find(s) + len(s) for s in stop_strings if s in full[row].text]
        if cuts:
            assert generation.finished_by == "stop"
            assert generation.text == full[row].text[: min(cuts)]
            assert generation.num_tokens < 24
        else:
            assert generation == full[row]
    # Rows stop independently: the batch agrees with each prompt run alone.
    assert stopped == [
        generate_batch(model, tokenizer, [p], max_new_tokens=24, stop_strings=stop_strings)[0] for p in PROMPTS
    ]


def test_eos_ends_the_row_and_is_counted_but_not_decoded(tokenizer):
    model = tiny_qwen3(tokenizer, seed=0)
    encoded = tokenizer([PROMPTS[0]], return_tensors="pt")
    reference = model.generate(**encoded, max_new_tokens=12, do_sample=False)[
        0, encoded["input_ids"].shape[1] :
    ].tolist()
    eos = reference[4]
    model.generation_config.eos_token_id = [eos]
    first = reference.index(eos)
    (generation,) = generate_batch(model, tokenizer, [PROMPTS[0]], max_new_tokens=12)
    assert generation == Generation(tokenizer.decode(reference[:first], skip_special_tokens=True), first + 1, "eos")


def test_sampling_is_reproducible_from_the_seed_and_leaves_the_global_rng_alone(model, tokenizer):
    sample = {"max_new_tokens": 16, "greedy": False, "temperature": 1.5}
    torch.manual_seed(123)
    expected_next = torch.rand(3)
    torch.manual_seed(123)
    first = generate_batch(model, tokenizer, PROMPTS, seed=7, **sample)
    assert torch.equal(torch.rand(3), expected_next)
    assert generate_batch(model, tokenizer, PROMPTS, seed=7, **sample) == first
    assert generate_batch(model, tokenizer, PROMPTS, seed=8, **sample) != first
    assert first != generate_batch(model, tokenizer, PROMPTS, max_new_tokens=16)
    # A vanishing nucleus keeps only the top token: sampling collapses to greedy decoding.
    assert generate_batch(
        model, tokenizer, PROMPTS, max_new_tokens=16, greedy=False, top_p=1e-9, seed=1
    ) == generate_batch(model, tokenizer, PROMPTS, max_new_tokens=16)


def test_decoding_settings_are_not_inherited_from_the_checkpoint(model, tokenizer):
    greedy = generate_batch(model, tokenizer, PROMPTS, max_new_tokens=10)
    sampled = generate_batch(model, tokenizer, PROMPTS, max_new_tokens=10, greedy=False, temperature=1.5, seed=4)
    shipped = tiny_qwen3(tokenizer, seed=0)
    # A checkpoint that asks for sampling, and a top_k=1 that would turn any sampling into greedy decoding.
    shipped.generation_config.update(do_sample=True, temperature=0.7, top_k=1)
    assert generate_batch(shipped, tokenizer, PROMPTS, max_new_tokens=10) == greedy
    assert (
        generate_batch(shipped, tokenizer, PROMPTS, max_new_tokens=10, greedy=False, temperature=1.5, seed=4) == sampled
    )
    assert sampled != greedy


def test_checkpoint_loaded_through_auto_classes_generates_like_the_original(tmp_path):
    path = build_tiny_checkpoint(tmp_path, seed=3)
    loaded_model, loaded_tokenizer = load_checkpoint(path)
    original = tiny_qwen3(build_tiny_tokenizer(tmp_path), seed=3)
    expected = generate_batch(original, loaded_tokenizer, PROMPTS, max_new_tokens=8)
    assert generate_batch(loaded_model, loaded_tokenizer, PROMPTS, max_new_tokens=8) == expected


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_models_generate(tokenizer, dtype):
    model = tiny_qwen3(tokenizer, seed=0).to(dtype)
    generations = generate_batch(model, tokenizer, PROMPTS, max_new_tokens=[3, 6, 9, 12], greedy=False, seed=2)
    for generation, limit in zip(generations, [3, 6, 9, 12]):  # a sampled EOS may end a row early
        assert generation.num_tokens == limit if generation.finished_by == "length" else generation.num_tokens <= limit
    assert generations == generate_batch(model, tokenizer, PROMPTS, max_new_tokens=[3, 6, 9, 12], greedy=False, seed=2)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_generation_on_cuda(tokenizer):
    model = tiny_qwen3(tokenizer, seed=0).to("cuda")
    batched = generate_batch(model, tokenizer, PROMPTS, max_new_tokens=12, stop_strings=["answer"])
    assert batched == [
        generate_batch(model, tokenizer, [p], max_new_tokens=12, stop_strings=["answer"])[0] for p in PROMPTS
    ]
    state = torch.cuda.get_rng_state()
    sampled = generate_batch(
        model.to(torch.bfloat16), tokenizer, PROMPTS, max_new_tokens=[4, 8, 12, 16], greedy=False, seed=3
    )
    assert torch.equal(torch.cuda.get_rng_state(), state)  # the CUDA generator was forked, not consumed
    assert sampled == generate_batch(model, tokenizer, PROMPTS, max_new_tokens=[4, 8, 12, 16], greedy=False, seed=3)
    assert all(g.num_tokens <= limit for g, limit in zip(sampled, [4, 8, 12, 16]))


@pytest.mark.parametrize(
    "arguments, message",
    [
        ({"max_new_tokens": 0}, "max_new_tokens must be >= 1"),
        ({"max_new_tokens": [4, 4]}, "2 limits for 4 prompts"),
        ({"max_new_tokens": 4, "greedy": False, "temperature": 0.0}, "temperature must be > 0"),
        ({"max_new_tokens": 4, "top_p": 0.0}, "top_p must be in"),
        ({"max_new_tokens": 4, "batch_size": 0}, "batch_size must be >= 1"),
    ],
)
def test_generate_batch_rejects_bad_arguments(model, tokenizer, arguments, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        generate_batch(model, tokenizer, PROMPTS, **arguments)


# ---------------------------------------------------------------- templates


def test_render_prompt_with_qwen_tools(tokenizer, tools):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2 + 2?"}]
    assert resolve_tool_format(tokenizer) == "qwen"
    text = render_prompt(tokenizer, messages, tools)
    assert text.startswith("<|im_start|>system\nBe brief.\n\n# Tools")
    for tool in tools:  # the template itself renders each schema as JSON
        assert f'"name": "{tool.name}"' in text and tool.description in text
    assert text.endswith("<|im_start|>user\nWhat is 2 + 2?<|im_end|>\n<|im_start|>assistant\n")
    plain = render_prompt(tokenizer, messages)
    assert "# Tools" not in plain and plain.endswith("<|im_start|>assistant\n")
    assert tool_stop_strings("qwen", tools) == ("</tool_call>",)


def test_tool_results_suffix_matches_the_template_rendering(tokenizer, tools):
    messages = [{"role": "user", "content": "Compute."}]
    call = '<tool_call>\n{"name": "python", "arguments": {"code": "print(4)"}}\n</tool_call>'
    suffix = tool_results_suffix(tokenizer, ["4", "Doc 1 (Title: X) y"])
    assert suffix == (
        "<|im_end|>\n<|im_start|>user\n<tool_response>\n4\n</tool_response>\n"
        "<tool_response>\nDoc 1 (Title: X) y\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
    )
    conversation = [
        *messages,
        {"role": "assistant", "content": call},
        {"role": "tool", "content": "4"},
        {"role": "tool", "content": "Doc 1 (Title: X) y"},
    ]
    whole = tokenizer.apply_chat_template(
        conversation, tools=[tool_schema(t) for t in tools], add_generation_prompt=True, tokenize=False
    )
    assert render_prompt(tokenizer, messages, tools) + call + suffix == whole


@pytest.mark.parametrize("template", ["plain", None])
def test_templates_without_tool_support_fall_back_to_tags(tmp_path, template, tools):
    tokenizer = build_tiny_tokenizer(tmp_path, chat_template=template)
    assert resolve_tool_format(tokenizer) == "tags"
    with pytest.raises(ValueError, match="tool_format='qwen'"):
        resolve_tool_format(tokenizer, "qwen")
    text = render_prompt(tokenizer, [{"role": "user", "content": "What is 2 + 2?"}], tools)
    assert "<python>code</python>" in text and "<search>query</search>" in text and "<result>" in text
    assert "What is 2 + 2?" in text and "<tools>" not in text
    if template is None:
        assert text.endswith("User: What is 2 + 2?\n\nAssistant:")
    else:
        assert text.endswith("<|im_start|>assistant\n")
    assert tool_stop_strings("tags", tools) == ("</python>", "</search>")
    assert tag_results_suffix(["4"]) == "\n<result>\n4\n</result>\n"


def test_render_prompt_rejects_bad_arguments(tokenizer, tools):
    with pytest.raises(ValueError, match="tool_format must be one of"):
        render_prompt(tokenizer, [{"role": "user", "content": "x"}], tools, tool_format="json")
    with pytest.raises(ValueError, match="messages must hold"):
        render_prompt(tokenizer, [])


# ---------------------------------------------------------------- parsing


def test_parse_qwen_json_calls(tools):
    text = (
        'Let me check.\n<tool_call>\n{"name": "python", "arguments": {"code": "print(1)"}}\n</tool_call>'
        '<tool_call>{"name": "search", "arguments": "{\\"query\\": \\"Paris\\"}"}</tool_call> <tool_call>{"name": "py'
    )
    assert parse_tool_calls(text, "qwen", tools) == [
        ParsedCall("python", {"code": "print(1)"}),
        ParsedCall("search", {"query": "Paris"}),  # a JSON-encoded arguments string is decoded once more
    ]  # the unclosed third call was cut off mid-way: not a call


def test_parse_qwen35_xml_calls_types_values_by_schema(tools):
    tools = [*tools, _SchemaOnlyTool()]
    text = (
        "<tool_call>\n<function=python>\n<parameter=code>\nfor i in range(2):\n    print(i)\n</parameter>\n"
        "</function>\n</tool_call>"
        "<tool_call><function=lookup><parameter=row>12</parameter><parameter=label>007</parameter></function></tool_call>"
    )
    assert parse_tool_calls(text, "qwen", tools) == [
        ParsedCall("python", {"code": "for i in range(2):\n    print(i)"}),
        ParsedCall("lookup", {"row": 12, "label": "007"}),
    ]


@pytest.mark.parametrize(
    "body, name, error",
    [
        ('{"name": "python", "arguments": {"code": "x"', None, "not valid JSON"),
        ("[" * 100_000, None, "not valid JSON (nested too deeply)"),
        ('["python"]', None, "must be a JSON object"),
        (
            '{"name": "calculator", "arguments": {"x": 1}}',
            "calculator",
            "unknown tool 'calculator'; available: python, search",
        ),
        ('{"name": "python"}', "python", "has no 'arguments' object"),
        ('{"name": "python", "arguments": [1]}', "python", "must be a JSON object"),
        ('{"name": "python", "arguments": {"source": "x"}}', "python", "missing required argument(s): code"),
        ("<function=shell><parameter=cmd>ls</parameter></function>", "shell", "unknown tool 'shell'"),
        ("<function=python></function>", "python", "missing required argument(s): code"),
    ],
)
def test_parse_qwen_invalid_calls_come_back_marked_never_raised(body, name, error, tools):
    (call,) = parse_tool_calls(f"<tool_call>{body}</tool_call>", "qwen", tools)
    assert not call.valid and call.name == name and error in call.error


def test_parse_a_closing_tag_without_an_opening_one(tools):
    (call,) = parse_tool_calls('{"name": "python", "arguments": {"code": "1"}}</tool_call>', "qwen", tools)
    assert not call.valid and "without a matching <tool_call>" in call.error
    (call,) = parse_tool_calls("print(1)</python>", "tags", tools)
    assert not call.valid and call.name == "python"


def test_parse_tag_calls_in_text_order(tools):
    text = ("<search>capital of France</search> then <answer>x</answer> "
            "<python>\nfor i in range(2):\n    print(i)\n</python><python>  </python>")
    calls = parse_tool_calls(text, "tags", tools)
    assert calls[:2] == [
        ParsedCall("search", {"query": "capital of France"}),
        ParsedCall("python", {"code": "for i in range(2):\n    print(i)"}),  # indentation kept
    ]
    assert not calls[2].valid and "empty" in calls[2].error
    assert parse_tool_calls("no calls here <python>print(1)", "tags", tools) == []
    with pytest.raises(ValueError, match="fmt must be"):
        parse_tool_calls("x", "xml", tools)


def test_stop_strings_work_with_a_tokenizer_stop_string_criteria_cannot_preprocess():
    """The embedded tiny model's character vocabulary breaks transformers' StopStringCriteria ("substring not
    found"); stop strings still stop each row and cut its text there, as they do with a byte-level vocabulary."""
    tiny, tiny_tokenizer, _ = load_model("tiny", device="cpu", dtype="float32")
    prompts = ["12+7=", "305-49=", "8+8=", "77-9="]
    full = generate_batch(tiny, tiny_tokenizer, prompts, max_new_tokens=6)
    stop = max({g.text[:1] for g in full if g.text}, key=lambda s: sum(g.text.startswith(s) for g in full))
    stopped = generate_batch(tiny, tiny_tokenizer, prompts, max_new_tokens=6, stop_strings=[stop])
    for whole, cut in zip(full, stopped):
        if stop in whole.text:
            assert cut.finished_by == "stop" and cut.text == whole.text[: whole.text.find(stop) + len(stop)]
        else:
            assert cut == whole
    assert any(g.finished_by == "stop" for g in stopped)


# ---------------------------------------------------------------- the HF engine (copes.rollout.hf_engine)


def tiny_qwen35(tokenizer, *, seed: int = 0):
    """A random Qwen3.5 (three gated delta-net layers, then one attention layer) sized to `tokenizer`."""
    from transformers import GenerationConfig, Qwen3_5ForCausalLM, Qwen3_5TextConfig

    config = Qwen3_5TextConfig(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
        linear_value_head_dim=16, tie_word_embeddings=True, max_position_embeddings=4096, initializer_range=0.2,
        pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Qwen3_5ForCausalLM(config).eval()
    model.generation_config = GenerationConfig(
        eos_token_id=[tokenizer.eos_token_id, tokenizer.pad_token_id], pad_token_id=tokenizer.pad_token_id
    )
    return model


@pytest.mark.parametrize("bias", [False, True])
def test_the_widened_depthwise_conv_equals_torchs_bit_for_bit_in_bf16(bias):
    """The CPU conv1d the gated delta-net layers get (copes.modeling): at Qwen3.5-4B's 8192 conv channels, prefill
    (padding 3) and decode (a 4-wide window) shapes, the same bits as torch's slow bf16 kernel."""
    from copes.modeling import _conv1d_widening_depthwise

    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(8192, 1, 4, generator=generator).to(torch.bfloat16)
    bias_values = torch.randn(8192, generator=generator).to(torch.bfloat16) if bias else None
    for length, padding in ((37, 3), (4, 0)):
        x = torch.randn(3, 8192, length, generator=generator).to(torch.bfloat16)
        expected = torch.nn.functional.conv1d(x, weight, bias_values, padding=padding, groups=8192)
        widened = _conv1d_widening_depthwise(x, weight, bias_values, padding=padding, groups=8192)
        assert widened.dtype == torch.bfloat16 and torch.equal(widened, expected)


def test_a_bf16_qwen35_on_cpu_decodes_the_same_logits_with_the_widened_conv(tokenizer):
    """The HF engine widens the gated delta-net layers' conv1d (torch's bf16 depthwise kernel on a CPU was 97% of a
    4B decode step); generate's logits over prefill and cached decode keep every bit."""
    import transformers.models.qwen3_5.modeling_qwen3_5 as modeling

    from copes.modeling import _conv1d_widening_depthwise

    model = tiny_qwen35(tokenizer).to(torch.bfloat16)
    ids = torch.tensor([tokenizer("12+7=").input_ids])

    def logits() -> list[torch.Tensor]:
        out = model.generate(ids, max_new_tokens=4, do_sample=False, output_logits=True, return_dict_in_generate=True)
        return list(out.logits)

    seen = modeling.F
    try:
        modeling.F = torch.nn.functional  # torch's own kernel, whatever an earlier test widened
        expected = logits()
        HFEngine(model)
        assert modeling.F.conv1d is _conv1d_widening_depthwise
        widened = logits()
    finally:
        modeling.F = seen
    assert all(torch.equal(a, b) for a, b in zip(expected, widened, strict=True))


def test_the_cpu_output_layer_computes_on_rows_with_the_same_bits(tokenizer):
    """copes.modeling.fold_cpu_output_layer: the output layer multiplies a 2-D view of its input (at Qwen3.5-4B
    torch's CPU matmul took a prefill's last position through a batched oneDNN GEMM that copied the 1.2 GiB weight:
    +1.25 GiB high-water per prefill before, +0.09 GiB after, measured in docs/dress-rehearsal.md; that path needs
    the full size, so this test checks the bits), once, and a bf16 Qwen3.5's generate keeps every bit of its logits."""
    from copes.modeling import fold_cpu_output_layer

    model = tiny_qwen35(tokenizer).to(torch.bfloat16)
    ids = torch.tensor([tokenizer("12+7=").input_ids])

    def logits() -> list[torch.Tensor]:
        out = model.generate(ids, max_new_tokens=4, do_sample=False, output_logits=True, return_dict_in_generate=True)
        return list(out.logits)

    before = logits()
    fold_cpu_output_layer(model)
    assert model.lm_head.forward.__func__ is not torch.nn.Linear.forward
    assert all(torch.equal(a, b) for a, b in zip(before, logits(), strict=True))


@pytest.fixture(scope="module", params=["qwen3", "qwen35"])
def lm(request, model, tokenizer):
    """The tiny Qwen3 (attention KV) and the tiny Qwen3.5 (recurrent state + attention)."""
    return model if request.param == "qwen3" else tiny_qwen35(tokenizer)


class ForwardPositions:
    """Counts the input positions of every forward of a model (a forward pre-hook summing input_ids' sizes)."""

    def __init__(self, model) -> None:
        self.positions: list[int] = []
        self.widths: list[int] = []  # positions per row
        model.register_forward_pre_hook(self._count, with_kwargs=True)

    def _count(self, module, args, kwargs) -> None:
        self.positions.append(kwargs["input_ids"].numel())
        self.widths.append(kwargs["input_ids"].shape[1])

    def since(self, mark: int) -> int:
        return sum(self.positions[mark:])

    def prefilled_since(self, mark: int) -> int:
        """Positions of the forwards since `mark` that were not decodes (one position per row)."""
        return sum(p for p, width in zip(self.positions[mark:], self.widths[mark:]) if width > 1)


def _clean_stop(text: str) -> str:
    """Four characters of `text` that decode cleanly (no partial byte), at their first occurrence."""
    start = next(i for i in range(len(text) - 4) if "\ufffd" not in text[i : i + 4] and text[i : i + 4].strip())
    return text[start : start + 4]


@pytest.fixture(scope="module")
def char_tokenizer():
    """The embedded model's character-level tokenizer: every text has one tokenization, so a re-tokenized
    context always extends the tokens a row's cache holds, and the counts below are exact."""
    return load_model("tiny", device="cpu", dtype="float32")[1]


@pytest.fixture(scope="module", params=["qwen3", "qwen35"])
def char_lm(request, char_tokenizer):
    build = tiny_qwen3 if request.param == "qwen3" else tiny_qwen35
    return build(char_tokenizer, seed=1)


def _stopping_turn(engine, lm, tokenizer, prompt: str, row: int):
    """A first turn that ends on a stop string (as a tool call does), and that stop string."""
    full = generate_batch(lm, tokenizer, [prompt], max_new_tokens=12)[0].text
    stop = full[4:6]
    (first,) = engine.generate(tokenizer, [prompt], max_new_tokens=12, stop_strings=[stop], rows=[row])
    assert first.finished_by == "stop"
    return first, stop


def test_hf_engine_gives_generate_batch_greedy_tokens_with_chunked_prefill(lm, tokenizer):
    engine = HFEngine(lm, prefill_chunk_tokens=3)
    counter = ForwardPositions(lm)
    limits = [12, 5, 20, 9]
    generations = engine.generate(tokenizer, PROMPTS, max_new_tokens=limits)
    assert max(counter.widths) == 3  # no forward ran more than one chunk of prompt positions
    assert generations == generate_batch(lm, tokenizer, PROMPTS, max_new_tokens=limits)
    full = generate_batch(lm, tokenizer, PROMPTS, max_new_tokens=16)
    stops = [_clean_stop(full[2].text), "</python>"]
    stopped = engine.generate(tokenizer, PROMPTS, max_new_tokens=16, stop_strings=stops)
    assert stopped == generate_batch(lm, tokenizer, PROMPTS, max_new_tokens=16, stop_strings=stops)
    assert stopped[2].finished_by == "stop"


def test_hf_engine_on_the_embedded_model_gives_generate_batch_greedy_tokens():
    tiny, tiny_tokenizer, _ = load_model("tiny", device="cpu", dtype="float32")
    prompts = ["12+7=", "305-49=", "8+8=", "77-9=", "1000-999="]
    limits = [6, 2, 9, 4, 7]
    reference = generate_batch(tiny, tiny_tokenizer, prompts, max_new_tokens=limits)
    assert HFEngine(tiny, prefill_chunk_tokens=2).generate(tiny_tokenizer, prompts, max_new_tokens=limits) == reference


@pytest.mark.parametrize("decode", ["eager", "static"])
def test_a_second_turn_prefills_only_its_new_tokens(char_lm, char_tokenizer, decode):
    engine, counter = HFEngine(char_lm, decode=decode), ForwardPositions(char_lm)
    prompt = "305-49=256\n12+7=19\n1000-999="
    engine.start_rollout()
    first, stop = _stopping_turn(engine, char_lm, char_tokenizer, prompt, row=0)
    context = prompt + first.text + "\n=24\n8*3="  # an observation and the next prompt
    mark = len(counter.positions)
    (second,) = engine.generate(char_tokenizer, [context], max_new_tokens=10, stop_strings=[stop], rows=[0])
    prefilled = counter.prefilled_since(mark)
    first_len, context_len = prompt_token_counts(char_tokenizer, [prompt, context])
    # The cache holds the prompt and every generated token but the last, which was never fed.
    assert prefilled == context_len - (first_len + first.num_tokens - 1)
    assert second == generate_batch(char_lm, char_tokenizer, [context], max_new_tokens=10, stop_strings=[stop])[0]
    # A new rollout forgets every row: the same call prefills the whole context.
    engine.start_rollout()
    mark = len(counter.positions)
    assert engine.generate(char_tokenizer, [context], max_new_tokens=10, stop_strings=[stop], rows=[0]) == [second]
    assert counter.prefilled_since(mark) == context_len


def test_a_last_turn_reuses_its_cache_but_keeps_none(char_lm, char_tokenizer):
    """Guards #53: the agent's last turn (`keep=False`) still continues from the row's kept cache, but clones
    nothing for a turn that never comes (the clones held up to the whole final context beside the call's store)."""
    engine, counter = HFEngine(char_lm), ForwardPositions(char_lm)
    prompt = "305-49=256\n12+7=19\n1000-999="
    engine.start_rollout()
    first, stop = _stopping_turn(engine, char_lm, char_tokenizer, prompt, row=0)
    assert set(engine._states) == {0}
    context = prompt + first.text + "\n12+7="
    ends = [stop, _clean_stop(generate_batch(char_lm, char_tokenizer, [context], max_new_tokens=10)[0].text)]
    mark = len(counter.positions)
    (last,) = engine.generate(char_tokenizer, [context], max_new_tokens=10, stop_strings=ends, rows=[0], keep=False)
    first_len, context_len = prompt_token_counts(char_tokenizer, [prompt, context])
    assert counter.since(mark) - (last.num_tokens - 1) == context_len - (first_len + first.num_tokens - 1)
    assert last.finished_by == "stop" and engine._states == {}


def test_the_static_decode_gives_the_eager_decodes_tokens(lm, tokenizer):
    """#53: the static decode (what auto runs on CUDA: every row in every forward on the whole preallocated store,
    tokens read by the host every SYNC_EVERY steps) gives today's eager tokens, greedy, rows of different prompt
    lengths ending on their limits, a stop string and EOS, with decodes longer than one read."""
    counter = ForwardPositions(lm)
    assert min(prompt_token_counts(tokenizer, PROMPTS)) > 1  # a forward of one position per row is a decode
    limits = [2, SYNC_EVERY + 9, 9, 4]
    full = generate_batch(lm, tokenizer, PROMPTS, max_new_tokens=16)
    for stops in ((), [_clean_stop(full[2].text), "</python>"]):
        mark = len(counter.positions)
        static = HFEngine(lm, decode="static").generate(tokenizer, PROMPTS, max_new_tokens=limits, stop_strings=stops)
        decodes = {p for p, width in zip(counter.positions[mark:], counter.widths[mark:]) if width == 1}
        assert decodes == {len(PROMPTS)}  # every row in every decode forward: fixed shapes
        eager = HFEngine(lm, decode="eager").generate(tokenizer, PROMPTS, max_new_tokens=limits, stop_strings=stops)
        assert static == eager
    assert eager[2].finished_by == "stop"
    # EOS: a token row 3 generates midway (its own ids, so each engine ends rows on the same rule).
    ids = [tokenizer(prompt).input_ids for prompt in PROMPTS]
    eos = {HFEngine(lm, decode="eager").generate_ids(ids, limits, eos=set())[3][2]}
    ended = HFEngine(lm, decode="static").generate_ids(ids, limits, eos=eos)
    assert ended == HFEngine(lm, decode="eager").generate_ids(ids, limits, eos=eos)
    assert len(ended[3]) == 3


def test_the_static_decode_keeps_the_eager_decodes_caches(char_lm, char_tokenizer):
    """#53: a row ending on a stop string keeps what the eager decode keeps: its context's keys and values and, on
    Qwen3.5, its recurrent states as of its last fed token (the static decode's rows run on past their end until
    the host reads their tokens; a tiny random model's next turn barely feels a stale state, so compare them)."""
    prompt = "305-49=256\n12+7=19\n1000-999="
    kept = []
    for decode in ("eager", "static"):
        engine = HFEngine(char_lm, decode=decode)
        _stopping_turn(engine, char_lm, char_tokenizer, prompt, row=0)
        kept.append(engine._states[0])
    (eager_ids, eager), (static_ids, static) = kept
    assert static_ids == eager_ids
    for ours, theirs in zip(static.layers, eager.layers):
        names = ("keys", "values") if hasattr(theirs, "keys") else ("conv_states", "recurrent_states")
        for name in names:
            a, b = getattr(ours, name), getattr(theirs, name)
            for x, y in zip(a.values(), b.values()) if isinstance(a, dict) else [(a, b)]:
                assert x.shape == y.shape and torch.allclose(x, y, atol=1e-6), name


def test_auto_decodes_statically_with_cuda_graphs_on_cuda_only():
    """#53: the decode loop auto picks (CUDA launches, not compute, are a GPU's cost; a CPU's is the compute)."""
    assert decode_mode("cuda", "sdpa", row_context=False) == "graphs"
    assert decode_mode("cuda:0", "sdpa", row_context=True) == "static"  # a row_context's routing is Python
    assert decode_mode("cpu", "sdpa", row_context=False) == "eager"
    assert decode_mode("cuda", "eager", row_context=False) == "eager"  # the static mask is sdpa's boolean form
    assert decode_mode("cpu", "sdpa", row_context=False, mode="static") == "static"
    for device, attention, mode, message in (("cpu", "sdpa", "graphs", "needs a CUDA device"),
                                             ("cuda", "eager", "static", "needs sdpa attention"),
                                             ("cuda", "sdpa", "fast", "decode must be one of")):
        with pytest.raises(ValueError, match=message):
            decode_mode(device, attention, row_context=False, mode=mode)


def test_finished_rows_stop_costing_compute(lm, tokenizer):
    counter = ForwardPositions(lm)
    limits = [2, 25, 9, 4]
    generations = HFEngine(lm).generate(tokenizer, PROMPTS, max_new_tokens=limits)
    assert [g.num_tokens for g in generations] == limits
    # Each prompt once, then one position per row per token it still needs: no padding, no finished row.
    assert sum(counter.positions) == sum(prompt_token_counts(tokenizer, PROMPTS)) + sum(limit - 1 for limit in limits)


def test_fresh_rows_of_an_attention_model_prefill_packed_without_padding(lm, tokenizer):
    """Qwen3: fresh rows share prefill forwards of at most prefill_chunk_tokens positions (each row attending only
    to itself), with no pad position; Qwen3.5 (a delta-net state must see no other row): one row per forward."""
    counts = prompt_token_counts(tokenizer, PROMPTS)
    chunk = counts[0] + counts[1]
    assert counts[2] > chunk  # row 2 is prefilled alone, in chunks; row 3 does not fit beside rows 0 and 1
    engine, counter = HFEngine(lm, prefill_chunk_tokens=chunk), ForwardPositions(lm)
    limits = [3, 7, 5, 6]
    generations = engine.generate(tokenizer, PROMPTS, max_new_tokens=limits)
    positions = list(counter.positions)
    assert generations == generate_batch(lm, tokenizer, PROMPTS, max_new_tokens=limits)
    row_2 = [min(chunk, counts[2] - start) for start in range(0, counts[2], chunk)]
    packed = [chunk] if lm.config.model_type == "qwen3" else counts[:2]
    prefills = [*packed, *row_2, counts[3]]
    assert positions[: len(prefills)] == prefills
    # Then one position per row per token it still needs: no padding, no finished row.
    assert positions[len(prefills) :] == [sum(limit > step for limit in limits) for step in range(1, max(limits))]


def test_a_context_that_does_not_extend_the_cache(char_lm, char_tokenizer):
    """Attention KV is cropped to the common prefix; a recurrent state cannot be, so the row prefills afresh."""
    engine, counter = HFEngine(char_lm), ForwardPositions(char_lm)
    prompt = "305-49=256\n12+7=19\n1000-999="
    first, _ = _stopping_turn(engine, char_lm, char_tokenizer, prompt, row=3)
    edited = prompt[:12] + "8*8=64\n" + first.text  # diverges after 12 cached tokens
    mark = len(counter.positions)
    (again,) = engine.generate(char_tokenizer, [edited], max_new_tokens=8, rows=[3])
    prefilled, whole = counter.since(mark) - (again.num_tokens - 1), prompt_token_counts(char_tokenizer, [edited])[0]
    assert prefilled == (whole if char_lm.config.model_type == "qwen3_5_text" else whole - 12)
    assert again == generate_batch(char_lm, char_tokenizer, [edited], max_new_tokens=8)[0]


@pytest.mark.parametrize("decode", ["eager", "static"])
def test_hf_engine_sampling_is_seeded_and_leaves_the_global_rng_alone(model, tokenizer, decode):
    engine = HFEngine(model, decode=decode)
    sample = {"max_new_tokens": 12, "greedy": False, "temperature": 1.5, "top_p": 0.9}
    torch.manual_seed(5)
    expected_next = torch.rand(2)
    torch.manual_seed(5)
    first = engine.generate(tokenizer, PROMPTS, seed=3, **sample)
    assert torch.equal(torch.rand(2), expected_next)
    assert engine.generate(tokenizer, PROMPTS, seed=3, **sample) == first
    assert engine.generate(tokenizer, PROMPTS, seed=4, **sample) != first
    nucleus_of_one = engine.generate(tokenizer, PROMPTS, max_new_tokens=12, greedy=False, top_p=1e-9, seed=1)
    assert nucleus_of_one == engine.generate(tokenizer, PROMPTS, max_new_tokens=12)


@pytest.mark.parametrize("decode", ["eager", "static"])  # static: what CUDA runs under a row_context
def test_hf_engine_routes_every_forward_to_its_rows_members(model, tokenizer, decode):
    """Under EGGROLL each forward's rows see their own member's weights: the same tokens as `generate_batch`
    with the whole batch routed at once."""
    es = EGGROLL(model, population=3, sigma=0.3, lr=0.01, rank=2, seed=1)
    member_of_row = torch.tensor([2, 0, 1, 2])
    limits = [3, 11, 6, 8]
    outputs = {}

    def fitness(m, row_members):
        context = lambda rows: row_members(member_of_row[rows])  # noqa: E731
        outputs["engine"] = HFEngine(m, decode=decode).generate(tokenizer, PROMPTS, max_new_tokens=limits,
                                                                rows=[0, 1, 2, 3], row_context=context)
        with row_members(member_of_row):
            outputs["reference"] = generate_batch(m, tokenizer, PROMPTS, max_new_tokens=limits)
        return torch.zeros(3)

    es.evaluate(fitness)
    assert outputs["engine"] == outputs["reference"]
    assert outputs["engine"] != generate_batch(model, tokenizer, PROMPTS, max_new_tokens=limits)


def test_the_hf_engine_on_cuda_asks_the_allocator_for_expandable_segments(monkeypatch):
    """Guards #35: the HF engine's stores and kept caches come in many sizes; the CUDA allocator now grows
    segments in place (expandable_segments) unless the user set PYTORCH_CUDA_ALLOC_CONF, and only on CUDA."""
    import copes.rollout.engine as engine_module

    asked: list[str] = []
    monkeypatch.setattr(torch.cuda.memory, "_set_allocator_settings", asked.append)
    monkeypatch.setattr(engine_module, "load_model", lambda *args, **kwargs: (None, None, torch.device("cpu")))
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
    engine_module.load_rollout_model("tiny", engine="hf", device="cpu")
    assert asked == []
    engine_module.load_rollout_model("tiny", engine="hf", device="cuda:1")
    assert asked == ["expandable_segments:True"]
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:False")
    engine_module.load_rollout_model("tiny", engine="hf", device="cuda")
    assert asked == ["expandable_segments:True"]

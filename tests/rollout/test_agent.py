"""The multi-turn agent loop: scripted policies (predetermined turns through the real generate path) check
tool observations, budgets, which rows continue, row_context batches and truncation; the tiny random-weight
Qwen3 runs it end to end with the real Python sandbox and BM25 search."""

from __future__ import annotations

import contextlib
import json

import pytest

from copes.config.components import task_corpus
from copes.rollout.agent import AgentConfig, Trajectory, run_agent
from copes.rollout.engine import attach_engine
from copes.rollout.generate import generate_batch, prompt_token_counts
from copes.rollout.templates import render_prompt, tool_results_suffix
from copes.tasks import get_task
from copes.tools import BM25Search, PythonTool, SearchTool

from helpers.datadir import DATA_DIR
from helpers.tiny_models import ScriptedPolicy, build_tiny_tokenizer

DATA = DATA_DIR
QWEN_TURN_MARKER = "<tool_response>"
TAG_TURN_MARKER = "\n<result>\n"


@pytest.fixture(scope="module")
def tools(tmp_path_factory):
    corpus = tmp_path_factory.mktemp("corpus") / "corpus.jsonl"
    passages = [
        {"id": "0", "title": "Canberra", "text": "Canberra is the capital city of Australia."},
        {"id": "1", "title": "Paris", "text": "Paris is the capital and largest city of France."},
    ]
    corpus.write_text("".join(json.dumps(passage) + "\n" for passage in passages))
    return [PythonTool(), SearchTool(BM25Search(corpus), top_k=1)]


def call(name: str, **arguments: str) -> str:
    return "<tool_call>\n" + json.dumps({"name": name, "arguments": arguments}) + "\n</tool_call>"


def scripted(tokenizer, replies: dict[str, list[str]], marker: str = QWEN_TURN_MARKER) -> ScriptedPolicy:
    """Row `key` answers replies[key][t] on its turn t (counted by the tool results already in its context)."""

    def script(prompt: str) -> str:
        key = next(key for key in replies if key in prompt)
        turns = replies[key]
        return turns[min(prompt.count(marker), len(turns) - 1)]

    return ScriptedPolicy(tokenizer, script)


class RowLog:
    """A row_context that records the row indices of every generate batch."""

    def __init__(self) -> None:
        self.batches: list[list[int]] = []

    @contextlib.contextmanager
    def __call__(self, indices: list[int]):
        self.batches.append(list(indices))
        yield


def assert_batches_match_rows(policy: ScriptedPolicy, log: RowLog, keys: list[str]) -> None:
    """Each generate call saw exactly the rows row_context announced, in that order."""
    assert len(policy.calls) == len(log.batches)
    for prompts, indices in zip(policy.calls, log.batches):
        assert [next(key for key in keys if key in prompt) for prompt in prompts] == [keys[i] for i in indices]


@pytest.mark.parametrize("tool_workers", [1, 8])
def test_scripted_rollout_runs_tools_and_continues_only_active_rows(tokenizer, tools, tool_workers):
    keys = ["[row0]", "[row1]", "[row2]", "[row3]"]
    final = "So the answer is <answer>\\boxed{42}</answer>."
    replies = {
        "[row0]": [call("python", code="print(6 * 7)"), final],
        "[row1]": [final],
        "[row2]": [
            '<tool_call>\n{"name": "python", "arguments": {"code": "print(1)"\n</tool_call>',
            call("calculator", expression="6*7"),
            '<tool_call>{"name": "python"}</tool_call>',
            final,
        ],
        "[row3]": [call("search", query="capital of Australia")] * 5 + [final],
    }
    policy, log = scripted(tokenizer, replies), RowLog()
    config = AgentConfig(max_new_tokens=64, tool_workers=tool_workers)
    trajectories = run_agent(
        policy, tokenizer, keys, tools=tools, config=config, system_prompt="Be brief.", row_context=log
    )

    assert log.batches == [[0, 1, 2, 3], [0, 2, 3], [2, 3], [2, 3], [3], [3]]
    assert_batches_match_rows(policy, log, keys)
    assert [t.num_turns for t in trajectories] == [2, 1, 4, 6]
    assert all(t.finished_by == "eos" and t.final_text == final and not t.truncated for t in trajectories)
    assert [t.used_tool for t in trajectories] == [True, False, False, True]

    row0, row1, row2, row3 = trajectories
    (python_call,) = row0.tool_calls
    assert (python_call.name, python_call.arguments, python_call.valid, python_call.observation) == (
        "python",
        {"code": "print(6 * 7)"},
        True,
        "42",
    )
    assert row0.completion == replies["[row0]"][0] + tool_results_suffix(tokenizer, ["42"]) + final
    assert row0.prompt == render_prompt(
        tokenizer, [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "[row0]"}], tools
    )
    # Tokens: each turn's reply, plus the EOS of the final turn (a tool-call turn ends on its stop string).
    reply_tokens = [len(tokenizer.encode(text, add_special_tokens=False)) for text in replies["[row0]"]]
    assert row0.generated_tokens == sum(reply_tokens) + 1

    assert row1.completion == final and row1.tool_calls == []
    errors = [record.observation for record in row2.tool_calls]
    assert not any(record.valid for record in row2.tool_calls)
    assert "not valid JSON" in errors[0] and "unknown tool 'calculator'" in errors[1] and "no 'arguments'" in errors[2]
    assert all(error.startswith("Error: ") and error in row2.completion for error in errors)

    observations = [record.observation for record in row3.tool_calls]
    assert [record.valid for record in row3.tool_calls] == [True, True, True, False, False]
    assert observations[0] == "Doc 1 (Title: Canberra) Canberra is the capital city of Australia."
    assert observations[3] == "Error: the search budget of 3 calls is used up; continue without it."


def test_budgets_are_per_row_and_per_tool(tokenizer, tools):
    replies = {
        "[a]": [call("python", code="print(1)")] * 4 + ["done"],
        "[b]": [call("python", code="print(2)")] * 3 + ["done"],
        "[c]": [call("search", query="Paris")] * 4 + ["done"],
    }
    config = AgentConfig(budgets={"python": 2}, max_new_tokens=64)
    a, b, c = run_agent(scripted(tokenizer, replies), tokenizer, list(replies), tools=tools, config=config)
    assert [r.valid for r in a.tool_calls] == [True, True, False, False]
    assert [r.valid for r in b.tool_calls] == [True, True, False]  # row b has its own two python calls
    assert [r.valid for r in c.tool_calls] == [True] * 4  # no search budget given: only max_turns limits it
    assert a.tool_calls[0].observation == "1" and b.tool_calls[1].observation == "2"


def test_rows_still_calling_tools_end_at_max_turns(tokenizer, tools):
    replies = {"[loop]": [call("python", code="print(0)")], "[quick]": ["fine"]}
    config = AgentConfig(max_turns=3, budgets={}, max_new_tokens=64)
    looping, quick = run_agent(scripted(tokenizer, replies), tokenizer, list(replies), tools=tools, config=config)
    assert (looping.finished_by, looping.num_turns, len(looping.tool_calls), looping.truncated) == (
        "max_turns",
        3,
        3,
        False,
    )
    assert looping.final_text == replies["[loop]"][0]
    assert (quick.finished_by, quick.num_turns) == ("eos", 1)


def test_context_limit_ends_rows_cleanly(tokenizer, tools):
    long_answer = " ".join(f"step {i} adds {i * 7}" for i in range(60))
    replies = {
        "[long-prompt]": ["never generated"],
        "[big-output]": [call("python", code="print('x' * 1500)"), "never generated"],
        "[long-answer]": [long_answer],
        "[short]": ["ok"],
    }
    keys = list(replies)
    questions = [f"{keys[0]} {'filler words ' * 200}", *keys[1:]]
    prompt_lengths = prompt_token_counts(
        tokenizer, [render_prompt(tokenizer, [{"role": "user", "content": q}], tools) for q in questions]
    )
    limit = max(prompt_lengths[1:]) + 60
    assert prompt_lengths[0] > limit
    policy, log = scripted(tokenizer, replies), RowLog()
    # An observation budget above the 1500 tokens of [big-output]'s result: this test is about the context limit.
    config = AgentConfig(max_context_tokens=limit, max_new_tokens=512, max_observation_tokens=2000)
    long_prompt, big_output, long_reply, short = run_agent(
        policy, tokenizer, questions, tools=tools, config=config, row_context=log
    )

    # The over-long row never reaches the model; [big-output]'s tool result leaves it no room for a second turn.
    assert log.batches == [[1, 2, 3]]
    assert (long_prompt.finished_by, long_prompt.truncated, long_prompt.num_turns, long_prompt.completion) == (
        "context",
        True,
        0,
        "",
    )
    assert (big_output.finished_by, big_output.truncated, big_output.num_turns) == ("context", True, 1)
    assert big_output.tool_calls[0].valid and big_output.tool_calls[0].observation == "x" * 1500
    room = limit - prompt_lengths[2]
    assert (long_reply.finished_by, long_reply.truncated, long_reply.generated_tokens) == ("context", True, room)
    assert long_answer.startswith(long_reply.completion.rstrip("\ufffd"))
    assert (short.finished_by, short.truncated) == ("eos", False)


def test_batch_size_splits_generate_calls_in_row_order(tokenizer, tools):
    keys = [f"[r{i}]" for i in range(5)]
    replies = {key: ["answer"] for key in keys}
    replies["[r1]"] = replies["[r3]"] = [call("python", code="print(3)"), "answer"]
    policy, log = scripted(tokenizer, replies), RowLog()
    run_agent(
        policy, tokenizer, keys, tools=tools, config=AgentConfig(batch_size=2, max_new_tokens=64), row_context=log
    )
    assert log.batches == [[0, 1], [2, 3], [4], [1, 3]]
    assert_batches_match_rows(policy, log, keys)



class CacheKeepingEngine:
    """An engine that keeps, as the HF engine does, the cache of every row that stopped on a tool call until that
    row's next generate call (or `start_rollout`), and records the most caches it ever held at once."""

    keeps_row_caches = True

    def __init__(self, policy: ScriptedPolicy) -> None:
        self.policy, self.kept, self.most_kept, self.batches, self.keeps = policy, set(), 0, [], []

    def start_rollout(self) -> None:
        self.kept.clear()

    def generate(self, tokenizer, prompts, *, rows, keep=True, row_context=None, seed=None, **options):
        self.kept -= set(rows)  # a continued row's cache moves into this call
        self.batches.append(list(rows))
        self.keeps.append(keep)
        generations = generate_batch(self.policy, tokenizer, prompts, **options)
        if keep:
            self.kept |= {row for row, generation in zip(rows, generations) if generation.finished_by == "stop"}
        self.most_kept = max(self.most_kept, len(self.kept))
        return generations


def test_kept_row_caches_are_bounded_by_one_generate_calls_rows(tokenizer, tools):
    """Guards #35: turn-major batches over an engine that keeps tool-calling rows' caches held the caches of every
    row of the rollout (4, 8, 12, 16 after the four calls of a turn) while the memory plan counts one call's rows.
    Row-major batching (each batch of rows through all its turns) holds at most `batch_size`, and none after."""
    keys = [f"[r{i}]" for i in range(16)]
    policy = scripted(tokenizer, {key: [call("python", code="print(1)"), "answer"] for key in keys})
    engine = CacheKeepingEngine(policy)
    attach_engine(policy, engine)
    trajectories = run_agent(policy, tokenizer, keys, tools=tools,
                             config=AgentConfig(batch_size=4, max_new_tokens=64, max_turns=3))
    assert engine.most_kept == 4
    assert engine.kept == set()
    assert engine.batches == [[0, 1, 2, 3]] * 2 + [[4, 5, 6, 7]] * 2 + [[8, 9, 10, 11]] * 2 + [[12, 13, 14, 15]] * 2
    assert all(t.num_turns == 2 and t.used_tool and t.finished_by == "eos" for t in trajectories)


def test_the_last_turn_asks_the_engine_to_keep_no_caches(tokenizer, tools):
    """Guards #53: on a rollout's last turn no row has a next turn, so the agent passes `keep=False` and the engine
    clones no cache (the HF engine's clones of the whole final context were live beside the call's store)."""
    keys = ["[r0]", "[r1]"]
    policy = scripted(tokenizer, {key: [call("python", code="print(1)")] * 2 for key in keys})
    engine = CacheKeepingEngine(policy)
    attach_engine(policy, engine)
    trajectories = run_agent(policy, tokenizer, keys, tools=tools,
                             config=AgentConfig(batch_size=1, max_new_tokens=64, max_turns=2))
    assert engine.keeps == [True, False] * 2
    assert all(t.finished_by == "max_turns" and t.num_turns == 2 for t in trajectories)


def test_tag_format_appends_results_in_the_same_turn(tmp_path, tools):
    tokenizer = build_tiny_tokenizer(tmp_path, chat_template="plain")
    replies = {"[tags]": ["<python>print(2 ** 10)</python> and text after the stop", "So <answer>1024</answer>"]}
    (trajectory,) = run_agent(
        scripted(tokenizer, replies, marker=TAG_TURN_MARKER),
        tokenizer,
        ["[tags]"],
        tools=tools,
        config=AgentConfig(max_new_tokens=64),
    )
    assert "<python>code</python>" in trajectory.prompt  # the tools are described in the system turn
    assert (
        trajectory.completion == "<python>print(2 ** 10)</python>\n<result>\n1024\n</result>\nSo <answer>1024</answer>"
    )
    assert (trajectory.num_turns, trajectory.used_tool, trajectory.final_text) == (2, True, "So <answer>1024</answer>")


@pytest.mark.parametrize("thinking", [True, False])
def test_qwen35_style_template_xml_calls_and_thinking_switch(tmp_path, tools, thinking):
    tokenizer = build_tiny_tokenizer(tmp_path, chat_template="qwen35")
    xml_call = ("<tool_call>\n<function=python>\n<parameter=code>\nprint(' 6 * 7 = ', 6 * 7)\n</parameter>\n"
                "</function>\n</tool_call>")
    replies = {"[xml]": ["I should compute it.\n</think>\n\n" + xml_call, "It is <answer>42</answer>"]}
    config = AgentConfig(max_new_tokens=96, template_kwargs={"enable_thinking": thinking})
    (trajectory,) = run_agent(scripted(tokenizer, replies), tokenizer, ["[xml]"], tools=tools, config=config)
    opening = "<|im_start|>assistant\n<think>\n" + ("" if thinking else "\n</think>\n\n")
    assert trajectory.prompt.startswith("<|im_start|>system\n# Tools") and trajectory.prompt.endswith(opening)
    (record,) = trajectory.tool_calls
    assert (record.name, record.arguments, record.observation) == (
        "python",
        {"code": "print(' 6 * 7 = ', 6 * 7)"},
        " 6 * 7 =  42",
    )
    # The template trims tool contents: the observation goes in as the template renders it.
    expected_results = (
        "<|im_end|>\n<|im_start|>user\n<tool_response>\n6 * 7 =  42\n</tool_response><|im_end|>\n" + opening
    )
    assert trajectory.completion == replies["[xml]"][0] + expected_results + replies["[xml]"][1]


def test_raw_prompts_run_one_turn_without_tools(tokenizer, tools):
    policy = ScriptedPolicy(tokenizer, lambda prompt: call("python", code="1") if prompt == "12+7=" else "?")
    (trajectory,) = run_agent(policy, tokenizer, ["12+7="], config=AgentConfig(max_new_tokens=64), chat=False)
    assert policy.calls == [["12+7="]]  # no chat template around the raw prompt
    assert (trajectory.prompt, trajectory.completion, trajectory.finished_by) == (
        "12+7=",
        call("python", code="1"),
        "eos",
    )
    assert trajectory.num_turns == 1 and trajectory.tool_calls == []
    with pytest.raises(ValueError, match="chat=False"):
        run_agent(policy, tokenizer, ["1+1="], tools=tools, config=AgentConfig(), chat=False)


class _BrokenTool:
    name = "python"
    description = "Breaks."
    parameters = {"type": "object", "properties": {"code": {"type": "string"}}, "required": ["code"]}

    def call(self, arguments: dict) -> str:
        raise RuntimeError("sandbox host went away")


def test_a_tool_that_raises_becomes_an_error_observation(tokenizer):
    replies = {"[x]": [call("python", code="print(1)"), "done"]}
    (trajectory,) = run_agent(
        scripted(tokenizer, replies), tokenizer, ["[x]"], tools=[_BrokenTool()], config=AgentConfig(max_new_tokens=64)
    )
    assert trajectory.finished_by == "eos"
    assert trajectory.tool_calls[0].observation == "Error: the python tool failed: RuntimeError: sandbox host went away"


def test_agent_config_defaults_and_validation():
    assert AgentConfig.for_kind("math").budgets == {"python": 5, "search": 3}
    qa = AgentConfig.for_kind("qa", max_turns=4)
    assert (qa.budgets, qa.max_turns) == ({"python": 5, "search": 5}, 4)
    for bad, message in [
        ({"max_turns": 0}, "max_turns must be >= 1"),
        ({"tool_format": "xml"}, "tool_format must be one of"),
        ({"budgets": {"python": -1}}, "budgets must be >= 0"),
        ({"greedy": False, "temperature": 0.0}, "temperature must be > 0"),
        ({"batch_size": 0}, "batch_size must be >= 1"),
    ]:
        with pytest.raises(ValueError, match=message):
            AgentConfig(**bad)
    with pytest.raises(ValueError, match="kind must be one of"):
        AgentConfig.for_kind("vision")


# ---------------------------------------------------------------- the tiny real model


@pytest.fixture(scope="module")
def gsm8k_questions() -> list[str]:
    path = DATA / "math" / "gsm8k_test.jsonl"
    if not path.exists():
        pytest.skip(f"shared data not found at {path}")
    with path.open() as lines:
        return [json.loads(next(lines))["question"] for _ in range(4)]


@pytest.fixture(scope="module")
def hotpotqa_tools(tmp_path_factory) -> list:
    dev = DATA / "qa" / "hotpotqa_distractor_dev.jsonl"
    if not dev.exists():
        pytest.skip(f"shared data not found at {dev}")
    corpus = task_corpus(get_task("hotpotqa", data_dir=DATA), tmp_path_factory.mktemp("hotpotqa"), ("validation",))
    return [PythonTool(), SearchTool(BM25Search(corpus))]


def test_tiny_model_end_to_end_with_real_tools(model, tokenizer, gsm8k_questions, hotpotqa_tools):
    log = RowLog()
    config = AgentConfig.for_kind("math", max_new_tokens=12, max_turns=2)
    trajectories = run_agent(model, tokenizer, gsm8k_questions, tools=hotpotqa_tools, config=config, row_context=log)
    # Each row is prefilled on its own (no padding), then the four decode together.
    assert log.batches[:5] == [[0], [1], [2], [3], [0, 1, 2, 3]]
    # The first turn is exactly a plain batched generation of the rendered prompts.
    first_turns = generate_batch(
        model, tokenizer, [t.prompt for t in trajectories], max_new_tokens=12, stop_strings=["</tool_call>"]
    )
    for trajectory, first in zip(trajectories, first_turns):
        assert isinstance(trajectory, Trajectory) and trajectory.completion.startswith(first.text)
        assert trajectory.finished_by in ("eos", "length", "max_turns") and not trajectory.truncated
        assert 1 <= trajectory.num_turns <= 2 and trajectory.generated_tokens <= 24
        if trajectory.num_turns == 1:
            assert trajectory.completion == trajectory.final_text == first.text
    sampled = {"config": AgentConfig.for_kind("math", max_new_tokens=12, max_turns=2, greedy=False), "seed": 5}
    first = run_agent(model, tokenizer, gsm8k_questions, tools=hotpotqa_tools, **sampled)
    assert first == run_agent(model, tokenizer, gsm8k_questions, tools=hotpotqa_tools, **sampled)


def test_tiny_model_context_truncation(model, tokenizer, gsm8k_questions):
    prompts = [render_prompt(tokenizer, [{"role": "user", "content": q}]) for q in gsm8k_questions]
    lengths = prompt_token_counts(tokenizer, prompts)
    limit = max(lengths) + 3
    trajectories = run_agent(
        model, tokenizer, gsm8k_questions, config=AgentConfig(max_new_tokens=50, max_context_tokens=limit)
    )
    assert min(limit - length for length in lengths) == 3
    for trajectory, length in zip(trajectories, lengths):
        room = limit - length
        if trajectory.finished_by != "eos":  # a random model almost never picks EOS; it may, though
            expected = ("context", True, room) if room < 50 else ("length", False, 50)
            assert (trajectory.finished_by, trajectory.truncated, trajectory.generated_tokens) == expected

"""The tool-use tasks (tool-arithmetic, tool-lookup) and the embedded tool-using model's tokenizer and corpus."""

from __future__ import annotations

import json

import pytest
from transformers import AutoTokenizer

from copes.modeling import EMBEDDED_MODELS, resolve_model_path
from copes.rollout.templates import observation_text, render_prompt_in_format, tag_format_instructions
from copes.tasks import get_task
from copes.tasks.tool_use import ANSWER_INSTRUCTION, ToolArithmeticTask, ToolLookupTask, make_world
from copes.tools import BM25Search, PythonTool, SearchTool, write_corpus

AGENT_MODEL = EMBEDDED_MODELS["tiny-agent"]
SPLITS = ("train", "validation", "test")


@pytest.fixture(scope="module")
def lookup() -> ToolLookupTask:
    return ToolLookupTask(train_size=2000, validation_size=200, test_size=200)


@pytest.fixture(scope="module")
def arithmetic() -> ToolArithmeticTask:
    return ToolArithmeticTask(train_size=3000, validation_size=300, test_size=300)


def test_registered_as_chat_tasks_with_the_paper_budgets_kinds() -> None:
    assert isinstance(get_task("tool-arithmetic", train_size=10), ToolArithmeticTask)
    assert isinstance(get_task("tool-lookup", hops=2, train_size=10), ToolLookupTask)
    assert (ToolArithmeticTask.kind, ToolLookupTask.kind) == ("math", "qa")
    assert ToolArithmeticTask.chat and ToolLookupTask.chat


def test_same_seed_same_questions_other_seed_other_questions(arithmetic, lookup) -> None:
    for task, other in ((arithmetic, ToolArithmeticTask(seed=1, train_size=3000, validation_size=300)),
                        (lookup, ToolLookupTask(seed=1, train_size=2000, validation_size=200))):
        again = type(task)(train_size=len(task.examples("train")), validation_size=len(task.examples("validation")),
                           test_size=len(task.examples("test")))
        assert again.examples("validation") == task.examples("validation")
        assert [e.question for e in other.examples("validation")] != [e.question for e in task.examples("validation")]


def test_arithmetic_mixes_questions_that_need_the_tool_with_ones_that_do_not(arithmetic) -> None:
    for split in SPLITS:
        needs = [e.meta["needs_tool"] for e in arithmetic.examples(split)]
        assert 0.25 < 1 - sum(needs) / len(needs) < 0.42, split  # about a third are one-digit sums
    for example in arithmetic.examples("train")[:200]:
        assert str(eval(example.meta["expression"])) == example.golds[0]  # noqa: S307
        assert len(example.meta["expression"]) > 3 or not example.meta["needs_tool"]
    # Long problems belong to one split; the one-digit sums are facts every split shares.
    long = {split: {e.question for e in arithmetic.examples(split) if e.meta["needs_tool"]} for split in SPLITS}
    assert not long["train"] & long["validation"] and not long["train"] & long["test"]


def test_no_held_out_person_is_asked_about_in_training(lookup) -> None:
    people = {split: {e.meta["person"] for e in lookup.examples(split)} for split in SPLITS}
    assert not people["train"] & (people["validation"] | people["test"])
    assert not people["validation"] & people["test"]
    assert {e.meta["hops"] for e in lookup.examples("validation")} == {1, 2}
    assert {e.meta["hops"] for e in ToolLookupTask(hops=2, validation_size=50).examples("validation")} == {2}


def test_too_many_lookup_questions_is_one_clear_error() -> None:
    with pytest.raises(ValueError, match="exceeds the .* validation questions of this world"):
        ToolLookupTask(validation_size=10**6).examples("validation")
    with pytest.raises(ValueError, match="hops must be"):
        ToolLookupTask(hops="3")


def test_score_reads_the_answer_span_exactly(arithmetic, lookup) -> None:
    example = arithmetic.examples("validation", 1)[0]
    gold = example.golds[0]
    assert arithmetic.score(f"<answer>{gold}</answer>", example).correct
    assert arithmetic.score(f"<answer>{gold}</answer>", example).reward == 1.0
    assert not arithmetic.score(f"<answer>{gold}1</answer>", example).correct
    person = lookup.examples("validation", 1)[0]
    assert lookup.score(f"<answer>{person.golds[0].lower()}</answer>", person).correct
    assert lookup.score("no idea", person).reward == 0.0
    assert arithmetic.prompt(example).endswith(ANSWER_INSTRUCTION)


def test_real_bm25_search_finds_the_person_then_the_town(lookup, tmp_path) -> None:
    """Both hops of every validation question are answerable with the real search tool over the task's corpus."""
    corpus = tmp_path / "corpus.jsonl"
    write_corpus(lookup.corpus_paragraphs(), corpus)
    search = SearchTool(BM25Search(corpus))
    world = make_world(0)
    for example in lookup.examples("validation", 40):
        person = world.person(example.meta["person"])
        first = search.call({"query": person.name})
        assert first.startswith(f"Doc 1 (Title: {person.name}) ") and person.town.name in first
        second = search.call({"query": person.town.name})
        assert second.startswith(f"Doc 1 (Title: {person.town.name}) ")
        assert example.golds[0] in (first if example.meta["hops"] == 1 else second)


def test_the_committed_corpus_is_the_tasks_corpus(lookup) -> None:
    rows = [json.loads(line) for line in (AGENT_MODEL / "corpus.jsonl").read_text().splitlines()]
    assert [(row["title"], row["text"]) for row in rows] == lookup.corpus_paragraphs()


def test_the_agent_tokenizer_keeps_prompts_calls_and_observations_intact(lookup) -> None:
    """Every printable ASCII character, the tool-call tags and a real search observation survive tokenization and
    observation rendering unchanged; the fixed tool instructions cost one token each."""
    tokenizer = AutoTokenizer.from_pretrained(resolve_model_path("tiny-agent"))
    printable = "".join(chr(code) for code in range(32, 127)) + "\n\t"  # printable ASCII, newline, tab
    text = printable + "<python>print(4821*373-919)</python>\n<result>\n1797314\n</result>\n<answer>7</answer>"
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert tokenizer.unk_token_id not in ids
    assert tokenizer.decode(ids) == text
    assert observation_text(tokenizer, "Error: the python budget of 1 calls is used up; continue without it.", 128) \
        == "Error: the python budget of 1 calls is used up; continue without it."
    tools = [PythonTool(), SearchTool(BM25Search(AGENT_MODEL / "corpus.jsonl"))]
    observation = tools[1].call({"query": lookup.examples("validation", 1)[0].meta["person"]})
    assert observation_text(tokenizer, observation, 128) == observation
    prompt = render_prompt_in_format(tokenizer, [{"role": "user", "content": "What is 2+2? " + ANSWER_INSTRUCTION}],
                                     tools, "tags")
    assert tokenizer.decode(tokenizer.encode(prompt, add_special_tokens=False)) == prompt
    for line in [*tag_format_instructions(tools).split("\n"), ANSWER_INSTRUCTION]:
        assert len(tokenizer.encode(line, add_special_tokens=False)) == 1

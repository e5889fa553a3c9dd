"""pass@k against brute-force enumeration; evaluate() with a scripted policy on a fake task and on the real
GSM8K task (real scoring, real Python tool), and on the synthetic task with the tiny random-weight model."""

from __future__ import annotations

import itertools
import json
import math
from collections import Counter

import pytest

from copes.rollout.agent import AgentConfig
from copes.run.evaluation import EvalResult, evaluate, format_table, pass_at_k
from copes.tasks import Example, Score, TaskBase, get_task
from copes.tools import PythonTool

from helpers.datadir import DATA_DIR
from helpers.tiny_models import ScriptedPolicy, tiny_qwen3

DATA = DATA_DIR


def brute_force_pass_at_k(n: int, c: int, k: int) -> float:
    """The fraction of k-subsets of the n samples that contain at least one correct sample."""
    samples = [True] * c + [False] * (n - c)
    subsets = list(itertools.combinations(samples, k))
    return sum(any(subset) for subset in subsets) / len(subsets)


def test_pass_at_k_matches_brute_force_enumeration():
    for n in range(1, 9):
        for c in range(n + 1):
            for k in range(1, n + 1):
                assert math.isclose(pass_at_k(n, c, k), brute_force_pass_at_k(n, c, k), abs_tol=1e-12), (n, c, k)


def test_pass_at_k_is_stable_for_large_n():
    n, c, k = 1000, 7, 100
    exact = 1 - math.comb(n - c, k) / math.comb(n, k)  # exact big-integer binomials
    assert math.isclose(pass_at_k(n, c, k), exact, rel_tol=1e-12)
    assert pass_at_k(1000, 0, 500) == 0.0 and pass_at_k(1000, 501, 500) == 1.0


@pytest.mark.parametrize(
    "n, c, k, name", [(0, 0, 1, "n must be"), (4, 5, 1, "c must be"), (4, 2, 5, "k must be"), (4, 2, 0, "k must be")]
)
def test_pass_at_k_rejects_bad_arguments(n, c, k, name):
    with pytest.raises(ValueError, match=name):
        pass_at_k(n, c, k)


class FakeMathTask(TaskBase):
    """Correct when the last word of the output is a gold answer; +0.5 reward for using a tool."""

    name = "fake-math"
    kind = "math"
    chat = True

    def __init__(self, examples: list[Example]) -> None:
        self._examples = examples

    def examples(self, split: str, limit: int | None = None) -> list[Example]:
        return self._examples[:limit]

    def prompt(self, example: Example) -> str:
        return f"[{example.id}] {example.question}"

    def score(self, completion: str, example: Example, *, used_tool: bool = False) -> Score:
        answer = completion.rsplit(" ", 1)[-1]
        correct = answer in example.golds
        return Score(reward=float(correct) + 0.5 * used_tool, correct=correct, answer=answer)


EXAMPLES = [Example("e0", "2+2?", ("4",)), Example("e1", "3*3?", ("9",)), Example("e2", "10-3?", ("7",))]
TOOL_CALL = '<tool_call>\n{"name": "python", "arguments": {"code": "print(10 - 3)"}}\n</tool_call>'
# What each example's samples say on their first turn, in row order; "tool" calls Python, then answers right.
FIRST_TURNS = {
    "e0": ["is 4", "is 4", "is 4", "is 4"],
    "e1": ["is 8", "is 9", "is 6", "is 8"],
    "e2": ["tool", "is 1", "is 2", "is 3"],
}


def sample_script():
    asked: Counter[str] = Counter()

    def script(prompt: str) -> str:
        example_id = next(key for key in FIRST_TURNS if f"[{key}]" in prompt)
        if "<tool_response>" in prompt:
            return "The tool says 7"
        reply = FIRST_TURNS[example_id][asked[example_id]]
        asked[example_id] += 1
        return TOOL_CALL if reply == "tool" else f"The answer is {reply.split()[-1]}"

    return script


def test_evaluate_scores_samples_and_aggregates(tokenizer):
    policy = ScriptedPolicy(tokenizer, sample_script())
    task = FakeMathTask(EXAMPLES)
    result = evaluate(
        policy,
        tokenizer,
        task,
        EXAMPLES,
        n_samples=4,
        ks=(1, 2, 4),
        tools=[PythonTool()],
        agent_config=AgentConfig(max_new_tokens=64),
        batch_size=5,
        progress=False,
    )
    assert all(config.do_sample and config.temperature == 0.3 for config in policy.configs)  # n_samples > 1 samples
    # 12 rollouts in batches of 5; the second batch holds e2's first sample, whose tool turn follows it.
    assert [len(batch) for batch in policy.calls] == [5, 5, 1, 2]
    correct = [[sample["correct"] for sample in record["samples"]] for record in result.records]
    assert correct == [[True] * 4, [False, True, False, False], [True, False, False, False]]
    assert result.accuracy == pytest.approx(2 / 3)  # first samples: e0 right, e1 wrong, e2 right (with the tool)
    assert result.pass_at_k[1] == pytest.approx((1 + 0.25 + 0.25) / 3)
    assert result.pass_at_k[2] == pytest.approx((1 + 0.5 + 0.5) / 3)
    assert result.pass_at_k[4] == 1.0
    assert result.mean_reward == pytest.approx((6 + 0.5) / 12)
    assert (result.tool_calls, result.tool_use_rate) == ({"python": 1}, pytest.approx(1 / 12))
    tool_sample = result.records[2]["samples"][0]
    assert tool_sample["final_text"] == "The tool says 7" and tool_sample["tool_calls"][0]["observation"] == "7"
    assert (result.n_examples, result.n_samples, result.truncated_rate) == (3, 4, 0.0)
    assert json.loads(json.dumps(result.to_dict()))["pass_at_k"]["2"] == pytest.approx(2 / 3)


def test_evaluate_decodes_greedily_with_one_sample(tokenizer):
    policy = ScriptedPolicy(tokenizer, lambda prompt: "The answer is 4")
    result = evaluate(policy, tokenizer, FakeMathTask(EXAMPLES), EXAMPLES, progress=False)
    assert all(not config.do_sample for config in policy.configs)
    assert (result.accuracy, result.pass_at_k, result.tool_calls) == (
        pytest.approx(1 / 3),
        {1: pytest.approx(1 / 3)},
        {},
    )


@pytest.mark.parametrize(
    "options, message",
    [
        ({"n_samples": 0}, "n_samples must be >= 1"),
        ({"n_samples": 2, "ks": (1, 3)}, "every k in [1, n_samples=2]"),
        ({"batch_size": 0}, "batch_size must be >= 1"),
    ],
)
def test_evaluate_rejects_bad_arguments(tokenizer, options, message):
    policy = ScriptedPolicy(tokenizer, lambda prompt: "x")
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]")):
        evaluate(policy, tokenizer, FakeMathTask(EXAMPLES), EXAMPLES, progress=False, **options)
    with pytest.raises(ValueError, match="examples is empty"):
        evaluate(policy, tokenizer, FakeMathTask(EXAMPLES), [], progress=False)


def test_evaluate_real_gsm8k_task_with_the_python_tool(tokenizer):
    if not (DATA / "math" / "gsm8k_test.jsonl").exists():
        pytest.skip(f"shared data not found under {DATA}")
    task = get_task("gsm8k", data_dir=DATA)
    examples = task.examples("test", limit=2)  # golds: 18 (Janet's ducks) and 3
    replies = {
        examples[
            0
        ].question: '<tool_call>\n{"name": "python", "arguments": {"code": "print((16 - 3 - 4) * 2)"}}\n</tool_call>',
        examples[1].question: "She needs <answer>\\boxed{5}</answer>",
    }

    def script(prompt: str) -> str:
        if "<tool_response>\n18\n</tool_response>" in prompt:
            return "She makes <answer>\\boxed{18}</answer> dollars."
        return next(reply for question, reply in replies.items() if question in prompt)

    result = evaluate(
        ScriptedPolicy(tokenizer, script), tokenizer, task, examples, tools=[PythonTool()], progress=False
    )
    first, second = (record["samples"][0] for record in result.records)
    assert (first["correct"], first["answer"], first["used_tool"], first["num_turns"]) == (True, "18", True, 2)
    assert (second["correct"], second["answer"], second["used_tool"]) == (False, "5", False)
    assert first["reward"] > second["reward"] and result.accuracy == 0.5


def test_evaluate_synthetic_task_on_the_tiny_model(tokenizer):
    task = get_task("arithmetic")
    examples = task.examples("test", limit=6)
    model = tiny_qwen3(tokenizer, seed=0)
    result = evaluate(
        model, tokenizer, task, examples, agent_config=AgentConfig(max_turns=1, max_new_tokens=6), progress=False
    )
    assert result.n_examples == 6 and 0.0 <= result.accuracy <= 1.0
    for example, record in zip(examples, result.records):
        (sample,) = record["samples"]
        assert record["id"] == example.id and record["golds"] == list(example.golds)
        assert sample["num_turns"] == 1 and sample["generated_tokens"] <= 6 and sample["tool_calls"] == []
        assert sample["answer"] == sample["final_text"].split("\n", 1)[0].strip()  # scored on the raw output
    other = EvalResult(**{**result.__dict__, "task": "other", "pass_at_k": {1: 0.5, 4: 0.75}})
    lines = format_table({"arithmetic": result, "other": other}).splitlines()
    rows = [[cell.strip() for cell in line.split("|")[1:-1]] for line in lines]
    header = rows[0]
    assert header[:4] == ["benchmark", "n", "acc", "reward"] and header[4:6] == ["pass@1", "pass@4"]
    assert lines[1].startswith("|---") and len({len(line) for line in lines}) == 1  # columns line up
    arithmetic, other_row = dict(zip(header, rows[2])), dict(zip(header, rows[3]))
    assert arithmetic["n"] == "6x1" and arithmetic["pass@4"] == "-"  # arithmetic was run without pass@4
    assert (other_row["pass@1"], other_row["pass@4"]) == ("50.0", "75.0")

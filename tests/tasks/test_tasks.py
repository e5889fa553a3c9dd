"""Tasks: loaders on the real files, the loaders' error messages, prompts and composed rewards."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pandas as pd
import pytest

from copes.errors import ConfigError
from copes.tasks import Example, get_task
from copes.tasks.loading import DatasetError, default_data_dir, read_rows
from copes.tasks.math_tasks import MATH_INSTRUCTION
from copes.tasks.qa_tasks import QA_INSTRUCTION

from helpers.cli_runs import copes_run
from helpers.datadir import DATA_DIR, FULL_DATA, SHARED_DATA_DIR, needs_full_data
from helpers.paths import FIXTURES


def _write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")
    return path


# --------------------------------------------------------------------------------------------------------- real files


# The slices' rows (tests/fixtures/data/README.md) where the full sets are absent.
SLICE_ROWS = {("gsm8k", "train"): 81, ("gsm8k", "test"): 40, ("math", "test"): 30, ("math500", "test"): 60,
              ("aime24", "test"): 5, ("aime25", "test"): 30, ("hotpotqa", "train"): 5, ("hotpotqa", "validation"): 15,
              ("hotpotqa", "test"): 5, ("musique", "validation"): 60, ("musique", "test"): 60}


@pytest.mark.parametrize(
    ("task_name", "split", "rows"),
    [
        ("gsm8k", "train", 7473),
        ("gsm8k", "test", 1319),
        ("math", "test", 5000),
        ("math500", "test", 500),
        ("aime24", "test", 30),
        ("aime25", "test", 30),
        ("hotpotqa", "train", 300),
        ("hotpotqa", "validation", 300),
        ("hotpotqa", "test", 500),
        ("musique", "validation", 2417),
        ("musique", "test", 2417),
    ],
)
def test_row_counts_match_the_data_readme(task_name: str, split: str, rows: int) -> None:
    rows = rows if FULL_DATA else SLICE_ROWS[task_name, split]
    examples = get_task(task_name, data_dir=DATA_DIR).examples(split)
    assert len(examples) == rows
    assert len({example.id for example in examples}) == rows
    assert all(example.question and example.golds and all(example.golds) for example in examples)


def test_math_gold_answers() -> None:
    gsm8k = get_task("gsm8k", data_dir=DATA_DIR).examples("train")
    assert gsm8k[0].golds == ("72",)
    # "#### 1,080" in the file: commas are stripped from GSM8K answers.
    assert all("," not in example.golds[0] for example in gsm8k)
    assert any(example.meta["answer"].endswith("#### 1,080") and example.golds == ("1080",) for example in gsm8k)
    math_test = get_task("math", data_dir=DATA_DIR).examples("test", limit=3)
    assert [example.golds for example in math_test] == [("2",), ("10",), ("\\dfrac{9}{7}",)]
    assert get_task("aime24", data_dir=DATA_DIR).examples("test")[0].golds == ("204",)
    assert get_task("aime25", data_dir=DATA_DIR).examples("test")[0].golds == ("70",)


def test_hotpotqa_examples_carry_paragraphs_and_supporting_facts() -> None:
    example = get_task("hotpotqa", data_dir=DATA_DIR).examples("validation")[0]
    assert example.golds == ("Tulsa",)
    titles = [title for title, _ in example.meta["paragraphs"]]
    assert len(titles) == 10 and "Tinted Windows (band)" in titles
    assert example.meta["supporting_facts"] == [("Tinted Windows (album)", 0), ("Tinted Windows (band)", 3)]


def test_hotpotqa_accepts_the_original_list_of_pairs_layout(tmp_path: Path) -> None:
    hub_layout = read_rows(DATA_DIR / "qa" / "hotpotqa_distractor_dev.jsonl")[:3]
    original_layout = [
        {
            "_id": row["id"],
            "question": row["question"],
            "answer": row["answer"],
            "context": [[t, s] for t, s in zip(row["context"]["title"], row["context"]["sentences"])],
            "supporting_facts": [list(pair) for pair in zip(*row["supporting_facts"].values(), strict=True)],
        }
        for row in hub_layout
    ]
    (tmp_path / "qa").mkdir()
    (tmp_path / "qa" / "hotpot_dev_distractor_v1.json").write_text(json.dumps(original_layout), encoding="utf-8")
    from_original = get_task("hotpotqa", data_dir=tmp_path).examples("validation")
    from_hub_layout = get_task("hotpotqa", data_dir=DATA_DIR).examples("validation", limit=3)
    for original, hub in zip(from_original, from_hub_layout, strict=True):
        assert (original.id, original.golds) == (hub.id, hub.golds)
        assert original.meta["paragraphs"] == hub.meta["paragraphs"]
        assert original.meta["supporting_facts"] == hub.meta["supporting_facts"]


def test_musique_golds_include_aliases() -> None:
    examples = get_task("musique", data_dir=DATA_DIR).examples("validation")
    rows = read_rows(DATA_DIR / "qa" / "musique_dev.json")
    with_aliases = next(row for row in rows if row["answer_aliases"])
    example = next(example for example in examples if example.id == with_aliases["id"])
    assert example.golds == (with_aliases["answer"], *with_aliases["answer_aliases"])
    assert example.meta["question_decomposition"] == with_aliases["question_decomposition"]


def test_musique_skips_only_rows_marked_unanswerable(tmp_path: Path) -> None:
    rows = [
        {"id": "a", "question": "q1", "answer": "x", "answer_aliases": ["x", "ex"], "answerable": True},
        {"id": "b", "question": "q2", "answer": "y", "answer_aliases": [], "answerable": False},
        {"id": "c", "question": "q3", "answer": "z"},  # no field: kept
    ]
    (tmp_path / "qa").mkdir()
    (tmp_path / "qa" / "musique_dev.json").write_text(json.dumps(rows), encoding="utf-8")
    examples = get_task("musique", data_dir=tmp_path).examples("validation")
    assert [(example.id, example.golds) for example in examples] == [("a", ("x", "ex")), ("c", ("z",))]


def test_2wiki_official_json_fixture(tmp_path: Path) -> None:
    (tmp_path / "qa").mkdir()
    shutil.copy(FIXTURES / "2wiki_sample.json", tmp_path / "qa" / "2wiki_dev.json")
    examples = get_task("2wiki", data_dir=tmp_path).examples("validation")
    assert [(example.id, example.golds) for example in examples] == [
        ("handmade-0001", ("Charles Babbage",)),
        ("handmade-0002", ("Vienna",)),
        ("handmade-0003", ("no",)),
    ]
    second = examples[1]
    assert second.meta["type"] == "compositional"
    assert second.meta["paragraphs"][1][0] == "Fritz Lang"
    assert second.meta["supporting_facts"] == [("Metropolis (1927 film)", 0), ("Fritz Lang", 1)]
    assert second.meta["evidences"][1] == ["Fritz Lang", "place of birth", "Vienna"]


@needs_full_data
def test_math_train_validation_split_is_deterministic_and_disjoint(tmp_path: Path) -> None:
    # The MATH training set comes from the hub; a local math_train.jsonl (here 1000 real MATH problems) is used
    # instead when present, which lets this test run offline.
    rows = read_rows(DATA_DIR / "math" / "math_test.jsonl")[:1000]
    _write_jsonl(tmp_path / "math" / "math_train.jsonl", rows)
    task = get_task("math", data_dir=tmp_path)
    train, validation = task.examples("train"), task.examples("validation")
    assert (len(train), len(validation)) == (250, 750)
    assert {e.id for e in train}.isdisjoint({e.id for e in validation})
    assert len({e.id for e in train} | {e.id for e in validation}) == 1000
    assert [e.id for e in validation] == [e.id for e in get_task("math", data_dir=tmp_path).examples("validation")]
    reseeded = get_task("math", data_dir=tmp_path, split_seed=1).examples("validation")
    assert [e.id for e in reseeded] != [e.id for e in validation]
    with pytest.raises(ValueError, match="validation_size"):
        get_task("math", data_dir=tmp_path, validation_size=1001).examples("train")


# --------------------------------------------------------------------------------------------------------- loaders


def test_broken_jsonl_line_names_file_and_line(tmp_path: Path) -> None:
    path = tmp_path / "math" / "gsm8k_test.jsonl"
    path.parent.mkdir()
    path.write_text('{"question": "q", "answer": "#### 1"}\n{"question": "q2", "answer": \n', encoding="utf-8")
    with pytest.raises(DatasetError, match=r"gsm8k_test\.jsonl:2: broken JSON"):
        get_task("gsm8k", data_dir=tmp_path).examples("test")


def test_missing_field_names_file_and_line(tmp_path: Path) -> None:
    rows = [{"question": "q", "answer": "#### 1"}, {"question": "q"}]
    _write_jsonl(tmp_path / "math" / "gsm8k_test.jsonl", rows)
    with pytest.raises(DatasetError, match=r"gsm8k_test\.jsonl:2: missing required field\(s\) \['answer'\]"):
        get_task("gsm8k", data_dir=tmp_path).examples("test")
    as_json = tmp_path / "rows.json"
    as_json.write_text('[{"question": "q"}]', encoding="utf-8")
    with pytest.raises(DatasetError, match=r"rows\.json: row 0: missing"):
        read_rows(as_json, ["answer"])


def test_broken_json_file_and_bad_gold(tmp_path: Path) -> None:
    broken = tmp_path / "rows.json"
    broken.write_text('[\n{"a": 1},\n{"a": }\n]', encoding="utf-8")
    with pytest.raises(DatasetError, match=r"rows\.json:3: broken JSON"):
        read_rows(broken)
    _write_jsonl(tmp_path / "math" / "gsm8k_test.jsonl", [{"question": "q", "answer": "no final line"}])
    with pytest.raises(DatasetError, match="gsm8k test row 0.*####"):
        get_task("gsm8k", data_dir=tmp_path).examples("test")
    with pytest.raises(DatasetError, match="unsupported format"):
        read_rows(tmp_path / "rows.csv")


def test_json_data_wrapper_and_parquet(tmp_path: Path) -> None:
    rows = [{"problem": "1+1?", "answer": "2"}, {"problem": "2+2?", "answer": "4"}]
    (tmp_path / "wrapped.json").write_text(json.dumps({"data": rows}), encoding="utf-8")
    pd.DataFrame(rows).to_parquet(tmp_path / "rows.parquet")
    assert read_rows(tmp_path / "wrapped.json", ["problem"]) == rows
    assert read_rows(tmp_path / "rows.parquet", ["problem", "answer"]) == rows


def test_split_without_a_local_file_or_hub_copy(tmp_path: Path) -> None:
    with pytest.raises(DatasetError, match="no local file"):
        get_task("hotpotqa", data_dir=tmp_path).examples("test")


@pytest.mark.integration
def test_a_task_without_local_data_offline_is_one_line_and_status_2(tmp_path: Path) -> None:
    """`copes-run --task hotpotqa` with an empty data dir and the hub off: one line naming --data-dir and
    COPES_DATA_DIR, status 2, at once (it was datasets' retries, then a 60-line traceback and status 1)."""
    result = copes_run("--task", "hotpotqa", "--output-dir", str(tmp_path / "run"),
                       env={"COPES_DATA_DIR": str(tmp_path), "HF_HUB_OFFLINE": "1"})
    assert result.returncode == 2, result.stderr[-2000:]
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "--data-dir" in lines[0] and "$COPES_DATA_DIR" in lines[0], result.stderr[-2000:]
    assert "qa/hotpotqa_distractor_train.jsonl" in lines[0] and "offline mode is set" in lines[0]


def test_default_data_dir(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("COPES_DATA_DIR", str(tmp_path))
    assert default_data_dir() == tmp_path
    monkeypatch.delenv("COPES_DATA_DIR")
    if DATA_DIR == SHARED_DATA_DIR:
        assert default_data_dir() == DATA_DIR


# --------------------------------------------------------------------------------------------------------- protocol


def test_splits_limit_and_errors(tmp_path: Path) -> None:
    rows = [{"question": f"q{i}", "answer": f"#### {i}"} for i in range(5)]
    _write_jsonl(tmp_path / "math" / "gsm8k_test.jsonl", rows)
    task = get_task("gsm8k", data_dir=tmp_path)
    assert [e.golds for e in task.examples("test", limit=2)] == [("0",), ("1",)]
    assert len(task.examples("test", limit=0)) == 0
    with pytest.raises(ValueError, match="no split 'validation'"):
        task.examples("validation")
    with pytest.raises(ValueError, match="limit"):
        task.examples("test", limit=-1)


def test_prompts_and_task_attributes() -> None:
    math_task, qa_task = get_task("math500"), get_task("hotpotqa")
    example = Example(id="x", question="What is 6 times 7?", golds=("42",))
    assert (math_task.kind, math_task.chat, qa_task.kind, qa_task.chat) == ("math", True, "qa", True)
    assert math_task.prompt(example) == f"{MATH_INSTRUCTION}\n\nProblem: What is 6 times 7?"
    assert "<answer>\\boxed{" in MATH_INSTRUCTION and "step by step" in MATH_INSTRUCTION
    assert qa_task.prompt(example).endswith("Question: What is 6 times 7?")
    assert "<answer>" in QA_INSTRUCTION and "\\boxed" not in QA_INSTRUCTION


GSM_EXAMPLE = Example(id="g", question="q", golds=("1080",))


@pytest.mark.parametrize(
    ("options", "completion", "used_tool", "reward", "correct"),
    [
        ({}, "so <answer>\\boxed{1,080}</answer>", False, 1.0, True),
        ({}, "<answer>\\boxed{1080}</answer>", True, 1.1, True),
        ({}, "<answer>\\boxed{1000}</answer>", True, 0.0, False),  # no bonus for a wrong answer
        ({}, "the answer is \\boxed{1080}", False, 0.5, True),  # no answer span: -0.5
        ({}, "1080", False, 0.0, True),  # whole output as the answer, both parts missing: -1
        ({"format_reward": False}, "1080", True, 1.1, True),
        ({"format_reward": False, "tool_bonus": False}, "1080", True, 1.0, True),
    ],
)
def test_math_reward_terms(options: dict, completion: str, used_tool: bool, reward: float, correct: bool) -> None:
    score = get_task("gsm8k", **options).score(completion, GSM_EXAMPLE, used_tool=used_tool)
    assert score.reward == pytest.approx(reward)
    assert score.correct is correct


def test_math_score_batch_matches_score() -> None:
    task = get_task("gsm8k")
    completions = ["<answer>\\boxed{1080}</answer>", "\\boxed{7}", "<answer>\\boxed{1.08 \\times 10^3}</answer>"]
    batch = task.score_batch(completions, [GSM_EXAMPLE] * 3, used_tools=[True, False, False])
    assert batch == [task.score(c, GSM_EXAMPLE, used_tool=u) for c, u in zip(completions, [True, False, False])]
    assert [score.correct for score in batch] == [True, False, True]


QA_EXAMPLE = Example(id="h", question="q", golds=("Barack Obama", "Obama"))


@pytest.mark.parametrize(
    ("options", "completion", "reward", "correct"),
    [
        ({}, "<answer>Barack Obama Jr</answer>", 0.0, False),  # EM by default
        ({"qa_metric": "f1"}, "<answer>Barack</answer>", 2 / 3, False),  # F1 of a committed partial answer
        ({"qa_metric": "f1"}, "<answer>Barack Obama Jr</answer>", 0.0, False),  # longer than every gold
        ({}, "<answer>obama</answer>", 1.0, True),  # an alias
        ({}, "Barack Obama", 0.0, True),  # correct, but no answer span: -1
        ({"qa_metric": "em"}, "<answer>Barack Obama Jr</answer>", 0.0, False),
        ({"format_reward": False}, "Barack Obama", 1.0, True),
        # "obama." != "obama" under the "paper" normalisation
        ({"qa_normalization": "paper", "qa_metric": "f1"}, "<answer>Barack Obama.</answer>", 0.5, False),
    ],
)
def test_qa_reward_terms(options: dict, completion: str, reward: float, correct: bool) -> None:
    score = get_task("hotpotqa", **options).score(completion, QA_EXAMPLE)
    assert score.reward == pytest.approx(reward)
    assert score.correct is correct


def test_qa_tool_bonus_and_bad_options() -> None:
    task = get_task("musique")
    assert task.score("<answer>Obama</answer>", QA_EXAMPLE, used_tool=True).reward == pytest.approx(1.1)
    with pytest.raises(ValueError, match="qa_metric"):
        get_task("hotpotqa", qa_metric="bleu")
    # Guards #40: substring accuracy pays "Barack Obama Jr" and any list of candidates; it is refused in one line.
    with pytest.raises(ConfigError, match=r"^qa_metric 'acc' .* use 'em' \(the default\) or 'f1'"):
        get_task("hotpotqa", qa_metric="acc")
    with pytest.raises(ValueError, match="qa_normalization"):
        get_task("hotpotqa", qa_normalization="squad")


def test_qa_tasks_own_their_corpus_paragraphs_and_other_tasks_have_none() -> None:
    task = get_task("hotpotqa", data_dir=DATA_DIR)
    paragraphs = task.corpus_paragraphs()
    expected = [(title, "".join(sentences).strip()) for split in task.splits
                for example in task.examples(split) for title, sentences in example.meta["paragraphs"]]
    assert paragraphs == expected and len(paragraphs) >= 10 * len(task.examples("validation"))
    assert get_task("arithmetic").corpus_paragraphs() == []


def test_batch_scoring_is_part_of_every_task_and_checks_alignment() -> None:
    task = get_task("arithmetic")
    examples = task.examples("validation", limit=2)
    scores = task.score_batch([examples[0].golds[0], "nonsense"], examples)
    assert [score.correct for score in scores] == [True, False]
    with pytest.raises(ValueError, match="differ in length: 1, 2, 1"):
        task.score_batch(["1"], examples, used_tools=[False])

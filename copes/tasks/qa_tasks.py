"""Multi-hop QA tasks: HotpotQA (distractor), 2WikiMultihopQA and MuSiQue.

Reward = QA reward of the extracted answer against every accepted gold (`copes.rewards.qa_reward`: "em" by
default, or length-gated "f1"; "acc" is refused: it pays hedges) + format term (0 / -1 for a missing
`<answer>` span) + tool bonus (+0.1 when correct with a tool call). `correct` means full credit under the chosen
metric; `metrics` gives the standard reporting EM / F1 / accuracy.

Each example keeps its dataset's paragraphs in one layout, `meta["paragraphs"] = [(title, [sentence, ...])]`,
and supporting facts as `meta["supporting_facts"] = [(title, sentence_index)]`, whichever layout the file used
(HotpotQA hub columns, the original list-of-pairs JSON, 2Wiki, MuSiQue), so a local search corpus can be
built from any of them.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from copes.rewards import extract_answer, qa_reward, qa_scores
from copes.rewards.qa import DEFAULT_QA_REWARD, NORMALIZATIONS, check_qa_reward
from copes.tasks.base import Example, Score, register
from copes.tasks.dataset import DatasetTask
from copes.tasks.loading import DatasetError, HubSplit, load_split_rows, resolve_data_dir

QA_INSTRUCTION = (
    "Answer the following question. Reason step by step. You may use the available tools, for example search "
    "for facts you are not sure of. Give your final answer inside <answer></answer> tags, as short as possible "
    "(a name, a date, a number or yes/no), for example <answer>Paris</answer>."
)


class QATask(DatasetTask):
    """A QA dataset as a `Task`; `splits` maps each split name to a function building its examples."""

    # The same class head as MathTask's (kind, chat, a name and its splits): each dataset family keeps its own
    # options after them.
    kind = "qa"
    chat = True

    def __init__(
        self,
        name: str,
        splits: dict[str, Callable[[], list[Example]]],
        *,
        qa_metric: str = DEFAULT_QA_REWARD,
        qa_normalization: str = "official",
        **reward_terms: bool,
    ) -> None:
        """`reward_terms`: DatasetTask's format_reward and tool_bonus switches."""
        check_qa_reward(qa_metric)
        if qa_normalization not in NORMALIZATIONS:
            raise ValueError(f"qa_normalization must be one of {NORMALIZATIONS}, got {qa_normalization!r}")
        super().__init__(name, splits, **reward_terms)
        self.qa_metric = qa_metric
        self.qa_normalization = qa_normalization

    def prompt(self, example: Example) -> str:
        return f"{QA_INSTRUCTION}\n\nQuestion: {example.question}"

    def metrics(self, answer: str, example: Example) -> dict[str, float]:
        """EM, F1 and accuracy of an extracted answer, under this task's normalisation (for evaluation reports)."""
        return qa_scores(answer, example.golds, normalization=self.qa_normalization)

    def score(self, completion: str, example: Example, *, used_tool: bool = False) -> Score:
        answer = extract_answer(completion)
        value = qa_reward(answer, example.golds, self.qa_metric, self.qa_normalization)
        correct = value >= 1.0
        return Score(reward=self._shaped_reward(value, completion, correct, used_tool), correct=correct, answer=answer)

    def corpus_paragraphs(self, splits: Sequence[str] | None = None) -> list[tuple[str, str]]:
        """Every context paragraph of every split (of `splits`, when given) whose data can be read, split by split
        in file order."""
        paragraphs = []
        for split in self.splits if splits is None else splits:
            try:
                examples = self.examples(split)
            except DatasetError:  # a split with no local file and no hub copy
                continue
            for example in examples:
                # HotpotQA sentences carry their own leading spaces, so plain concatenation restores the paragraph.
                paragraphs += [(title, "".join(sentences).strip())
                               for title, sentences in example.meta.get("paragraphs", [])]
        return paragraphs


# ---------------------------------------------------------------------------------------------------------
# Row layouts.


def parse_paragraphs(context: Any, where: str) -> list[tuple[str, list[str]]]:
    """(title, sentences) pairs from a column layout (`{"title": [...], "sentences" | "content": [[...]]}`),
    a list of `[title, sentences]` pairs (original HotpotQA / 2Wiki JSON) or MuSiQue paragraph objects."""
    if isinstance(context, dict) and "title" in context:
        sentences = context.get("sentences", context.get("content"))
        if sentences is not None:
            return [(str(title), [str(s) for s in sents]) for title, sents in zip(context["title"], sentences)]
    elif isinstance(context, Sequence) and not isinstance(context, str):
        paragraphs = []
        for item in context:
            if isinstance(item, dict) and "paragraph_text" in item:
                paragraphs.append((str(item.get("title", "")), [str(item["paragraph_text"])]))
            elif isinstance(item, Sequence) and not isinstance(item, str) and len(item) == 2:
                paragraphs.append((str(item[0]), [str(s) for s in item[1]]))
            else:
                raise DatasetError(f"{where}: unrecognised context paragraph {str(item)[:80]!r}")
        return paragraphs
    raise DatasetError(f"{where}: unrecognised context layout {str(context)[:80]!r}")


def _supporting_facts(facts: Any, where: str) -> list[tuple[str, int]]:
    """(title, sentence index) pairs from `{"title": [...], "sent_id": [...]}` or `[[title, index], ...]`."""
    if isinstance(facts, dict) and "title" in facts and "sent_id" in facts:
        return [(str(title), int(index)) for title, index in zip(facts["title"], facts["sent_id"])]
    if isinstance(facts, Sequence) and not isinstance(facts, str) and all(len(fact) == 2 for fact in facts):
        return [(str(title), int(index)) for title, index in facts]
    raise DatasetError(f"{where}: unrecognised supporting_facts layout {str(facts)[:80]!r}")


def _qa_example(row: dict[str, Any], *, name: str, split: str, index: int, golds: tuple[str, ...]) -> Example:
    where = f"{name} {split} row {index}"
    row_id = row.get("id", row.get("_id"))
    if row_id is None:
        raise DatasetError(f"{where}: the row has neither 'id' nor '_id'")
    meta = {key: value for key, value in row.items() if key not in ("id", "_id", "question", "context", "paragraphs")}
    context = row.get("context", row.get("paragraphs"))
    if context is not None:
        meta["paragraphs"] = parse_paragraphs(context, where)
    if row.get("supporting_facts") is not None:
        meta["supporting_facts"] = _supporting_facts(row["supporting_facts"], where)
    return Example(id=str(row_id), question=row["question"], golds=golds, meta=meta)


def _single_answer_split(
    name: str,
    data_dir: Path | None,
    split: str,
    local_files: list[str],
    hub: HubSplit | None,
    required: tuple[str, ...],
) -> list[Example]:
    rows = load_split_rows(data_dir, local_files, hub, required)
    return [
        _qa_example(row, name=name, split=split, index=index, golds=(str(row["answer"]),))
        for index, row in enumerate(rows)
    ]


def _musique_split(data_dir: Path | None, split: str, local_files: list[str], hub: HubSplit) -> list[Example]:
    rows = load_split_rows(data_dir, local_files, hub, ("id", "question", "answer"))
    examples = []
    for index, row in enumerate(rows):
        if row.get("answerable") is False:  # MuSiQue-Full's contrast questions; absent field = answerable
            continue
        golds = tuple(dict.fromkeys([str(row["answer"]), *map(str, row.get("answer_aliases") or [])]))
        examples.append(_qa_example(row, name="musique", split=split, index=index, golds=golds))
    return examples


# ---------------------------------------------------------------------------------------------------------
# Registered tasks. Local file names: the offline copies first, then the original releases' names.


@register("hotpotqa")
def hotpotqa(data_dir: str | Path | None = None, **reward_options: Any) -> QATask:
    """HotpotQA distractor setting: train / validation (dev) / test. `reward_options`: QATask's format_reward,
    tool_bonus, qa_metric, qa_normalization."""
    root = resolve_data_dir(data_dir)
    sources = {
        "train": (["qa/hotpotqa_distractor_train.jsonl", "qa/hotpot_train_v1.1.json"], "train"),
        "validation": (["qa/hotpotqa_distractor_dev.jsonl", "qa/hotpot_dev_distractor_v1.json"], "validation"),
        "test": (["qa/hotpotqa_distractor_test.jsonl"], None),  # the hub's distractor test set has no answers
    }
    splits = {
        split: functools.partial(
            _single_answer_split,
            "hotpotqa",
            root,
            split,
            local_files,
            HubSplit("hotpotqa/hotpot_qa", hub_split, "distractor") if hub_split else None,
            ("question", "answer", "context"),
        )
        for split, (local_files, hub_split) in sources.items()
    }
    return QATask("hotpotqa", splits, **reward_options)


@register("2wiki")
def two_wiki(data_dir: str | Path | None = None, **reward_options: Any) -> QATask:
    """2WikiMultihopQA in its official JSON format (`qa/2wiki_{train,dev,test}.json`): train / validation / test."""
    root = resolve_data_dir(data_dir)
    files = {"train": "train", "validation": "dev", "test": "test"}
    splits = {
        split: functools.partial(
            _single_answer_split,
            "2wiki",
            root,
            split,
            [f"qa/2wiki_{file_split}.json"],
            HubSplit("ohjoonhee/2WikiMultihopQA", split),
            ("_id", "question", "answer", "context"),
        )
        for split, file_split in files.items()
    }
    return QATask("2wiki", splits, **reward_options)


@register("musique")
def musique(data_dir: str | Path | None = None, **reward_options: Any) -> QATask:
    """MuSiQue-Ans: train, and the dev set as both "validation" and "test" (test answers are not public, so
    evaluation uses dev, as is usual). Golds are the answer and its aliases."""
    root = resolve_data_dir(data_dir)
    train_files = ["qa/musique_train.json", "qa/musique_ans_v1.0_train.jsonl"]
    dev_files = ["qa/musique_dev.json", "qa/musique_ans_v1.0_dev.jsonl"]
    dev = functools.partial(_musique_split, root, "dev", dev_files, HubSplit("dgslibisey/MuSiQue", "validation"))
    splits = {
        "train": functools.partial(_musique_split, root, "train", train_files, HubSplit("dgslibisey/MuSiQue", "train")),
        "validation": dev,
        "test": dev,
    }
    return QATask("musique", splits, **reward_options)

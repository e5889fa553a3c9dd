"""Search over a corpus built from the real HotpotQA files: corpus building, BM25 recall of the supporting
paragraphs, index save/load, the Search-R1 HTTP client against a local server, and the `search` agent tool."""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from copes.config.components import task_corpus
from copes.tasks import get_task
from copes.tasks.loading import DatasetError
from copes.tools import (
    BM25Search,
    HttpRetriever,
    SearchError,
    SearchTool,
    load_corpus,
    tool_schema,
)

from helpers.datadir import DATA_DIR, FULL_DATA

DATA = DATA_DIR
QA_DATA = DATA / "qa"
HOTPOT_DEV = QA_DATA / "hotpotqa_distractor_dev.jsonl"
HOTPOT_TRAIN = QA_DATA / "hotpotqa_distractor_train.jsonl"
pytestmark = pytest.mark.skipif(not HOTPOT_DEV.is_file(), reason=f"shared HotpotQA data not found under {QA_DATA}")

# Measured with the question text as query over the dev+train corpus (5913 passages): 0.69 (no stemmer).
RECALL_AT_5_FLOOR = 0.62
QUERIES = ["Tinted Windows band first performance", "Arthur's Magazine first published"]


def _rows(path: Path, limit: int | None = None) -> list[dict]:
    with open(path, encoding="utf-8") as file:
        rows = [json.loads(line) for line in file]
    return rows[:limit]


def _hotpotqa_corpus(data_dir: Path, folder: Path, splits: tuple[str, ...]) -> Path:
    """The corpus the trainer builds: every context paragraph of `splits`, read by the HotpotQA task loader."""
    corpus = task_corpus(get_task("hotpotqa", data_dir=data_dir), folder, splits)
    assert corpus is not None
    return corpus


def _data_dir_with(tmp_path: Path, file_name: str, text: str) -> Path:
    (tmp_path / "qa").mkdir(parents=True)
    (tmp_path / "qa" / file_name).write_text(text)
    return tmp_path


@pytest.fixture(scope="module")
def corpus_path(tmp_path_factory) -> Path:
    return _hotpotqa_corpus(DATA, tmp_path_factory.mktemp("corpus"), ("validation", "train"))


@pytest.fixture(scope="module")
def bm25(corpus_path: Path) -> BM25Search:
    return BM25Search(corpus_path)


# ---------------------------------------------------------------- corpus


def test_corpus_has_one_passage_per_distinct_paragraph(corpus_path: Path) -> None:
    rows = _rows(HOTPOT_DEV) + _rows(HOTPOT_TRAIN)
    distinct = {
        (title, "".join(sentences).strip())
        for row in rows
        for title, sentences in zip(row["context"]["title"], row["context"]["sentences"])
    }
    passages = load_corpus(corpus_path)
    assert len(passages) == len(distinct)
    if FULL_DATA:  # the full sets repeat paragraphs across questions; the repository's few-row slices do not
        assert len(distinct) < sum(len(row["context"]["title"]) for row in rows)
    assert {(p.title, p.text) for p in passages} == distinct
    assert len({p.id for p in passages}) == len(passages)
    tinted = next(p for p in passages if p.title == "Tinted Windows (band)")
    assert "Cain's Ballroom in Tulsa, Oklahoma" in tinted.text and not tinted.text.startswith(" ")


def test_original_list_of_pairs_layout_gives_the_same_corpus(tmp_path: Path) -> None:
    hub_rows = _rows(HOTPOT_DEV, limit=20)
    original_rows = [
        {
            "_id": row["id"],
            "question": row["question"],
            "answer": row["answer"],
            "supporting_facts": [list(pair) for pair in zip(*row["supporting_facts"].values())],
            "context": [list(pair) for pair in zip(row["context"]["title"], row["context"]["sentences"])],
        }
        for row in hub_rows
    ]
    # The original release is one JSON array; the hub layout is jsonl with column dicts.
    original = _data_dir_with(tmp_path / "original", "hotpot_dev_distractor_v1.json", json.dumps(original_rows))
    hub = _data_dir_with(tmp_path / "hub", "hotpotqa_distractor_dev.jsonl",
                         "".join(json.dumps(row) + "\n" for row in hub_rows * 2))
    corpus_original = _hotpotqa_corpus(original, tmp_path / "a", ("validation",))
    corpus_hub = _hotpotqa_corpus(hub, tmp_path / "b", ("validation",))
    assert len(load_corpus(corpus_original)) == len(load_corpus(corpus_hub)) > 8 * len(hub_rows)
    assert corpus_original.read_text() == corpus_hub.read_text()


def test_corpus_builder_rejects_bad_input(tmp_path: Path) -> None:
    bad_row = {"id": "x", "question": "q", "answer": "a", "context": "not a context"}
    data_dir = _data_dir_with(tmp_path, "hotpotqa_distractor_dev.jsonl", json.dumps(bad_row) + "\n")
    with pytest.raises(DatasetError, match="hotpotqa validation row 0: unrecognised context layout"):
        get_task("hotpotqa", data_dir=data_dir).examples("validation")
    (tmp_path / "corpus.jsonl").write_text('{"id": "0", "title": "no text"}\n')
    with pytest.raises(ValueError, match="corpus.jsonl row 1: a passage is a JSON object"):
        load_corpus(tmp_path / "corpus.jsonl")


# ---------------------------------------------------------------- BM25


def test_bm25_recall_at_5_of_supporting_titles(bm25: BM25Search) -> None:
    rows = _rows(HOTPOT_DEV, limit=100)
    results = bm25.search_batch([row["question"] for row in rows], top_k=5)
    recalls = []
    for row, passages in zip(rows, results):
        gold = set(row["supporting_facts"]["title"])
        recalls.append(len(gold & {p.title for p in passages}) / len(gold))
    recall_at_5 = sum(recalls) / len(recalls)
    print(f"BM25 recall@5 of supporting titles on 100 HotpotQA dev questions: {recall_at_5:.3f}")
    assert recall_at_5 >= RECALL_AT_5_FLOOR


def test_bm25_results_are_scored_sorted_and_bounded(bm25: BM25Search) -> None:
    passages = bm25.search(QUERIES[0], top_k=4)
    assert len(passages) == 4
    assert {p.title for p in passages[:2]} == {"Tinted Windows (band)", "Tinted Windows (album)"}
    scores = [p.score for p in passages]
    assert scores == sorted(scores, reverse=True) and scores[-1] > 0
    assert bm25.search("qwzxv plokmnij", top_k=3) == []  # no query term in the vocabulary
    assert bm25.search("", top_k=3) == []
    assert bm25.search_batch([], top_k=3) == []


def test_bm25_top_k_larger_than_corpus(tmp_path: Path) -> None:
    one_row = json.dumps(_rows(HOTPOT_DEV, limit=1)[0]) + "\n"
    data_dir = _data_dir_with(tmp_path, "hotpotqa_distractor_dev.jsonl", one_row)
    corpus = _hotpotqa_corpus(data_dir, tmp_path / "corpus", ("validation",))
    size = len(load_corpus(corpus))
    results = BM25Search(corpus).search("album band debut performance", top_k=50)
    assert 0 < len(results) <= size == 10


def test_bm25_saves_and_reloads_its_index(bm25: BM25Search, corpus_path: Path, monkeypatch) -> None:
    index_dir = bm25.save_index()
    assert index_dir == corpus_path.with_suffix(".bm25") and (index_dir / "vocab.index.json").is_file()

    def refuse_to_build(*_args):
        raise AssertionError("the saved index should have been loaded")

    monkeypatch.setattr(BM25Search, "_build_index", refuse_to_build)
    loaded = BM25Search(corpus_path)
    query = "Which magazine was started first, Arthur's Magazine or First for Women?"
    assert loaded.search(query, top_k=5) == bm25.search(query, top_k=5)
    with pytest.raises(AssertionError, match="should have been loaded"):
        BM25Search(corpus_path, k1=1.2)  # other parameters: the saved index does not apply


def test_bm25_rejects_bad_arguments(bm25: BM25Search, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="top_k"):
        bm25.search("query", top_k=0)
    with pytest.raises(ValueError, match="queries"):
        bm25.search_batch("a single string", top_k=3)
    with pytest.raises(ValueError, match="k1"):
        BM25Search(tmp_path / "missing.jsonl", k1=-1)
    (tmp_path / "empty.jsonl").write_text("")
    with pytest.raises(ValueError, match="no passages"):
        BM25Search(tmp_path / "empty.jsonl")
    (tmp_path / "wrong.jsonl").write_text(json.dumps({"contents": "x"}) + "\n")
    with pytest.raises(ValueError, match="'id', 'title' and 'text'"):
        BM25Search(tmp_path / "wrong.jsonl")


# ---------------------------------------------------------------- Search-R1 HTTP retriever


class _RetrievalServer(ThreadingHTTPServer):
    """A Search-R1 style /retrieve endpoint over BM25Search (test code only). `behaviour` injects failures."""

    def __init__(self, backend: BM25Search) -> None:
        super().__init__(("127.0.0.1", 0), _RetrievalHandler)
        self.backend = backend
        self.behaviour = "ok"

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"


class _RetrievalHandler(BaseHTTPRequestHandler):
    server: _RetrievalServer

    def log_message(self, *_args) -> None:  # keep test output quiet
        pass

    def _reply(self, status: int, body: bytes) -> None:
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        try:
            self.wfile.write(body)
        except BrokenPipeError:
            pass  # the client gave up waiting (the timeout test)

    def do_POST(self) -> None:
        behaviour = self.server.behaviour
        if self.path != "/retrieve" or behaviour == "http_error":
            self._reply(500 if behaviour == "http_error" else 404, b'{"detail": "retriever exploded"}')
            return
        request = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        if behaviour == "slow":
            time.sleep(1.0)
        if behaviour == "bad_json":
            self._reply(200, b"<html>not json</html>")
            return
        results = self.server.backend.search_batch(request["queries"], top_k=request["topk"])
        with_scores = request["return_scores"] and behaviour != "no_scores"
        hits = [
            [
                {"document": {"id": p.id, "contents": f'"{p.title}"\n{p.text}'}, "score": p.score}
                if with_scores
                else {"id": p.id, "contents": f'"{p.title}"\n{p.text}'}
                for p in passages
            ]
            for passages in results
        ]
        if behaviour == "wrong_count":
            hits = hits[:-1]
        self._reply(200, json.dumps({"result": hits}).encode())


@pytest.fixture(scope="module")
def server(bm25: BM25Search) -> Iterator[_RetrievalServer]:
    server = _RetrievalServer(bm25)
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    yield server
    server.shutdown()
    server.server_close()
    thread.join()


@pytest.fixture()
def retrieval_server(server: _RetrievalServer) -> Iterator[_RetrievalServer]:
    server.behaviour = "ok"
    yield server
    server.behaviour = "ok"


def test_http_retriever_matches_local_bm25(retrieval_server: _RetrievalServer, bm25: BM25Search) -> None:
    remote = HttpRetriever(retrieval_server.url + "/").search_batch(QUERIES, top_k=3)
    local = bm25.search_batch(QUERIES, top_k=3)
    assert [[(p.id, p.title, p.text) for p in hits] for hits in remote] == [
        [(p.id, p.title, p.text) for p in hits] for hits in local
    ]
    assert [p.score for hits in remote for p in hits] == pytest.approx([p.score for hits in local for p in hits])


def test_http_retriever_without_scores(retrieval_server: _RetrievalServer, bm25: BM25Search) -> None:
    retrieval_server.behaviour = "no_scores"
    passages = HttpRetriever(retrieval_server.url).search(QUERIES[0], top_k=2)
    assert [p.title for p in passages] == [p.title for p in bm25.search(QUERIES[0], top_k=2)]
    assert all(p.score is None for p in passages)


@pytest.mark.parametrize(
    "behaviour, message",
    [
        ("http_error", "HTTP 500: .*retriever exploded"),
        ("bad_json", "did not answer with JSON"),
        ("wrong_count", "one list of hits per query"),
        ("slow", "cannot reach .*timed out"),
    ],
)
def test_http_retriever_raises_search_error(retrieval_server: _RetrievalServer, behaviour: str, message: str) -> None:
    retrieval_server.behaviour = behaviour
    with pytest.raises(SearchError, match=message):
        HttpRetriever(retrieval_server.url, timeout_s=0.3).search_batch(QUERIES, top_k=2)


def test_http_retriever_connection_refused() -> None:
    with socket.socket() as probe:  # a port that was free a moment ago has no server behind it
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    with pytest.raises(SearchError, match=f"cannot reach retrieval server http://127.0.0.1:{port}/retrieve"):
        HttpRetriever(f"http://127.0.0.1:{port}", timeout_s=2).search("anything")


def test_http_retriever_rejects_bad_arguments() -> None:
    with pytest.raises(ValueError, match="url"):
        HttpRetriever("127.0.0.1:8000")
    with pytest.raises(ValueError, match="timeout_s"):
        HttpRetriever("http://127.0.0.1:8000", timeout_s=0)


# ---------------------------------------------------------------- the search tool


def test_search_tool_observation_lists_numbered_passages(bm25: BM25Search) -> None:
    tool = SearchTool(bm25, top_k=2)
    observation = tool.call({"query": QUERIES[0]})
    lines = observation.splitlines()
    assert len(lines) == 2
    top = bm25.search(QUERIES[0], top_k=2)
    assert lines == [f"Doc {i} (Title: {p.title}) {p.text}" for i, p in enumerate(top, 1)]
    assert lines[0].startswith("Doc 1 (Title: Tinted Windows (")
    assert tool_schema(tool)["function"]["parameters"]["required"] == ["query"]


@pytest.mark.parametrize(
    "arguments, expected",
    [
        ({}, "Error: missing argument 'query'"),
        ({"query": ["a", "b"]}, "Error: argument 'query' must be a string"),
        ({"query": ""}, "Error: argument 'query' is empty"),
        ([{"query": "x"}], "Error: arguments must be a JSON object"),
        ({"query": "qwzxv plokmnij"}, "No results; try other keywords."),
    ],
)
def test_search_tool_turns_bad_arguments_into_observations(bm25: BM25Search, arguments, expected: str) -> None:
    assert SearchTool(bm25).call(arguments).startswith(expected)


def test_search_tool_reports_retriever_failure(retrieval_server: _RetrievalServer) -> None:
    retrieval_server.behaviour = "http_error"
    observation = SearchTool(HttpRetriever(retrieval_server.url)).call({"query": "anything"})
    assert observation.startswith("Search error: retrieval server") and "HTTP 500" in observation


def test_search_tool_rejects_bad_top_k(bm25: BM25Search) -> None:
    with pytest.raises(ValueError, match="top_k"):
        SearchTool(bm25, top_k=0)

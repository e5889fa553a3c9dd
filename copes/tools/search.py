"""Search for the agent: a local BM25 index over a passage corpus, or a Search-R1 style retrieval server.

A corpus is a jsonl file, one passage a line: {"id": str, "title": str, "text": str}.
`build_corpus_from_hotpotqa` makes one from the paragraphs that HotpotQA ships with its questions, which is the
offline stand-in for the Wikipedia dump Search-R1 retrieves from. Both retrievers return `Passage`s and raise
`SearchError` when the search itself fails (bad input is a ValueError).
"""

from __future__ import annotations

import json
from abc import ABC, abstractmethod
import os
import urllib.error
import urllib.request
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from copes.extras import require

if TYPE_CHECKING:
    import bm25s

_INDEX_META_FILE = "copes_index.json"


@dataclass(frozen=True)
class Passage:
    id: str
    title: str
    text: str
    score: float | None = None  # None when the server did not return scores


class SearchError(RuntimeError):
    """The retriever could not answer: server unreachable, HTTP error, malformed response."""


class Retriever(Protocol):
    def search(self, query: str, top_k: int = 3) -> list[Passage]: ...

    def search_batch(self, queries: Sequence[str], top_k: int = 3) -> list[list[Passage]]: ...


class _BatchRetriever(ABC):
    """Shared front: argument checks, and `search` as a batch of one."""

    def search(self, query: str, top_k: int = 3) -> list[Passage]:
        return self.search_batch([query], top_k)[0]

    def search_batch(self, queries: Sequence[str], top_k: int = 3) -> list[list[Passage]]:
        if isinstance(queries, str) or not all(isinstance(query, str) for query in queries):
            raise ValueError(f"queries must be a sequence of str, got {queries!r:.80}")
        if isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 1:
            raise ValueError(f"top_k must be a positive int, got {top_k!r}")
        if not queries:
            return []
        return self._search_batch(list(queries), top_k)

    @abstractmethod
    def _search_batch(self, queries: list[str], top_k: int) -> list[list[Passage]]:
        """The retriever itself, on validated, non-empty input."""


# ---------------------------------------------------------------- corpus from HotpotQA


def _read_records(path: Path) -> Iterator[dict[str, Any]]:
    """Rows of a jsonl file, or of a JSON array (the original HotpotQA release is one big array)."""
    with open(path, encoding="utf-8") as file:
        head = file.read(1)
        while head.isspace():
            head = file.read(1)
        file.seek(0)
        if head == "[":
            yield from json.load(file)
            return
        for line in file:
            if line.strip():
                yield json.loads(line)


def _hotpotqa_paragraphs(record: dict[str, Any], where: str) -> Iterator[tuple[str, str]]:
    context = record.get("context")
    if isinstance(context, dict):  # hub layout: {"title": [...], "sentences": [[...], ...]}
        pairs: Iterable = zip(context["title"], context["sentences"])
    elif isinstance(context, list):  # original release: [[title, [sentence, ...]], ...]
        pairs = context
    else:
        raise ValueError(f"{where}: 'context' must be a dict of lists or a list of [title, sentences] pairs")
    for title, sentences in pairs:
        # HotpotQA sentences carry their own leading spaces, so plain concatenation restores the paragraph.
        yield title, "".join(sentences).strip()


def write_corpus(paragraphs: Iterable[tuple[str, str]], out_path: Path) -> int:
    """Write one passage per distinct non-empty (title, text) as `{"id","title","text"}` jsonl; returns the count."""
    seen: set[tuple[str, str]] = set()
    out_path = Path(out_path)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    staging = out_path.with_name(f".{out_path.name}.{os.getpid()}")  # several ranks may build the same corpus
    with open(staging, "w", encoding="utf-8") as out:
        for title, text in paragraphs:
            if not text or (title, text) in seen:
                continue
            seen.add((title, text))
            passage = {"id": str(len(seen) - 1), "title": title, "text": text}
            out.write(json.dumps(passage, ensure_ascii=False) + "\n")
    os.replace(staging, out_path)
    return len(seen)


def build_corpus_from_hotpotqa(paths: list[Path], out_path: Path) -> int:
    """Write one passage per distinct (title, paragraph) found in the contexts of `paths`; returns the count."""
    if not paths:
        raise ValueError("paths must name at least one HotpotQA file")
    paragraphs = (
        paragraph
        for path in paths
        for row_number, record in enumerate(_read_records(Path(path)), 1)
        for paragraph in _hotpotqa_paragraphs(record, where=f"{path} row {row_number}")
    )
    return write_corpus(paragraphs, out_path)


def load_corpus(corpus_path: Path) -> list[Passage]:
    passages = []
    for row_number, row in enumerate(_read_records(Path(corpus_path)), 1):
        try:
            passages.append(Passage(id=str(row["id"]), title=row["title"], text=row["text"]))
        except (KeyError, TypeError) as error:
            raise ValueError(f"{corpus_path} row {row_number}: a passage needs 'id', 'title' and 'text'") from error
    return passages


# ---------------------------------------------------------------- local BM25


def _optional_stemmer() -> tuple[str | None, Callable[[list[str]], list[str]] | None]:
    """English Snowball stemming when PyStemmer happens to be installed; plain lowercase tokens otherwise."""
    try:
        import Stemmer  # PyStemmer, an optional extra of bm25s
    except ImportError:
        return None, None
    return "snowball-english", Stemmer.Stemmer("english").stemWords


class BM25Search(_BatchRetriever):
    """BM25 over a passage corpus (title + text indexed together), built once and kept in memory.

    `save_index()` writes the index to `<corpus>.bm25/` next to the corpus; a later instance loads it from there
    when it was built with the same k1, b, stemmer and corpus size, instead of re-indexing.
    """

    def __init__(self, corpus_path: Path | str, k1: float = 1.5, b: float = 0.75) -> None:
        if k1 < 0:
            raise ValueError(f"k1 must be >= 0, got {k1!r}")
        if not 0 <= b <= 1:
            raise ValueError(f"b must be in [0, 1], got {b!r}")
        self.corpus_path = Path(corpus_path)
        self.passages = load_corpus(self.corpus_path)
        if not self.passages:
            raise ValueError(f"corpus_path {self.corpus_path} holds no passages")
        self.index_dir = self.corpus_path.with_suffix(".bm25")
        require("bm25s")  # before any work: a missing extra is one clear line
        stemmer_name, self._stem = _optional_stemmer()
        self._index_meta = {
            "k1": k1,
            "b": b,
            "stemmer": stemmer_name,
            "num_passages": len(self.passages),
            "corpus_bytes": self.corpus_path.stat().st_size,
        }
        self._index = self._load_saved_index() or self._build_index(k1, b)

    def _tokenize(self, texts: list[str]) -> list[list[str]]:
        return require("bm25s").tokenize(texts, stopwords="en", stemmer=self._stem, return_ids=False, show_progress=False)

    def _build_index(self, k1: float, b: float) -> bm25s.BM25:
        index = require("bm25s").BM25(k1=k1, b=b)
        index.index(self._tokenize([f"{p.title} {p.text}" for p in self.passages]), show_progress=False)
        return index

    def _load_saved_index(self) -> bm25s.BM25 | None:
        meta_path = self.index_dir / _INDEX_META_FILE
        if not meta_path.is_file() or json.loads(meta_path.read_text()) != self._index_meta:
            return None
        return require("bm25s").BM25.load(self.index_dir, show_progress=False)

    def save_index(self) -> Path:
        self._index.save(self.index_dir, show_progress=False)
        (self.index_dir / _INDEX_META_FILE).write_text(json.dumps(self._index_meta))
        return self.index_dir

    def _search_batch(self, queries: list[str], top_k: int) -> list[list[Passage]]:
        k = min(top_k, len(self.passages))
        documents, scores = self._index.retrieve(self._tokenize(queries), k=k, show_progress=False)
        # A zero score means no query term occurs in the passage: noise to the agent, so it is dropped.
        return [
            [replace(self.passages[doc], score=float(score)) for doc, score in zip(row_docs, row_scores) if score > 0]
            for row_docs, row_scores in zip(documents.tolist(), scores.tolist())
        ]


# ---------------------------------------------------------------- Search-R1 retrieval server


def _split_contents(contents: str) -> tuple[str, str]:
    """Search-R1 corpora store a passage as '"Title"\\ntext'."""
    first_line, newline, rest = contents.partition("\n")
    if not newline:
        return "", contents.strip()
    return first_line.strip().strip('"'), rest.strip()


def _passage_from_hit(hit: Any) -> Passage:
    if not isinstance(hit, dict):
        raise SearchError(f"retrieval result entries must be objects, got {hit!r:.100}")
    document, score = (hit["document"], hit.get("score")) if "document" in hit else (hit, None)
    if not isinstance(document, dict) or not isinstance(document.get("contents"), str):
        raise SearchError(f"retrieved document has no 'contents' string: {document!r:.100}")
    if score is not None and not isinstance(score, (int, float)):
        raise SearchError(f"retrieved score is not a number: {score!r:.50}")
    title, text = _split_contents(document["contents"])
    return Passage(
        id=str(document.get("id", "")), title=title, text=text, score=None if score is None else float(score)
    )


class HttpRetriever(_BatchRetriever):
    """Client of a Search-R1 retrieval server (`POST {url}/retrieve`)."""

    def __init__(self, url: str, timeout_s: float = 10.0) -> None:
        if not isinstance(url, str) or not url.startswith(("http://", "https://")):
            raise ValueError(f"url must start with http:// or https://, got {url!r}")
        if not timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s!r}")
        self.endpoint = url.rstrip("/") + "/retrieve"
        self.timeout_s = timeout_s

    def _search_batch(self, queries: list[str], top_k: int) -> list[list[Passage]]:
        payload = json.dumps({"queries": queries, "topk": top_k, "return_scores": True}).encode()
        request = urllib.request.Request(
            self.endpoint, data=payload, headers={"Content-Type": "application/json"}, method="POST"
        )
        try:
            with urllib.request.urlopen(request, timeout=self.timeout_s) as response:
                body = response.read()
        except urllib.error.HTTPError as error:
            detail = error.read(300).decode("utf-8", errors="replace")
            raise SearchError(f"retrieval server {self.endpoint} answered HTTP {error.code}: {detail}") from error
        except (urllib.error.URLError, OSError) as error:
            reason = getattr(error, "reason", error)
            raise SearchError(f"cannot reach retrieval server {self.endpoint}: {reason}") from error
        try:
            result = json.loads(body)["result"]
        except (ValueError, KeyError, TypeError) as error:
            raise SearchError(f"{self.endpoint} did not answer with JSON holding 'result': {body[:200]!r}") from error
        if not isinstance(result, list) or len(result) != len(queries) or not all(isinstance(r, list) for r in result):
            raise SearchError(
                f"{self.endpoint} must return one list of hits per query ({len(queries)}), got {result!r:.200}"
            )
        return [[_passage_from_hit(hit) for hit in hits[:top_k]] for hits in result]

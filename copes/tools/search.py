"""Search for the agent: a local BM25 index over a passage corpus, or a Search-R1 style retrieval server.

A corpus is a jsonl file, one passage a line: {"id": str, "title": str, "text": str}. `write_corpus` makes one
from (title, paragraph) pairs, e.g. the paragraphs the QA task loaders keep with each question (HotpotQA's are
the offline stand-in for the Wikipedia dump Search-R1 retrieves from). Both retrievers return `Passage`s and
raise `SearchError` when the search itself fails (bad input is a ValueError).

The retrieval server's answer is untrusted: one total deadline per call (a server dripping a byte at a time
cannot hold it longer), a cap on the response size, no redirects, every failure a SearchError, and every string
of a passage valid Unicode (a lone surrogate, escaped in the JSON or sent as raw bytes, becomes U+FFFD).
"""

from __future__ import annotations

import http.client
import json
import os
import socket
import threading
import time
import urllib.parse
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from copes.extras import require
from copes.text import valid_unicode

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


# ---------------------------------------------------------------- corpus


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


def load_corpus(corpus_path: Path) -> list[Passage]:
    passages = []
    with open(corpus_path, encoding="utf-8") as lines:
        for row_number, line in enumerate(lines, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
                passages.append(Passage(id=str(row["id"]), title=row["title"], text=row["text"]))
            except (ValueError, KeyError, TypeError) as error:
                raise ValueError(
                    f"{corpus_path} row {row_number}: a passage is a JSON object with 'id', 'title' and 'text'"
                ) from error
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
        return require("bm25s").tokenize(texts, stopwords="en", stemmer=self._stem, return_ids=False,
                                         show_progress=False)

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
    try:
        score = None if score is None else float(score)
    except OverflowError:  # an integer too large for a float
        raise SearchError("retrieved score is out of range") from None
    title, text = _split_contents(valid_unicode(document["contents"]))
    return Passage(id=valid_unicode(str(document.get("id", ""))), title=title, text=text, score=score)


class HttpRetriever(_BatchRetriever):
    """Client of a Search-R1 retrieval server (`POST {url}/retrieve`).

    `timeout_s` bounds the whole call (connect, send, every byte of the answer); `max_response_bytes` its size."""

    def __init__(self, url: str, timeout_s: float = 10.0, max_response_bytes: int = 4 << 20) -> None:
        if not isinstance(url, str) or not url.startswith(("http://", "https://")):
            raise ValueError(f"url must start with http:// or https://, got {url!r}")
        if not timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s!r}")
        if isinstance(max_response_bytes, bool) or not isinstance(max_response_bytes, int) or max_response_bytes < 1:
            raise ValueError(f"max_response_bytes must be a positive int, got {max_response_bytes!r}")
        self.endpoint = url.rstrip("/") + "/retrieve"
        self.timeout_s = timeout_s
        self.max_response_bytes = max_response_bytes

    def _post(self, payload: bytes) -> bytes:
        """The response body; SearchError on any failure, past the deadline or over the size cap."""
        parts = urllib.parse.urlsplit(self.endpoint)
        connection_type = http.client.HTTPSConnection if parts.scheme == "https" else http.client.HTTPConnection
        deadline = time.monotonic() + self.timeout_s
        try:
            connection = connection_type(parts.hostname, parts.port, timeout=self.timeout_s)
        except (ValueError, http.client.HTTPException) as error:
            raise SearchError(f"bad retrieval server address {self.endpoint}: {error}") from error
        watchdog = None
        try:
            connection.connect()  # bounded by the socket timeout
            # At the deadline the socket is shut down, which ends whatever read or write is blocked on it (the
            # response keeps reading from this socket even after the connection object lets go of it).
            watchdog = threading.Timer(max(deadline - time.monotonic(), 0.0), _shut_down, args=(connection.sock,))
            watchdog.daemon = True
            watchdog.start()
            connection.request("POST", parts.path or "/", body=payload, headers={"Content-Type": "application/json"})
            response = connection.getresponse()
            body = response.read(self.max_response_bytes + 1)
            # Fewer bytes than Content-Length promised: the server hung up, or the deadline cut it off.
            if response.length and len(body) <= self.max_response_bytes:
                raise http.client.IncompleteRead(body, response.length)
        except (OSError, http.client.HTTPException, ValueError) as error:
            if time.monotonic() >= deadline:
                raise SearchError(
                    f"cannot reach retrieval server {self.endpoint}: timed out after {self.timeout_s:g}s "
                    "(one deadline for the whole call)"
                ) from None
            raise SearchError(f"cannot reach retrieval server {self.endpoint}: {error!r}") from error
        finally:
            if watchdog is not None:
                watchdog.cancel()
            connection.close()
        if response.status != 200:  # redirects included: the agent's search goes to the configured server only
            detail = body[:300].decode("utf-8", errors="replace")
            raise SearchError(f"retrieval server {self.endpoint} answered HTTP {response.status}: {detail}")
        if len(body) > self.max_response_bytes:
            raise SearchError(f"retrieval server {self.endpoint} answered more than {self.max_response_bytes} bytes")
        return body

    def _search_batch(self, queries: list[str], top_k: int) -> list[list[Passage]]:
        body = self._post(json.dumps({"queries": queries, "topk": top_k, "return_scores": True}).encode())
        try:
            result = json.loads(body)["result"]
        except (ValueError, KeyError, TypeError, RecursionError) as error:
            raise SearchError(f"{self.endpoint} did not answer with JSON holding 'result': {body[:200]!r}") from error
        if not isinstance(result, list) or len(result) != len(queries) or not all(isinstance(r, list) for r in result):
            raise SearchError(
                f"{self.endpoint} must return one list of hits per query ({len(queries)}), got {result!r:.200}"
            )
        return [[_passage_from_hit(hit) for hit in hits[:top_k]] for hits in result]


def _shut_down(sock: socket.socket) -> None:
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass  # already closed

"""Dataset rows from local files in their original formats, or from the Hugging Face hub.

A local file wins: runs and tests read the offline copies under the data directory (`shared/data` next to the
repository, or $COPES_DATA_DIR); the hub is only asked when a split has no local file. Every row is checked
for the fields the task needs, and a bad row fails loudly with its file and line instead of surfacing later
as a KeyError in the middle of a training step.
"""

from __future__ import annotations

import json
import os
import socket
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

from copes.errors import UserError
from copes.extras import require
from copes.tasks.base import Example

DATA_DIR_ENV = "COPES_DATA_DIR"
LOCAL_FORMATS = (".jsonl", ".json", ".parquet")


# The open `recording_data_files` blocks: each collects the local data files read inside it.
_RECORDERS: list[dict[Path, None]] = []


@contextmanager
def recording_data_files() -> Iterator[dict[Path, None]]:
    """The local data files `load_split_rows` reads inside the block, in the order first read (a trainer hashes its
    task's into the journal: a changed file refuses a resume, as a user's data file does)."""
    found: dict[Path, None] = {}
    _RECORDERS.append(found)
    try:
        yield found
    finally:
        _RECORDERS.remove(found)


class DatasetError(UserError):
    """A dataset file or row that cannot be used; the message names the file (or hub id) and the line."""


def default_data_dir() -> Path | None:
    """$COPES_DATA_DIR, else the first `shared/data` found beside a folder above this file, else None."""
    if os.environ.get(DATA_DIR_ENV):
        return Path(os.environ[DATA_DIR_ENV])
    for folder in Path(__file__).resolve().parents:
        candidate = folder / "shared" / "data"
        if candidate.is_dir():
            return candidate
    return None


def resolve_data_dir(data_dir: str | Path | None) -> Path | None:
    return Path(data_dir) if data_dir is not None else default_data_dir()


def _check_fields(row: Any, required: Iterable[str], where: str) -> dict[str, Any]:
    if not isinstance(row, dict):
        raise DatasetError(f"{where}: expected a JSON object, got {type(row).__name__}")
    missing = [name for name in required if name not in row]
    if missing:
        raise DatasetError(f"{where}: missing required field(s) {missing}; the row has {sorted(row)}")
    return row


def _read_jsonl(path: Path, required: tuple[str, ...]) -> list[dict[str, Any]]:
    rows = []
    with path.open(encoding="utf-8") as lines:
        for line_number, line in enumerate(lines, start=1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as error:
                raise DatasetError(f"{path}:{line_number}: broken JSON line ({error.msg})") from error
            rows.append(_check_fields(row, required, f"{path}:{line_number}"))
    return rows


def _read_json(path: Path, required: tuple[str, ...]) -> list[dict[str, Any]]:
    try:
        document = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as error:
        raise DatasetError(f"{path}:{error.lineno}: broken JSON ({error.msg})") from error
    if isinstance(document, dict) and isinstance(document.get("data"), list):
        document = document["data"]
    if not isinstance(document, list):
        raise DatasetError(f"{path}: expected a JSON list of rows or {{\"data\": [...]}}")
    # json gives no positions for parsed values, so a whole-file JSON row is named by its index.
    return [_check_fields(row, required, f"{path}: row {index}") for index, row in enumerate(document)]


def _read_parquet(path: Path, required: tuple[str, ...]) -> list[dict[str, Any]]:
    import pandas as pd  # only parquet needs it

    records = pd.read_parquet(path).to_dict(orient="records")
    return [_check_fields(row, required, f"{path}: row {index}") for index, row in enumerate(records)]


_READERS: dict[str, Callable[[Path, tuple[str, ...]], list[dict[str, Any]]]] = {
    ".jsonl": _read_jsonl,
    ".json": _read_json,
    ".parquet": _read_parquet,
}


def read_rows(path: str | Path, required: Iterable[str] = ()) -> list[dict[str, Any]]:
    """All rows of a local .jsonl / .json / .parquet file, each checked for the `required` fields."""
    path = Path(path)
    if path.suffix not in _READERS:
        raise DatasetError(f"{path}: unsupported format {path.suffix!r}; use one of {LOCAL_FORMATS}")
    if not path.is_file():
        raise DatasetError(f"{path}: no such file")
    return _READERS[path.suffix](path, tuple(required))


@dataclass(frozen=True)
class HubSplit:
    """Where a split lives on the Hugging Face hub: `datasets.load_dataset(repo, config, split=split)`."""

    repo: str
    split: str
    config: str | None = None


def _hub_unreachable(timeout_s: float = 3.0) -> str | None:
    """Why the Hugging Face hub cannot be asked now (offline mode, or no connection within `timeout_s`); None when
    it answers. A cached copy of the dataset is not consulted: local data belongs under the data dir."""
    if any(os.environ.get(name, "").lower() in ("1", "true", "yes", "on")
           for name in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE")):
        return "offline mode is set"
    host = urlparse(os.environ.get("HF_ENDPOINT") or "https://huggingface.co")
    try:
        socket.create_connection((host.hostname, host.port or 443), timeout=timeout_s).close()
    except OSError as error:
        return f"{host.hostname} cannot be reached: {error.strerror or error}"
    return None


def load_split_rows(
    data_dir: Path | None, local_files: Iterable[str], hub: HubSplit | None, required: Iterable[str]
) -> list[dict[str, Any]]:
    """Rows of the first of `local_files` (relative to `data_dir`) that exists, else of the `hub` split."""
    required = tuple(required)
    local_files = tuple(local_files)
    if data_dir is not None:
        for relative in local_files:
            if (data_dir / relative).is_file():
                for found in _RECORDERS:
                    found[(data_dir / relative).resolve()] = None
                return read_rows(data_dir / relative, required)
    missing = (f"no local file among {list(local_files)} under data dir {data_dir}; pass --data-dir (data_dir=) or "
               f"set ${DATA_DIR_ENV} to a folder holding {local_files[0]}")
    if hub is None:
        raise DatasetError(f"{missing} (this split has no hub copy)")
    unreachable = _hub_unreachable()
    if unreachable:  # one line now, not datasets' retries and a traceback half a minute later
        raise DatasetError(f"{missing}, or reach the hub for {hub.repo} ({unreachable})")
    datasets = require("datasets")  # slow to import and needs the network: only when a split comes from the hub

    try:
        dataset = datasets.load_dataset(hub.repo, hub.config, split=hub.split)
    except ConnectionError as error:
        raise DatasetError(f"{missing}, or reach the hub ({error})") from None
    where = f"hub {hub.repo}[{hub.config or 'default'}] split {hub.split}"
    return [_check_fields(dict(row), required, f"{where}: row {index}") for index, row in enumerate(dataset)]


class CachedSplits:
    """A task's examples per split, built on first request and kept; `get` applies the protocol's `limit`."""

    def __init__(self, task_name: str, builders: Mapping[str, Callable[[], list[Example]]]) -> None:
        self.task_name = task_name
        self._builders = dict(builders)
        self._cache: dict[str, list[Example]] = {}

    @property
    def splits(self) -> list[str]:
        return list(self._builders)

    def get(self, split: str, limit: int | None = None) -> list[Example]:
        if split not in self._builders:
            raise ValueError(f"task {self.task_name!r} has no split {split!r}; choose one of {self.splits}")
        if limit is not None and limit < 0:
            raise ValueError(f"limit must be >= 0 or None, got {limit}")
        if split not in self._cache:
            self._cache[split] = self._builders[split]()
        examples = self._cache[split]
        return list(examples if limit is None else examples[:limit])

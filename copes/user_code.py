"""The user's code and files as a run names them: `MODULE:NAME` import paths (a task factory, a reward function),
the source file behind one, the one SHA-256 helper the journal, the checkpoints and the plugins hash with, and the
cap on what one call of user code (a reward, a tool) may print.

A foundation module: tasks, rewards and the durable run all read user code through it, so none of them imports
another room for it.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib
import importlib.util
import os
import sys
import tempfile
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TextIO

from copes.errors import ConfigError


def is_import_path(spec: str) -> bool:
    """`MODULE:NAME` with a dotted Python module name (not a file path, not a hub id)."""
    module, sep, name = spec.partition(":")
    return bool(sep) and name.isidentifier() and all(part.isidentifier() for part in module.split("."))


def _importable_from_cwd() -> None:
    """The working directory on sys.path, as `python -m` has it: user modules live beside the user's data."""
    if os.getcwd() not in sys.path and "" not in sys.path:
        sys.path.insert(0, os.getcwd())


def import_object(spec: str, what: str) -> Any:
    """The object `MODULE:NAME` names; a missing module or name is one ConfigError line."""
    if not is_import_path(spec):
        raise ConfigError(f"{what} {spec!r} is not MODULE:NAME")
    module_name, _, name = spec.partition(":")
    _importable_from_cwd()
    try:
        module = importlib.import_module(module_name)
    except ImportError as error:
        raise ConfigError(f"{what} {spec}: cannot import {module_name} from the working directory or "
                          f"PYTHONPATH ({error})") from None
    except Exception as error:  # noqa: BLE001 - the user's module failed while importing: one line, not a traceback
        raise ConfigError(f"{what} {spec}: importing {module_name} failed ({type(error).__name__}: {error})") from None
    if not hasattr(module, name):
        raise ConfigError(f"{what} {spec}: module {module_name} ({module.__file__}) has no {name!r}")
    return getattr(module, name)


def module_source(spec_or_module: str) -> Path | None:
    """The source file of the module in `MODULE:NAME` (or a bare module name), found without running it."""
    _importable_from_cwd()
    try:
        found = importlib.util.find_spec(spec_or_module.partition(":")[0])
    except (ImportError, ValueError):
        return None
    return Path(found.origin) if found is not None and found.origin and Path(found.origin).is_file() else None


def sha256_of(path: Path) -> str:
    """The hex SHA-256 of a file's bytes, or of a folder: every file under it by relative name and digest, in
    sorted order (a renamed, added or changed file changes it)."""
    if path.is_dir():
        digest = hashlib.sha256()
        for file in sorted(p for p in path.rglob("*") if p.is_file()):
            digest.update(f"{file.relative_to(path)}\0{sha256_of(file)}\0".encode())
        return digest.hexdigest()
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


# What one call of user code may print (its stdout and stderr together); the rest is dropped, said once. A reward
# that printed a MiB a call flooded the terminal with 16 MiB in 3 small steps, and a longer run's log with 142 MB.
OUTPUT_CAP_BYTES = 2048


class OutputCap:
    """Captures what each call of one kind of user code (`what`: "a reward", "a tool") prints and passes the first
    OUTPUT_CAP_BYTES of each call on to stderr; the first call past the cap adds one line saying so.

    `process()` captures at the file descriptors (print, C code, child processes: all of it), for a worker process
    that runs one call at a time; `this_thread()` captures Python's sys.stdout and sys.stderr for the calling thread
    only, for calls made in the trainer's process, several at once on a tool pool's threads."""

    def __init__(self, what: str) -> None:
        self.what, self.said = what, False

    def pass_on(self, head: bytes, printed: int, write: Callable[[bytes], Any]) -> None:
        write(head[:OUTPUT_CAP_BYTES])
        if printed > OUTPUT_CAP_BYTES and not self.said:
            self.said = True
            write(f"\nnote: {self.what} printed {printed} bytes in one call; only the first {OUTPUT_CAP_BYTES} of "
                  "each call are shown\n".encode())

    @contextlib.contextmanager
    def process(self) -> Iterator[None]:
        """Run a call with fds 1 and 2 pointed at a temporary file (of this call's output only)."""
        for stream in (sys.stdout, sys.stderr):
            stream.flush()
        saved = os.dup(1), os.dup(2)
        with tempfile.TemporaryFile() as capture:
            os.dup2(capture.fileno(), 1)
            os.dup2(capture.fileno(), 2)
            try:
                yield
            finally:
                for stream in (sys.stdout, sys.stderr):
                    stream.flush()
                os.dup2(saved[0], 1)
                os.dup2(saved[1], 2)
                for descriptor in saved:
                    os.close(descriptor)
                printed = capture.seek(0, os.SEEK_END)
                capture.seek(0)
                self.pass_on(capture.read(OUTPUT_CAP_BYTES), printed, lambda data: os.write(2, data))

    @contextlib.contextmanager
    def this_thread(self) -> Iterator[None]:
        """Run a call with what this thread writes to sys.stdout and sys.stderr kept (up to the cap) and counted."""
        for name in ("stdout", "stderr"):  # once per stream: other threads write through as before
            if not isinstance(getattr(sys, name), _ThreadRouted):
                setattr(sys, name, _ThreadRouted(getattr(sys, name)))
        capture, outer = _Capture(), getattr(_routing, "capture", None)
        _routing.capture = capture
        try:
            yield
        finally:
            _routing.capture = outer
            self.pass_on(bytes(capture.head), capture.printed,
                         lambda data: sys.stderr.write(data.decode("utf-8", errors="replace")))


class _Capture:
    """One call's output: its first OUTPUT_CAP_BYTES, and how many bytes it printed in all."""

    def __init__(self) -> None:
        self.head, self.printed = bytearray(), 0

    def add(self, text: str) -> None:
        data = text.encode("utf-8", errors="replace")
        self.printed += len(data)
        self.head += data[: max(OUTPUT_CAP_BYTES - len(self.head), 0)]


_routing = threading.local()  # .capture: the _Capture of the call this thread is in, if any


class _ThreadRouted:
    """sys.stdout or sys.stderr, with the writes of a thread inside an `OutputCap.this_thread` call kept aside."""

    def __init__(self, stream: TextIO) -> None:
        self.stream = stream

    def write(self, text: str) -> int:
        capture = getattr(_routing, "capture", None)
        if capture is None:
            return self.stream.write(text)
        capture.add(text)
        return len(text)

    def __getattr__(self, name: str) -> Any:  # flush, isatty, fileno, encoding...: the stream's own
        return getattr(self.stream, name)

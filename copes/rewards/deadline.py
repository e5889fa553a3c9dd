"""A worker process that answers calls under a deadline and is replaced when it hangs or dies: the one mechanism
behind the math verifier's pool (`copes.rewards.math`) and user reward functions (`copes.rewards.functions`).

The worker is a fresh interpreter (`python -c`) that imports the function by name, so it never runs the caller's
`__main__` again: multiprocessing's spawn re-imports a plain script's top level in every worker, which re-ran a
whole training run per reward worker when the script lacked `if __name__ == "__main__":`. A function a fresh
interpreter cannot import (one defined in the caller's `__main__`, a lambda, a closure) is inherited by fork
instead, which runs nothing again either.

Calls and answers travel as length-prefixed pickles over two pipes. A call that outlives its deadline kills the
worker (its state is unknown) and a fresh one serves the next call; with `abandon_after_timeout` the worker is
instead abandoned until `resume()` (a hanging reward then costs one timeout per step, not one per call).
"""

from __future__ import annotations

import importlib
import multiprocessing
import os
import pickle
import select
import struct
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from copes.user_code import OutputCap

DEFAULT_STARTUP_TIMEOUT_S = 120.0  # a fresh worker imports the target's module (sympy, a user's libraries) first
_HEADER = struct.Struct("<Q")
_PACKAGE_ROOT = Path(__file__).resolve().parents[2]
_WORKER_MAIN = "from copes.rewards.deadline import serve_stdio; serve_stdio()"


class WorkerTimeout(Exception):
    """The call gave no answer within its deadline (the worker was killed, or is abandoned)."""


class WorkerDied(Exception):
    """The worker exited or could not be started (the message says why)."""


class WorkerRaised(Exception):
    """The function raised in the worker; the worker is fine and serves the next call."""


# ---------------------------------------------------------------------------------------------------------
# Framing: one pickle per message, prefixed by its length, so a reader knows when a message is whole.


def _send(fd: int, message: Any) -> None:
    payload = pickle.dumps(message)
    data = memoryview(_HEADER.pack(len(payload)) + payload)
    while data:
        data = data[os.write(fd, data):]


def _read_exactly(fd: int, size: int, deadline: float | None) -> bytes:
    chunks, missing = [], size
    while missing:
        if deadline is not None:
            remaining = deadline - time.monotonic()
            if remaining <= 0 or not select.select([fd], [], [], remaining)[0]:
                raise WorkerTimeout
        chunk = os.read(fd, min(missing, 1 << 20))
        if not chunk:
            raise EOFError
        chunks.append(chunk)
        missing -= len(chunk)
    return b"".join(chunks)


def _receive(fd: int, deadline: float | None = None) -> Any:
    (size,) = _HEADER.unpack(_read_exactly(fd, _HEADER.size, deadline))
    return pickle.loads(_read_exactly(fd, size, deadline))


# ---------------------------------------------------------------------------------------------------------
# Worker side.


def import_by_name(spec: str) -> Any:
    """The object `MODULE:NAME` names (the worker's own lookup; the caller checked the spec before)."""
    module, _, name = spec.partition(":")
    return getattr(importlib.import_module(module), name)


def _serve(read_fd: int, write_fd: int, target: str | bytes | Callable[..., Any], setup: str | None) -> None:
    """Resolve the function once, say ready (or why not), then answer `(args, kwargs)` calls until the pipe closes."""
    try:
        if setup:
            import_by_name(setup)()
        if isinstance(target, str):
            function = import_by_name(target)
        else:
            function = pickle.loads(target) if isinstance(target, bytes) else target
    except BaseException as error:  # noqa: BLE001 - reported to the parent, which says it in one line
        _send(write_fd, ("error", f"{type(error).__name__}: {error}"))
        return
    _send(write_fd, ("ready", None))
    output = OutputCap("a reward")
    while True:
        try:
            args, kwargs = _receive(read_fd)
        except EOFError:
            return
        try:
            with output.process():
                answer = ("ok", function(*args, **kwargs))
            _send(write_fd, answer)
        except Exception as error:  # noqa: BLE001 - user code's failure (or an unpicklable answer) is that call's
            _send(write_fd, ("error", f"{type(error).__name__}: {error}"))


def serve_stdio() -> None:
    """Entry point of a fresh-interpreter worker: the first message on stdin names the target, its setup and the
    caller's sys.path (what the caller can import, the worker can). Answers go to a private copy of stdout; fd 1
    then points at stderr, so a stray print cannot corrupt them."""
    read_fd, write_fd = sys.stdin.fileno(), os.dup(sys.stdout.fileno())
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())
    target, setup, caller_path = _receive(read_fd)
    sys.path.extend(entry for entry in caller_path if entry not in sys.path)
    _serve(read_fd, write_fd, target, setup)


# ---------------------------------------------------------------------------------------------------------
# Caller side.


def fresh_target(function: Callable[..., Any]) -> bytes | None:
    """`function` as a pickled reference a fresh interpreter can import, or None (defined in `__main__`, a lambda,
    a closure): those are inherited by fork."""
    if getattr(function, "__module__", None) in ("__main__", "__mp_main__"):
        return None
    try:
        return pickle.dumps(function)
    except (pickle.PicklingError, AttributeError, TypeError):
        return None


class DeadlineWorker:
    """`target` (`MODULE:NAME`, or a callable) in a worker process of its own, called with a deadline per call.

    `setup` (`MODULE:NAME` of a no-argument function) runs in a fresh worker before it says ready. A worker that
    hangs or dies is killed and a fresh one starts with the next call; one that raises keeps serving."""

    def __init__(self, target: str | Callable[..., Any], *, setup: str | None = None,
                 abandon_after_timeout: bool = False, startup_timeout_s: float = DEFAULT_STARTUP_TIMEOUT_S) -> None:
        self.function = target if callable(target) else None
        self.target = target if isinstance(target, str) else fresh_target(target)
        self.setup, self.startup_timeout_s = setup, startup_timeout_s
        self.abandon_after_timeout, self.abandoned = abandon_after_timeout, False
        self.process: subprocess.Popen[bytes] | multiprocessing.process.BaseProcess | None = None
        self.read_fd = self.write_fd = -1
        self.ready = False

    def start(self) -> None:
        """Start the worker now (its imports then overlap with the caller's own work); calls start it otherwise."""
        if self.target is not None:
            environment = dict(os.environ)
            # The worker imports copes by name: make the package importable even where it is not installed.
            environment["PYTHONPATH"] = os.pathsep.join(filter(None, [str(_PACKAGE_ROOT),
                                                                      environment.get("PYTHONPATH")]))
            process = subprocess.Popen([sys.executable, "-c", _WORKER_MAIN], stdin=subprocess.PIPE,
                                       stdout=subprocess.PIPE, env=environment)
            self.process, self.write_fd, self.read_fd = process, process.stdin.fileno(), process.stdout.fileno()
            _send(self.write_fd, (self.target, self.setup, [os.path.abspath(entry) for entry in sys.path]))
        else:
            to_worker, from_worker = os.pipe(), os.pipe()
            context = multiprocessing.get_context("fork")
            self.process = context.Process(target=_serve, args=(to_worker[0], from_worker[1], self.function, None),
                                           daemon=True)
            self.process.start()
            os.close(to_worker[0])
            os.close(from_worker[1])
            self.read_fd, self.write_fd = from_worker[0], to_worker[1]
        self.ready = False

    def call(self, *args: Any, timeout_s: float, **kwargs: Any) -> Any:
        """The function's answer to `(*args, **kwargs)`; WorkerTimeout, WorkerDied or WorkerRaised otherwise."""
        if self.abandoned:
            raise WorkerTimeout("abandoned after an earlier timeout")
        if self.process is None:
            self.start()
        try:
            if not self.ready:
                status, value = _receive(self.read_fd, time.monotonic() + self.startup_timeout_s)
                if status != "ready":
                    self.close()
                    raise WorkerDied(f"could not be loaded: {value}")
                self.ready = True
            _send(self.write_fd, (args, kwargs))
            status, value = _receive(self.read_fd, time.monotonic() + timeout_s)
        except WorkerTimeout:
            self.close()
            self.abandoned = self.abandon_after_timeout
            raise
        except (EOFError, OSError):
            self.close()
            raise WorkerDied("lost its worker process (a fresh one serves the next call)") from None
        if status == "error":
            raise WorkerRaised(value)
        return value

    def resume(self) -> None:
        """Serve calls again after an abandoning timeout (the next call starts a fresh worker)."""
        self.abandoned = False

    def close(self) -> None:
        process, self.process = self.process, None
        if process is None:
            return
        process.kill()
        if isinstance(process, subprocess.Popen):
            process.wait()
            process.stdin.close()
            process.stdout.close()
        else:
            process.join()
            os.close(self.read_fd)
            os.close(self.write_fd)
        self.ready = False

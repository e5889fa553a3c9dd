"""Math answer correctness with math-verify, isolated in a small pool of worker processes.

math-verify bounds its own work with `signal.alarm`, which only works in a process's main thread, and some
inputs still run long (huge powers and factorials, deep nesting). So every check runs in a persistent worker
process (`copes.rewards.deadline`; its main thread, where the alarms work) and the caller waits with an outer
timeout: a check that times out scores False and its worker is killed and replaced. This makes `math_correct`
safe to call from any thread of the trainer and bounded in time whatever the model writes.

Parsing: gold and prediction are final answers as strings (`extract_answer` output). The prediction is parsed
ONE way, never two, so it commits to one answer (a union of two parses could match two different golds, e.g. a
box parse giving 5 and a prose parse giving 7 for `5 \\text{ or {the answer} is 7}`):

- LaTeX (no English word outside LaTeX commands and their arguments, `\\text{...}` included): wrapped in
  `\\boxed{...}` and parsed, because math-verify only reads bare LaTeX such as `\\frac{\\pi}{6}` or `p - q`
  inside a box or math delimiters. Bare expressions are never mined for numbers ("6 - 5i" is not 5).
- prose ("18 dollars", or a whole output without a box): parsed as it is, so math-verify picks the one answer
  the sentence states (its last box, else its final-answer phrase or number); the boxed parse is used only when
  that finds nothing.

The gold is parsed first and passed first: `verify(gold, prediction)` is asymmetric.
"""

from __future__ import annotations

import atexit
import os
import queue
import re
import threading
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

from copes.extras import check_installed
from copes.rewards.deadline import DeadlineWorker, WorkerDied, WorkerRaised, WorkerTimeout
from copes.rewards.extract import closing_braces

DEFAULT_TIMEOUT_S = 10.0
# math-verify's own alarms (whole seconds) end most slow checks gracefully, well before the outer timeout,
# so the worker survives; the outer timeout is the backstop for what the alarms cannot interrupt.
_INNER_TIMEOUT_S = 3
# The first check waits for the worker to import sympy and math-verify (about a second, more on a busy host).
_STARTUP_TIMEOUT_S = 120.0
# A hostile answer like 10^{10^{10}} can try to allocate gigabytes before any timeout fires; capping the
# worker's address space turns that into a MemoryError inside math-verify (scored False) instead.
_WORKER_MEMORY_LIMIT_BYTES = 4 << 30
# A LaTeX command with its first argument (`\\text{ cm}`, `\\begin{pmatrix}`, braces balanced) is not prose; a
# word of two or more letters left after removing those is.
_LATEX_COMMAND = re.compile(r"\\[A-Za-z]+\s*")
_PROSE_WORD = re.compile(r"[A-Za-z]{2,}")


# ---------------------------------------------------------------------------------------------------------
# Worker side: runs in the child process.


def _without_latex_commands(text: str) -> str:
    """`text` with every LaTeX command and its first brace argument (nested braces included) removed."""
    closing = closing_braces(text)
    kept, position = [], 0
    for match in _LATEX_COMMAND.finditer(text):
        if match.start() < position:
            continue  # inside an argument already removed
        kept.append(text[position : match.start()])
        position = closing.get(match.end(), match.end() - 1) + 1
    kept.append(text[position:])
    return " ".join(kept)


def _looks_like_prose(text: str) -> bool:
    """True when `text` has an English word outside LaTeX commands ("18 dollars", "The answer is 5")."""
    return _PROSE_WORD.search(_without_latex_commands(text)) is not None


def _parse_answer(text: str, *, may_be_prose: bool) -> list:
    """math-verify's parse of one answer, read one way only (see the module docstring)."""
    from math_verify import parse

    if may_be_prose and _looks_like_prose(text):
        # Boxed prose parses as a product of letters; the raw parse finds the answer inside the sentence.
        parsed = parse(text, parsing_timeout=_INNER_TIMEOUT_S)
        if parsed:
            return parsed
    return parse(f"\\boxed{{{text}}}", parsing_timeout=_INNER_TIMEOUT_S)


def _check(prediction: str, gold: str) -> bool:
    from math_verify import verify

    gold_parsed = _parse_answer(gold, may_be_prose=False)
    prediction_parsed = _parse_answer(prediction, may_be_prose=True)
    if not gold_parsed or not prediction_parsed:
        return False
    return bool(verify(gold_parsed, prediction_parsed, timeout_seconds=_INNER_TIMEOUT_S))


def prepare_worker() -> None:
    """Setup of a math-verify worker (`copes.rewards.deadline`): cap its memory, import math-verify before it says
    ready (so no check is timed on the import), quiet its per-timeout warnings."""
    import logging

    try:
        import resource

        resource.setrlimit(resource.RLIMIT_AS, (_WORKER_MEMORY_LIMIT_BYTES, _WORKER_MEMORY_LIMIT_BYTES))
    except (ImportError, ValueError, OSError):
        pass  # no POSIX rlimits here: the outer timeout still bounds the time
    import math_verify  # noqa: F401

    # math-verify logs every inner timeout as a warning; the False result already says it.
    logging.getLogger("math_verify").setLevel(logging.ERROR)


def check_in_worker(prediction: str, gold: str) -> bool:
    """`_check`, a malformed answer (MemoryError included) scoring False."""
    try:
        return _check(prediction, gold)
    except Exception:  # noqa: BLE001
        return False


# ---------------------------------------------------------------------------------------------------------
# Parent side.


def _verifier() -> DeadlineWorker:
    # Not abandoned after a timeout: a timeout here is one hostile answer, not a broken verifier.
    return DeadlineWorker("copes.rewards.math:check_in_worker", setup="copes.rewards.math:prepare_worker",
                          startup_timeout_s=_STARTUP_TIMEOUT_S)


class MathVerifierPool:
    """`num_workers` persistent math-verify processes; checks from any thread, each bounded by `timeout_s`."""

    def __init__(self, num_workers: int = 2, timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
        if num_workers < 1:
            raise ValueError(f"num_workers must be >= 1, got {num_workers}")
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        check_installed("math_verify")  # the workers import it; a missing extra is one clear line here
        self.num_workers = num_workers
        self.timeout_s = timeout_s
        self._idle: queue.Queue[DeadlineWorker] = queue.Queue()
        self._all: set[DeadlineWorker] = set()
        self._lock = threading.Lock()
        self._closed = False
        for _ in range(num_workers):
            self._add_worker()  # started now so that their imports overlap with the caller's own work

    def _add_worker(self) -> None:
        worker = _verifier()
        worker.start()
        with self._lock:
            self._all.add(worker)
        self._idle.put(worker)

    def correct(self, prediction: str, gold: str, *, timeout_s: float | None = None) -> bool:
        """math-verify's verdict on `prediction` against `gold`; False on timeout or parse failure."""
        if self._closed:
            raise RuntimeError("this MathVerifierPool is closed")
        if not prediction.strip() or not gold.strip():
            return False
        if prediction.strip() == gold.strip():
            return True
        worker = self._idle.get()
        try:
            return bool(worker.call(prediction, gold, timeout_s=self.timeout_s if timeout_s is None else timeout_s))
        except (WorkerTimeout, WorkerRaised):
            return False  # a hostile input (the worker hung and was replaced) or one math-verify cannot read
        except WorkerDied as error:
            raise RuntimeError(f"the math-verify worker did not start (see its stderr above): {error}") from None
        finally:
            if worker.process is None and not self._closed:
                worker.start()  # replaced now, so the fresh worker's imports overlap with other checks
            self._idle.put(worker)

    def correct_batch(
        self, predictions: Sequence[str], golds: Sequence[str], *, timeout_s: float | None = None
    ) -> list[bool]:
        """`correct` for each (prediction, gold) pair, spread over all workers; results in input order."""
        if len(predictions) != len(golds):
            raise ValueError(f"predictions and golds differ in length: {len(predictions)} != {len(golds)}")
        with ThreadPoolExecutor(max_workers=self.num_workers) as executor:
            return list(executor.map(lambda pair: self.correct(*pair, timeout_s=timeout_s), zip(predictions, golds)))

    def close(self) -> None:
        self._closed = True
        with self._lock:
            workers, self._all = list(self._all), set()
        for worker in workers:
            worker.close()


_default_pool: MathVerifierPool | None = None
_default_pool_lock = threading.Lock()


def default_pool() -> MathVerifierPool:
    """The process-wide pool behind `math_correct`, started on first use (COPES_MATH_WORKERS sets its size)."""
    global _default_pool
    with _default_pool_lock:
        if _default_pool is None:
            num_workers = int(os.environ.get("COPES_MATH_WORKERS", min(4, os.cpu_count() or 1)))
            _default_pool = MathVerifierPool(num_workers=num_workers)
            atexit.register(_default_pool.close)
        return _default_pool


def math_correct(prediction: str, gold: str, *, timeout_s: float | None = None) -> bool:
    """Whether the final answer `prediction` equals `gold` mathematically (math-verify, gold parsed first)."""
    return default_pool().correct(prediction, gold, timeout_s=timeout_s)


def math_correct_batch(
    predictions: Sequence[str], golds: Sequence[str], *, timeout_s: float | None = None
) -> list[bool]:
    """`math_correct` over pairs, checked in parallel on the pool's workers."""
    return default_pool().correct_batch(predictions, golds, timeout_s=timeout_s)

"""The tools as the agent loop sees them: a name, a JSON schema, and `call(arguments) -> observation`.

`call` never raises: a bad argument, a failed search or a crashed program becomes observation text, because the
model is the one that has to react to it (and one bad rollout must not stop a training step). String arguments
are made valid Unicode before a tool uses them, and an observation does not repeat the model's input back to it.
"""

from __future__ import annotations

import signal
from typing import Any, Protocol

from copes.text import valid_unicode
from copes.tools.sandbox import PythonSandbox, SandboxResult, SandboxUnavailable
from copes.tools.search import BM25Search, HttpRetriever, SearchError


class Tool(Protocol):
    name: str  # "python" | "search"
    description: str
    parameters: dict  # JSON schema of the arguments object, for chat templates with tools

    def call(self, arguments: dict) -> str:
        """The observation text shown to the model; never raises."""
        ...


def tool_schema(tool: Tool) -> dict:
    """The OpenAI-style function entry that `tokenizer.apply_chat_template(..., tools=[...])` accepts."""
    return {
        "type": "function",
        "function": {"name": tool.name, "description": tool.description, "parameters": tool.parameters},
    }


def _string_argument(arguments: Any, key: str) -> str:
    if not isinstance(arguments, dict):
        raise ValueError(f"arguments must be a JSON object like {{{key!r}: ...}}, got {type(arguments).__name__}")
    if key not in arguments:
        raise ValueError(f"missing argument {key!r}")
    value = arguments[key]
    if not isinstance(value, str):
        raise ValueError(f"argument {key!r} must be a string, got {type(value).__name__}")
    if not value.strip():
        raise ValueError(f"argument {key!r} is empty")
    return valid_unicode(value)


def _clip_middle(text: str, max_chars: int) -> str:
    """Keep both ends: a program's first lines say what it did, its last lines usually hold the answer."""
    if len(text) <= max_chars:
        return text
    half = max_chars // 2
    return f"{text[:half]}\n... [{len(text) - 2 * half} characters omitted] ...\n{text[-half:]}"


def _clip_to_tail(text: str, max_chars: int) -> str:
    """Keep the end: the last lines of a traceback name the error."""
    if len(text) <= max_chars:
        return text
    return f"... [{len(text) - max_chars} characters omitted]\n{text[-max_chars:]}"


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:  # real-time signals have no names
        return f"signal {number}"


class PythonTool:
    name = "python"
    description = (
        "Run a Python 3 program in a fresh sandbox (no network, no state kept between calls) and return what it "
        "printed. Use print() to show results."
    )
    parameters = {
        "type": "object",
        "properties": {"code": {"type": "string", "description": "The complete Python program to run."}},
        "required": ["code"],
    }

    def __init__(self, sandbox: PythonSandbox | None = None, max_observation_chars: int = 2000) -> None:
        if max_observation_chars < 100:
            raise ValueError(f"max_observation_chars must be >= 100, got {max_observation_chars!r}")
        self.sandbox = sandbox if sandbox is not None else PythonSandbox()
        self.max_observation_chars = max_observation_chars

    def call(self, arguments: dict) -> str:
        try:
            result = self.sandbox.run(_string_argument(arguments, "code"))
        except SandboxUnavailable as error:  # checked at start-up; this is the machine changing under a run
            return f"Error: the sandbox refused to run the code: {error}"
        except ValueError as error:
            return f"Error: {error}"
        except OSError as error:  # the host could not start a process (out of pids, disk full...)
            return f"Error: the sandbox could not run the code: {error}"
        return self._observation(result)

    def _observation(self, result: SandboxResult) -> str:
        parts = []
        if result.stdout:
            parts.append(_clip_middle(result.stdout.rstrip("\n"), self.max_observation_chars))
        if result.stderr.strip():
            parts.append("stderr:\n" + _clip_to_tail(result.stderr.rstrip("\n"), self.max_observation_chars // 2))
        if result.timed_out:
            parts.append(f"Error: timed out after {self.sandbox.timeout_s:g}s; the program was killed.")
        elif result.output_truncated:
            parts.append(f"Error: output exceeded {self.sandbox.max_output_bytes} bytes; the program was killed.")
        elif result.cpu_budget_exceeded:
            parts.append(f"Error: the program's processes used up the run's CPU budget of "
                         f"{self.sandbox.run_cpu_seconds}s together; the program was killed.")
        elif result.disk_quota_exceeded:
            parts.append(f"Error: the program's files and shared memory outgrew the work dir's "
                         f"{self.sandbox.max_disk_bytes} bytes; the program was killed.")
        elif result.exit_status < 0:
            killed_by = _signal_name(-result.exit_status)
            why = {"SIGXCPU": f" (CPU limit of {self.sandbox.cpu_seconds}s)", "SIGKILL": ""}.get(killed_by, "")
            parts.append(f"Error: the program was killed by {killed_by}{why}.")
        elif result.exit_status > 0 and not result.stderr.strip():
            parts.append(f"Error: exit status {result.exit_status}.")
        if not parts:
            return "(no output; use print() to show values)"
        return "\n".join(parts)


NO_RESULTS = "No results; try other keywords."  # what a search that matched nothing shows the model


class SearchTool:
    name = "search"
    description = "Search a Wikipedia-style corpus and return the most relevant passages with their titles."
    parameters = {
        "type": "object",
        "properties": {"query": {"type": "string", "description": "What to look for, in a few keywords."}},
        "required": ["query"],
    }

    def __init__(
        self, retriever: BM25Search | HttpRetriever, top_k: int = 3, max_observation_chars: int = 6000
    ) -> None:
        if isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 1:
            raise ValueError(f"top_k must be a positive int, got {top_k!r}")
        if max_observation_chars < 100:
            raise ValueError(f"max_observation_chars must be >= 100, got {max_observation_chars!r}")
        self.retriever = retriever
        self.top_k = top_k
        self.max_observation_chars = max_observation_chars

    def call(self, arguments: dict) -> str:
        try:
            query = _string_argument(arguments, "query")
            passages = self.retriever.search(query, self.top_k)
        except ValueError as error:
            return f"Error: {error}"
        except SearchError as error:
            return f"Search error: {error}"
        if not passages:
            return NO_RESULTS
        # Search-R1's observation format, which the reference prompts and papers use; each passage gets an equal
        # share of the budget, so one huge passage cannot push the others out.
        share = self.max_observation_chars // len(passages)
        return "\n".join(
            _clip_middle(f"Doc {i} (Title: {p.title}) {p.text}", share) for i, p in enumerate(passages, 1)
        )

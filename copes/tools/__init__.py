"""The agent's tools: a Python sandbox and passage search (local BM25 or a Search-R1 retrieval server), and the
`Tool` wrappers the multi-turn rollout loop calls."""

from copes.tools.agent_tools import PythonTool, SearchTool, Tool, tool_schema
from copes.tools.sandbox import PythonSandbox, SandboxResult, SandboxUnavailable
from copes.tools.search import (
    BM25Search,
    HttpRetriever,
    Passage,
    Retriever,
    SearchError,
    load_corpus,
    write_corpus,
)

__all__ = [
    "BM25Search",
    "HttpRetriever",
    "Passage",
    "PythonSandbox",
    "PythonTool",
    "Retriever",
    "SandboxResult",
    "SandboxUnavailable",
    "SearchError",
    "SearchTool",
    "Tool",
    "write_corpus",
    "load_corpus",
    "tool_schema",
]

"""The rooms of the tree and the one direction of its arrows, checked from the source (every import, including
the ones inside functions): `copes_kernels` imports nothing of `copes`; the shared foundation imports no room;
the ES core and the rollout side never import the durable run; nothing imports the command-line face; and no
module imports itself back through others."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from helpers.paths import REPO

# Lower layers first. A module may import its own layer and the layers before it, never one after it.
LAYERS = (
    ("kernels", ("copes_kernels",)),
    # `copes` itself is here: its public names load lazily (importlib in __getattr__), so importing it for
    # `copes.__version__` pulls in no room.
    ("foundation", ("copes", "copes.errors", "copes.choices", "copes.failpoints", "copes.extras", "copes.modeling")),
    ("es core", ("copes.es",)),
    ("rollout side", ("copes.rewards", "copes.tools", "copes.tasks", "copes.rollout")),
    ("durable run", ("copes.run",)),
    ("command line", ("copes.cli",)),
)


def layer_of(module: str) -> int:
    best, best_len = None, -1
    for index, (_, prefixes) in enumerate(LAYERS):
        for prefix in prefixes:
            if (module == prefix or module.startswith(prefix + ".")) and len(prefix) > best_len:
                best, best_len = index, len(prefix)
    assert best is not None, f"{module} is in no layer: add it to LAYERS"
    return best


def module_name(path: Path) -> str:
    parts = path.relative_to(REPO).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports_of(path: Path) -> set[str]:
    """Every project module `path` imports, anywhere in the file (TYPE_CHECKING blocks aside: they never run)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    package = module_name(path) if path.name == "__init__.py" else module_name(path).rpartition(".")[0]
    skipped = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            skipped.update(id(child) for child in ast.walk(node))
    found = set()
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            found.add(base)
            found.update(f"{base}.{alias.name}" for alias in node.names)  # `from pkg import module`
    return {name for name in found if name.split(".")[0] in ("copes", "copes_kernels")}


def project_modules() -> dict[str, Path]:
    paths = [*sorted((REPO / "copes").rglob("*.py")), *sorted((REPO / "copes_kernels").rglob("*.py"))]
    return {module_name(path): path for path in paths}


MODULES = project_modules()


def resolved(name: str) -> str | None:
    """The project module an imported name refers to (`from copes.run import checkpoint` -> copes.run.checkpoint)."""
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name or None


def test_every_module_sits_in_a_layer() -> None:
    for module in MODULES:
        layer_of(module)


@pytest.mark.parametrize("module", sorted(MODULES))
def test_no_arrow_runs_back_up(module: str) -> None:
    own = layer_of(module)
    upward = sorted({target for name in imports_of(MODULES[module]) if (target := resolved(name))
                     and layer_of(target) > own})
    assert not upward, f"{module} ({LAYERS[own][0]}) imports a higher layer: {upward}"


def test_no_import_circle() -> None:
    """Package __init__ files that re-export their own modules are edges down into the package, not circles."""
    graph = {module: {t for name in imports_of(path) if (t := resolved(name)) and t != module}
             for module, path in MODULES.items()}
    for module, path in MODULES.items():
        if path.name == "__init__.py":  # a module importing its parent package only runs the __init__: no edge
            for other in graph:
                if other.startswith(module + "."):
                    graph[other].discard(module)
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                cycle = stack[stack.index(nxt):] + [nxt]
                pytest.fail("import circle: " + " -> ".join(cycle))
            if nxt not in state:
                visit(nxt)
        stack.pop()
        state[node] = 2

    for module in sorted(graph):
        if module not in state:
            visit(module)

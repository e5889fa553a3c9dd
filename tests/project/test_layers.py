"""The rooms of the tree and the one direction of its arrows, checked from the source (every import, including
the ones inside functions): `copes_kernels` imports nothing of `copes`; the shared foundation imports no room;
the ES core and the rollout side never import the durable run; nothing imports the command line or the package
face; inside the rollout side the rooms import each other only one way; no module imports itself back through
others; and every module has its place in docs/architecture.md's room table."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from helpers.paths import REPO

# Lower layers first. A module may import its own layer and the layers before it, never one after it.
LAYERS = (
    ("kernels", ("copes_kernels",)),
    ("foundation", ("copes.errors", "copes.choices", "copes.failpoints", "copes.extras", "copes.modeling",
                    "copes.gguf_io", "copes.downloads", "copes.text", "copes.timing", "copes.user_code")),
    ("es core", ("copes.es",)),
    ("rollout side", ("copes.rewards", "copes.tools", "copes.tasks", "copes.rollout")),
    ("config", ("copes.config",)),
    ("memory plan", ("copes.plan",)),
    ("durable run", ("copes.run",)),
    ("TRL face", ("copes.trl",)),
    ("command line", ("copes.cli",)),
    # `copes` itself, the package face: its public names (Trainer, train, CoPES...) load lazily from the rooms
    # below, so a module that imports it reaches up to the durable run. It is matched by its exact name only.
    ("package face", ()),
)
FACE = "copes"

# Inside the rollout side, the rooms a room may import (today's directions): rewards and tools are leaves, tasks
# score with rewards, the rollout calls tools.
SAME_LAYER_IMPORTS = {
    "copes.rewards": set(),
    "copes.tools": set(),
    "copes.tasks": {"copes.rewards"},
    "copes.rollout": {"copes.tools"},
}


def layer_of(module: str) -> int:
    if module == FACE:
        return len(LAYERS) - 1
    best, best_len = None, -1
    for index, (_, prefixes) in enumerate(LAYERS):
        for prefix in prefixes:
            if (module == prefix or module.startswith(prefix + ".")) and len(prefix) > best_len:
                best, best_len = index, len(prefix)
    assert best is not None, f"{module} is in no layer: add it to LAYERS"
    return best


def room_of(module: str, rooms: set[str] | dict[str, set[str]]) -> str | None:
    return next((room for room in rooms if module == room or module.startswith(room + ".")), None)


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


def test_the_package_face_is_the_top_and_nothing_imports_it() -> None:
    """`import copes` runs no room, but its names are the trainer's: an import of it from inside the package is
    an arrow to the top (journal.py read copes.__version__ this way; it now reads the package metadata)."""
    assert layer_of(FACE) > layer_of("copes.cli") > layer_of("copes.run.journal")
    importers = sorted(module for module, path in MODULES.items()
                       if module != FACE and any(resolved(name) == FACE for name in imports_of(path)))
    assert not importers, f"these import the package face: {importers}"


@pytest.mark.parametrize("room", sorted(SAME_LAYER_IMPORTS))
def test_rollout_side_rooms_import_each_other_one_way(room: str) -> None:
    allowed = SAME_LAYER_IMPORTS[room]
    crossing = sorted({f"{module} -> {target}" for module, path in MODULES.items() if room_of(module, {room})
                       for name in imports_of(path) if (target := resolved(name))
                       and room_of(target, SAME_LAYER_IMPORTS) not in (None, room, *allowed)})
    assert not crossing, f"{room} may import only {sorted(allowed) or 'none'} of the rollout side: {crossing}"


def room_table() -> dict[str, str]:
    """docs/architecture.md's room table: {room folder (`copes/es/`): its modules cell}."""
    text = (REPO / "docs" / "architecture.md").read_text()
    section = text.split("## Where each thing lives", 1)[1].split("\n## ", 1)[0]
    rows = {}
    for line in section.splitlines():
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        if len(cells) >= 2 and (room := re.match(r"`([\w/]+/)`", cells[0])):
            rows[room.group(1)] = cells[1]
    return rows


def test_every_module_is_in_the_room_table() -> None:
    """Each module's name (a package's as `name/`) is listed, in backticks, in the row of the deepest room folder
    that holds it (a package with a row of its own is listed by that row): a new module without a place on the
    map fails here."""
    rows = room_table()
    missing = []
    for path in MODULES.values():
        item = path.relative_to(REPO).as_posix()
        if path.name == "__init__.py":
            item = item.removesuffix("__init__.py")
            if item in rows:
                continue
        room = max((row for row in rows if item.startswith(row) and item != row), key=len, default=None)
        leaf = item.rstrip("/").rpartition("/")[2].removesuffix(".py") + ("/" if item.endswith("/") else "")
        if room is None or f"`{leaf}`" not in rows[room]:
            missing.append(f"{item} (as `{leaf}` in the row of {room})")
    assert not missing, f"docs/architecture.md's room table does not list: {missing}"


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


MAX_MODULES_PER_FOLDER = 12  # a room a reader takes in at a glance; past that it is a hall of several trades


def test_no_folder_holds_more_modules_than_a_reader_takes_in() -> None:
    """Each package folder holds at most MAX_MODULES_PER_FOLDER modules besides its `__init__` (copes/run/ held
    18 of four trades before the rooms were split by trade)."""
    counts: dict[str, int] = {}
    for path in MODULES.values():
        if path.name != "__init__.py":
            folder = str(path.parent.relative_to(REPO))
            counts[folder] = counts.get(folder, 0) + 1
    crowded = {folder: count for folder, count in counts.items() if count > MAX_MODULES_PER_FOLDER}
    assert not crowded, f"folders holding more than {MAX_MODULES_PER_FOLDER} modules: {crowded}"

"""The package's import graph has no circle: every arrow between revtrain's files runs one way.

Imports inside functions count too (a lazy import is still an arrow); imports under
``if TYPE_CHECKING:`` do not (they never run).
"""

from __future__ import annotations

import ast
from pathlib import Path

import revtrain

ROOT = Path(revtrain.__file__).parent


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _imports(path: Path, modules: set[str]) -> set[str]:
    """The revtrain modules that ``path`` imports (submodules named in ``from X import y`` too)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    here = _module_name(path)
    package = here if path.name == "__init__.py" else here.rpartition(".")[0]
    found: set[str] = set()

    def visit(node: ast.AST) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and _is_type_checking(child):
                for other in child.orelse:
                    visit(other)
                continue
            if isinstance(child, ast.Import):
                found.update(a.name for a in child.names if a.name in modules)
            elif isinstance(child, ast.ImportFrom):
                base = child.module or ""
                if child.level:
                    anchor = package.split(".")[: len(package.split(".")) - child.level + 1]
                    base = ".".join([*anchor, base] if base else anchor)
                if base in modules:
                    found.add(base)
                for alias in child.names:
                    if f"{base}.{alias.name}" in modules:
                        found.add(f"{base}.{alias.name}")
            visit(child)

    visit(tree)
    found.discard(here)
    return found


def _graph() -> dict[str, set[str]]:
    files = {_module_name(p): p for p in ROOT.rglob("*.py")}
    modules = set(files)
    return {name: _imports(path, modules) for name, path in files.items()}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []

    def strongconnect(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                strongconnect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            strongconnect(v)
    return out


def test_the_import_graph_has_no_circle():
    graph = _graph()
    assert len(graph) > 30 and graph["revtrain.core.block"]  # the parse found the package
    assert _cycles(graph) == []


def test_the_checker_finds_a_circle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


# The floors of docs/architecture.md: a room may import from its own room and from lower floors.
FLOORS = {
    "errors": 1, "device": 1, "timing": 1, "memory": 1, "_version": 1,
    "core": 2, "data": 2,
    "layers": 3, "compilation": 3,
    "models": 4,
    "tasks": 5,
    "planner": 6,
    "train": 7,
    "options": 8, "revtrain": 8,
    "parallel": 9,
    "bench": 10,
    "cli": 11,
}


def _room(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


def test_every_import_runs_down_the_floors_of_the_architecture_page():
    graph = _graph()
    rooms = {_room(m) for m in graph}
    assert rooms <= set(FLOORS), f"rooms without a floor in docs/architecture.md: {sorted(rooms - set(FLOORS))}"
    upward = sorted(
        (a, b)
        for a, targets in graph.items()
        for b in targets
        if _room(a) != _room(b) and FLOORS[_room(b)] >= FLOORS[_room(a)]
    )
    assert upward == [], f"imports that run sideways or up a floor: {upward}"


def _takes_trainer(node: ast.AST) -> bool:
    """``from revtrain.train.trainer import ...``, ``from revtrain(.train) import Trainer``,
    ``import revtrain.train.trainer`` (any alias)."""
    if isinstance(node, ast.ImportFrom):
        return node.module == "revtrain.train.trainer" or (
            node.module in ("revtrain.train", "revtrain") and any(a.name == "Trainer" for a in node.names))
    if isinstance(node, ast.Import):
        return any(a.name == "revtrain.train.trainer" or a.name.startswith("revtrain.train.trainer.")
                   for a in node.names)
    return False


def test_the_trainer_import_check_sees_every_form_of_import():
    taken = ["from revtrain.train.trainer import Trainer", "from revtrain.train import Trainer",
             "from revtrain import Trainer as T", "import revtrain.train.trainer",
             "import revtrain.train.trainer as trainer_module"]
    free = ["from revtrain.train.trainer_view import TrainerView", "import revtrain.train.trainer_view",
            "import revtrain.train", "from revtrain.train import TrainConfig"]
    assert all(_takes_trainer(ast.parse(line).body[0]) for line in taken)
    assert not any(_takes_trainer(ast.parse(line).body[0]) for line in free)


def test_engines_and_checkpoint_stores_do_not_import_the_trainer():
    """Not even for annotations (``TYPE_CHECKING``): they are handed the Trainer and type it as
    ``train/trainer_view.py``'s ``TrainerView``, so the trainer -> engine -> store arrows run one way."""
    for name in ("train/engine.py", "train/checkpoint_store.py", "train/trainer_view.py", "parallel/replicas.py",
                 "parallel/petra_engine.py"):
        tree = ast.parse((ROOT / name).read_text())
        imports = [node for node in ast.walk(tree) if isinstance(node, (ast.Import, ast.ImportFrom))]
        assert imports, name
        for node in imports:
            assert not _takes_trainer(node), f"{name} imports the Trainer (line {node.lineno})"

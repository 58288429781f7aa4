"""Import hygiene: the processes that never train (the API, the dashboards, `crucible api`,
`crucible presets --json`) never import torch, nor do the library's torch-free rooms (grid,
pricing, runfiles, registry); crucible's modules import each other without a cycle at module
top level; and the packages around the library keep their rooms: the flows import neither the
registry service nor the dashboards nor the command line, the API never the flows, the
dashboards neither the API nor the database.

The torch checks run each entry point in a fresh interpreter: this test process (conftest) has
torch loaded already.
"""
from __future__ import annotations

import ast
import json
import subprocess
import sys
import textwrap
from collections.abc import Collection
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "crucible"

# printed last by every probe: which of the heavy modules the entry point loaded
_REPORT = textwrap.dedent("""
    import json as _json, sys as _sys
    print("LOADED=" + _json.dumps(sorted(m for m in ("torch",) if m in _sys.modules)))
""")


def _probe(code: str) -> tuple[list[str], str]:
    """Run `code` in a fresh interpreter; (heavy modules it loaded, what it printed before)."""
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(code) + _REPORT], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    head, _, tail = done.stdout.rpartition("LOADED=")
    return json.loads(tail), head


def _cli(*args: str) -> str:
    """The `crucible` console entry point (cli.main:main) with `args`, stdout captured."""
    return f"""
        import contextlib, io, sys
        sys.argv = ["crucible", *{list(args)!r}]
        from cli.main import main
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            try:
                main()
            except SystemExit as exc:
                assert exc.code in (0, None), exc.code
        print(out.getvalue())
    """


def test_the_api_app_builds_without_torch():
    loaded, _ = _probe("""
        import api.app
        import db.migrate
        from api.app import create_app
        from api.settings import Settings

        app = create_app(Settings(database_url="sqlite://"))
        assert any(path.startswith("/api/v1/") for path in app.openapi()["paths"])
    """)
    assert loaded == [], "the API process imports torch (python -X importtime shows the chain)"


@pytest.mark.parametrize("module", ["api.dashboards.routes", "api.dashboards.routes_compare",
                                    "api.dashboards.export", "dashboards.pages", "cli.report",
                                    "api.cli", "cli.flows"])
def test_the_dashboards_and_cli_modules_import_without_torch(module):
    loaded, _ = _probe(f"import {module}")
    assert loaded == [], f"`import {module}` imports torch"


def test_crucible_cli_imports_without_torch():
    loaded, _ = _probe("""
        import cli.main
        cli.main._register_packages()   # what main() does before parsing: every subcommand
    """)
    assert loaded == [], "cli.main (with every package's commands registered) imports torch"


def test_crucible_presets_json_runs_without_torch():
    loaded, out = _probe(_cli("presets", "--json"))
    rows = json.loads(out)
    assert rows and {"name", "parameters", "expected_cpu"} <= set(rows[0])
    assert loaded == [], "`crucible presets --json` imports torch"


@pytest.mark.parametrize("args", [("api", "--help"), ("--help",)], ids=" ".join)
def test_crucible_help_runs_without_torch(args):
    loaded, out = _probe(_cli(*args))
    assert "Usage" in out
    assert loaded == [], f"`crucible {' '.join(args)}` imports torch"


# --- no import cycles among crucible's modules at module top level --------------------------

def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or \
        (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _imports(tree: ast.Module, *, lazy: bool = False):
    """Import statements that run when the module is imported: not inside a function (with
    `lazy`, those too), not under `if TYPE_CHECKING:` (its `else:` does run)."""
    todo = list(tree.body)
    while todo:
        node = todo.pop()
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and not lazy:
            continue
        elif isinstance(node, ast.If) and _is_type_checking(node.test):
            todo.extend(node.orelse)
        else:
            todo.extend(child for child in ast.iter_child_nodes(node) if isinstance(child, ast.stmt))
            if isinstance(node, ast.Try):
                todo.extend(s for handler in node.handlers for s in handler.body)


def _modules() -> dict[str, Path]:
    """crucible's modules by dotted name."""
    return {_module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def _import_graph(*, lazy: bool = False, eager: Collection[str] = ()) -> dict[str, set[str]]:
    """crucible's modules and the crucible modules each imports (with `lazy`, function-level
    imports too, but for the modules in `eager`)."""
    files = _modules()
    graph: dict[str, set[str]] = {name: set() for name in files}
    for name, path in files.items():
        is_package = path.name == "__init__.py"
        for node in _imports(ast.parse(path.read_text(), filename=str(path)),
                             lazy=lazy and name not in eager):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            else:
                base = node.module or ""
                if node.level:   # relative: from the module's own package up
                    package = name.split(".") if is_package else name.split(".")[:-1]
                    package = package[:len(package) - (node.level - 1)]
                    base = ".".join(package + ([base] if base else []))
                # `from pkg import sub` imports the submodule when there is one
                targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in files else base
                           for alias in node.names]
            graph[name] |= {t for t in targets if t in files and t != name}
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle per strongly connected component with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = set()
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.add(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(_a_cycle(graph, component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def _a_cycle(graph: dict[str, set[str]], component: set[str]) -> list[str]:
    """A shortest path start -> ... -> start inside `component` (breadth first)."""
    start = min(component)
    paths = {start: [start]}
    frontier = [start]
    while frontier:
        nxt = []
        for v in frontier:
            for w in sorted(graph[v] & component):
                if w == start:
                    return paths[v] + [start]
                if w not in paths:
                    paths[w] = paths[v] + [w]
                    nxt.append(w)
        frontier = nxt
    raise AssertionError(f"no cycle through {start}")   # pragma: no cover


def test_the_cycle_finder_finds_a_cycle():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert _cycles(graph) == [["a", "b", "c", "a"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


def test_the_graph_sees_top_level_imports_only():
    graph = _import_graph()
    assert "crucible.model_file" in graph["crucible.train"]      # a top-level import
    # bypass-damage scores a model file through an Evaluator, without a trainer
    assert "crucible.evaluation" in graph["crucible.bypass"]
    assert "crucible.train" not in graph["crucible.bypass"]
    assert "crucible.train" not in graph["crucible.evaluation"]
    assert "crucible.boundary" in graph["crucible.sync"]          # `from crucible import boundary`
    assert "crucible.faults" not in graph["crucible.summary"]     # under `if TYPE_CHECKING:`


def test_crucible_modules_import_each_other_without_a_cycle():
    cycles = _cycles(_import_graph())
    assert not cycles, "import cycles at module top level:\n" + "\n".join(
        " -> ".join(cycle) for cycle in cycles)


def test_crucible_modules_import_each_other_without_a_cycle_even_lazily():
    """A function-level import hides a cycle from the interpreter, not from a reader: the
    library's modules form layers, each importing only the layers below it."""
    graph = _import_graph(lazy=True)
    assert "crucible.alignment" in graph["crucible.train"]        # a lazy import is seen
    cycles = _cycles(graph)
    assert not cycles, "import cycles (lazy imports included):\n" + "\n".join(
        " -> ".join(cycle) for cycle in cycles)


def _imports_of(package: str, forbidden: Collection[str]) -> list[str]:
    """Every import in `package`'s files (function-level ones too) of a top-level package in
    `forbidden`, as "path: module"."""
    found = []
    for path in sorted((ROOT / package).rglob("*.py")):
        for node in _imports(ast.parse(path.read_text(), filename=str(path)), lazy=True):
            names = [alias.name for alias in node.names] if isinstance(node, ast.Import) \
                else [node.module or ""] if not node.level else []
            found += [f"{path.relative_to(ROOT)}: {n}" for n in names
                      if n.split(".")[0] in forbidden]
    return found


def test_the_library_never_imports_the_services_or_the_command_line():
    """crucible/ is the library: the command line (cli/), the flows, the registry server and
    the dashboards import it, never the other way round, not even lazily."""
    found = _imports_of("crucible", {"cli", "flows", "api", "dashboards", "db"})
    assert not found, "the library imports outside itself:\n" + "\n".join(found)


def test_the_flows_import_only_the_library():
    """flows/ are recipes over the library (the registry client `crucible.registry` included):
    never the registry service (`api`, `db`), the dashboards or the command line, not even
    lazily. The embedded stack that serves the API beside the flows, and the flows' commands,
    live in cli/, which composes them."""
    found = _imports_of("flows", {"api", "db", "dashboards", "cli"})
    assert not found, "the flows import outside the library:\n" + "\n".join(found)


def test_the_api_never_imports_the_flows():
    """The registry service and its client commands reach the registry client through
    `crucible.registry`, never through the flows (nor the command line that composes them), not
    even lazily."""
    found = _imports_of("api", {"flows", "cli"})
    assert not found, "the API imports the flows or the command line:\n" + "\n".join(found)


def test_the_dashboards_import_neither_the_api_nor_the_database():
    """dashboards/ is figures and pages from plain dicts: the API (`api.dashboards`) reads the
    rows, serves and exports the pages; the dashboards never import `api` or `db`, nor the
    flows or the command line, not even lazily."""
    found = _imports_of("dashboards", {"api", "db", "flows", "cli"})
    assert not found, "the dashboards import the services:\n" + "\n".join(found)


def test_train_does_not_import_bypass_even_lazily():
    """bypass re-scores a trained model with the Trainer; the trainer only writes model.pt
    (crucible.model_file): the dependency runs one way."""
    tree = ast.parse((PACKAGE / "train.py").read_text())
    imported = {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)} | \
        {alias.name for node in ast.walk(tree) if isinstance(node, ast.Import)
         for alias in node.names}
    assert "crucible.bypass" not in imported
    assert not any(isinstance(node, ast.ImportFrom) and node.module == "crucible"
                   and any(alias.name == "bypass" for alias in node.names)
                   for node in ast.walk(tree))


def test_runfiles_imports_only_the_standard_library():
    """crucible.runfiles writes every durable run file, for the API, the flows and the command
    line as much as for the trainer: nothing but the standard library, not even lazily (and so
    never torch)."""
    path = PACKAGE / "runfiles.py"
    found = []
    for node in _imports(ast.parse(path.read_text(), filename=str(path)), lazy=True):
        names = [alias.name for alias in node.names] if isinstance(node, ast.Import) \
            else ["." * node.level + (node.module or "")]
        found += [n for n in names
                  if n != "__future__" and n.split(".")[0] not in sys.stdlib_module_names]
    assert not found, f"crucible/runfiles.py imports outside the standard library: {found}"
    loaded, _ = _probe("import crucible.runfiles")
    assert loaded == [], "`import crucible.runfiles` imports torch"


@pytest.mark.parametrize("module", ["grid/names.py", "grid/key.py"])
def test_the_grids_names_and_cell_key_import_only_the_standard_library(module):
    """The names (arms, strategies, palette) and the one cell key (crucible.grid.key.CellKey)
    sit below every layer that uses them, `crucible.stats` included: the standard library and
    each other only, not even lazily."""
    path = PACKAGE / module
    found = []
    for node in _imports(ast.parse(path.read_text(), filename=str(path)), lazy=True):
        names = [alias.name for alias in node.names] if isinstance(node, ast.Import) \
            else ["." * node.level + (node.module or "")]
        found += [n for n in names if n not in ("__future__", "crucible.grid.names")
                  and n.split(".")[0] not in sys.stdlib_module_names]
    assert not found, f"crucible/{module} imports outside the standard library: {found}"


# --- the torch-free rooms of the library ----------------------------------------------------

# what the API, the dashboards, the flows and the command line import: never torch
TORCH_FREE_ROOMS = ("crucible.grid", "crucible.pricing", "crucible.runfiles", "crucible.registry")
# modules of a room that load torch when asked, in a function-level import the check does not
# follow (the room still imports without torch):
_TORCH_WHEN_ASKED = {
    # run_cost replays a run's fault plan through its strategy
    "crucible.pricing.cost",
    # a trace run's fingerprint hashes its trace file (crucible.faults.trace_digest)
    "crucible.registry.identity",
}


def _room(room: str) -> list[str]:
    return sorted(m for m in _modules() if m == room or m.startswith(room + "."))


def _reached(graph: dict[str, set[str]], start: list[str]) -> set[str]:
    """`start` and every crucible module it imports, directly or through others."""
    seen, todo = set(start), list(start)
    while todo:
        for target in graph[todo.pop()] - seen:
            seen.add(target)
            todo.append(target)
    return seen


@pytest.mark.parametrize("room", TORCH_FREE_ROOMS)
def test_the_torch_free_rooms_never_import_torch(room):
    """Read from the code (each room's modules and every crucible module they reach, lazy
    imports included but for those of _TORCH_WHEN_ASKED), then run: importing the room loads no
    torch."""
    files = _modules()
    found = []
    for name in sorted(_reached(_import_graph(lazy=True, eager=_TORCH_WHEN_ASKED), _room(room))):
        for node in _imports(ast.parse(files[name].read_text(), filename=str(files[name])),
                             lazy=name not in _TORCH_WHEN_ASKED):
            names = [alias.name for alias in node.names] if isinstance(node, ast.Import) \
                else [node.module or ""] if not node.level else []
            found += [f"{name}: {n}" for n in names if n.split(".")[0] == "torch"]
    assert not found, f"{room} reaches torch:\n" + "\n".join(found)
    loaded, _ = _probe("\n".join(f"import {m}" for m in _room(room)))
    assert loaded == [], f"importing {room}'s modules imports torch"

"""The shape of the package (docs/architecture.md): no import circle among its modules, lazy imports where a command needs no torch, no function or class past its size."""

from __future__ import annotations

import ast
from pathlib import Path

from support.paths import SRC

PACKAGE = SRC / "gptspeed"


def module_name(path: Path) -> str:
    parts = list(path.relative_to(SRC).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph() -> dict[str, set[str]]:
    """Module -> the gptspeed modules it imports anywhere (at the top or inside a function). A
    ``from P import name`` counts as importing ``P.name`` when that is a module, else ``P``."""
    modules = {module_name(p): p for p in PACKAGE.rglob("*.py")}
    graph: dict[str, set[str]] = {m: set() for m in modules}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join(up + ([base] if base else []))
                targets = [f"{base}.{a.name}" for a in node.names]
            else:
                continue
            for target in targets:
                while target and target not in modules:
                    target = target.rsplit(".", 1)[0] if "." in target else ""
                if target and target != name:
                    graph[name].add(target)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def reader_lines(node: ast.AST) -> int:
    """The lines of a function or class as formatted, as a reader counts them: from its first line to its
    last, blank lines and comments included, its docstring excluded (from the line after it; the
    ``def`` / ``class`` line and the signature count where there is none)."""
    body = node.body
    first = body[0] if body else None
    if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) and isinstance(first.value.value, str):
        start = body[1].lineno if len(body) > 1 else node.end_lineno
    else:
        start = node.lineno
    return node.end_lineno - start + 1


FUNCTION_LINES, CLASS_LINES, MODULE_LINES, CHECKPOINT_MODULE_LINES = 60, 300, 800, 400


def too_long() -> list[str]:
    """Every function over 60 lines and class over 300 (:func:`reader_lines`) in the package."""
    long = []
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and reader_lines(node) > FUNCTION_LINES:
                long.append(f"{path.relative_to(SRC)}:{node.lineno} {node.name} ({reader_lines(node)} lines)")
            if isinstance(node, ast.ClassDef) and reader_lines(node) > CLASS_LINES:
                long.append(f"{path.relative_to(SRC)}:{node.lineno} class {node.name} ({reader_lines(node)} lines)")
    return long


def module_lines(path: Path) -> int:
    return path.read_text().count("\n")


def test_the_cycle_finder_finds_a_circle_through_a_lazy_import():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert cycles(graph) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_circle_in_gptspeed():
    graph = import_graph()
    assert "gptspeed.checkpoint" in graph["gptspeed.configure"]  # lazy and top-level imports are both seen
    assert "gptspeed.hf.load" in graph["gptspeed.configure"]
    assert cycles(graph) == []


def test_config_imports_nothing_of_gptspeed_but_its_errors_and_its_files():
    """The modules of the config package import one another, gptspeed's errors and configio (which reads
    and writes the files), and --fp8's shape check when it is asked for: nothing else of gptspeed."""
    graph = import_graph()
    config = {m for m in graph if m == "gptspeed.config" or m.startswith("gptspeed.config.")}
    assert {"gptspeed.config", "gptspeed.config.declare", "gptspeed.config.run"} <= config
    allowed = config | {"gptspeed.errors", "gptspeed.fp8", "gptspeed.configio"}  # configio: errors and fileio only
    assert set().union(*(graph[m] for m in config)) <= allowed
    assert graph["gptspeed.configio"] <= {"gptspeed.errors", "gptspeed.fileio"}


def test_the_config_package_reads_and_writes_no_file():
    """The settings' declarations and checks read and write no file: a --config file is read, and --print-config's
    YAML written, by configio.py alone."""
    for path in sorted((PACKAGE / "config").glob("*.py")):
        tree = ast.parse(path.read_text())
        imported = {a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
        imported |= {(n.module or "").split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
        called = {n.func.id for n in ast.walk(tree) if isinstance(n, ast.Call) and isinstance(n.func, ast.Name)}
        assert not imported & {"yaml", "json", "io"}, path
        assert not called & {"open", "read_user_text", "read_user_json"}, path


def test_the_line_count_is_a_readers():
    """Blank lines and comments count, the docstring does not (counting starts at the statement after it);
    without one the signature counts."""
    tree = ast.parse(
        'def f(a,\n      b):\n    """Doc\n    string."""\n    x = 1\n\n    # a comment\n    return x\n\n\n'
        'def g():\n    return 1\n\n\nclass C:\n    """Doc."""\n\n    y = 2\n'
    )
    assert {n.name: reader_lines(n) for n in tree.body} == {"f": 4, "g": 2, "C": 1}


def test_no_function_over_60_lines_and_no_class_over_300():
    """A function that does not fit on a screen is a sign a part is missing: at most 60 lines for a
    function and 300 for a class as formatted, docstrings excluded (:func:`reader_lines`)."""
    assert too_long() == []


def test_no_module_over_800_lines():
    long = [
        f"{p.relative_to(SRC)} ({module_lines(p)} lines)"
        for p in sorted(PACKAGE.rglob("*.py"))
        if module_lines(p) > MODULE_LINES
    ]
    assert long == []


def test_no_checkpoint_module_over_400_lines():
    long = [
        f"{p.relative_to(SRC)} ({module_lines(p)} lines)"
        for p in sorted((PACKAGE / "checkpoint").glob("*.py"))
        if module_lines(p) > CHECKPOINT_MODULE_LINES
    ]
    assert long == []

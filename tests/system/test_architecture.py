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


def _body_lines(node: ast.AST) -> int:
    """Statements of a function (the lines on which one begins), its docstring excluded: a measure the
    formatter's layout does not move (a call split over eight lines by ``ruff format`` is one)."""
    starts = {s.lineno for s in ast.walk(node) if isinstance(s, ast.stmt)}
    first = node.body[0] if node.body else None
    if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) and isinstance(first.value.value, str):
        starts.discard(first.lineno)
    return len(starts)


def test_the_cycle_finder_finds_a_circle_through_a_lazy_import():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert cycles(graph) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_circle_in_gptspeed():
    graph = import_graph()
    assert "gptspeed.checkpoint" in graph["gptspeed.configure"]  # lazy and top-level imports are both seen
    assert "gptspeed.hf.load" in graph["gptspeed.configure"]
    assert cycles(graph) == []


def test_config_imports_nothing_of_gptspeed_but_its_errors():
    assert import_graph()["gptspeed.config"] <= {"gptspeed.errors", "gptspeed.fp8", "gptspeed.fileio"}  # fileio: row 0


def test_no_function_over_60_lines_no_class_over_300_no_checkpoint_module_over_400():
    """A function that does not fit on a screen is a sign a part is missing. Functions and
    classes are measured in statements (_body_lines), so that the formatter's layout does not move the
    limits: 60 for a function; 230 for a class (the 300 physical lines of the code before ``ruff
    format`` held about 0.64 statements a line, as Trainer did)."""
    long = []
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and _body_lines(node) > 60:
                long.append(f"{path.relative_to(SRC)}:{node.lineno} {node.name} ({_body_lines(node)} statements)")
            if isinstance(node, ast.ClassDef) and _body_lines(node) > 230:
                long.append(f"{path.relative_to(SRC)}:{node.lineno} class {node.name} ({_body_lines(node)} statements)")
    for path in (PACKAGE / "checkpoint").glob("*.py"):
        if len(path.read_text().splitlines()) > 400:
            long.append(f"{path.relative_to(SRC)} ({len(path.read_text().splitlines())} lines)")
    assert long == []

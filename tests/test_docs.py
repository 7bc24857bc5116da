"""Every test the documentation cites exists: the pages (README.md, docs/*.md, benchmarks/*.md) name test
files (``tests/test_step.py``, or relative to tests/ as ``data/test_folder.py``) and tests in them
(``FILE::name``, ``FILE::Class::name``, ``::name`` after a file on the same line, ``name*`` for every test
so named); a test moved to another file or renamed fails here, naming the page and the line."""

from __future__ import annotations

import ast
import functools
import re
from pathlib import Path

import pytest

from support.paths import ROOT

PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), *sorted((ROOT / "benchmarks").glob("*.md"))]

# a test file (``tests/...py``, or ``test_*.py`` under tests/) with its ``::name`` parts; or, alone in its
# backticks, ``::name``: a test of the last file named before it on the line; or a bare ``test_name``
CITATION = re.compile(
    r"(?<![\w/.-])(?P<path>tests/(?:[\w-]+/)*\w+\.py|(?:[\w-]+/)*test_\w+\.py)(?P<names>(?:::\w+\*?)*)"
    r"|`::(?P<more>\w+\*?)"
    r"|`(?P<bare>test_\w+)(?:\[[^\]`]*\])?`"
)


def cited_file(cited: str) -> Path:
    """The file a cited path names: from the checkout's root when it starts with ``tests/``, else from tests/."""
    return ROOT / cited if cited.startswith("tests/") else ROOT / "tests" / cited


@functools.cache
def names_in(path: Path) -> frozenset[str]:
    """The functions and classes ``path`` defines, as ``name`` and ``Class::name``."""
    names = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        if isinstance(node, ast.ClassDef):
            names |= {f"{node.name}::{n.name}" for n in node.body if isinstance(n, ast.FunctionDef)}
    return frozenset(names)


@functools.cache
def every_test_name() -> frozenset[str]:
    return frozenset(n.split("::")[-1] for p in (ROOT / "tests").rglob("test_*.py") for n in names_in(p))


def defined(name: str, names: frozenset[str]) -> bool:
    """Whether ``name`` (``prefix*``: any name that starts so) is among ``names``."""
    return any(n.startswith(name[:-1]) for n in names) if name.endswith("*") else name in names


def dangling(line: str) -> list[str]:
    """The citations on one line of a page that name no existing test file or test."""
    wrong, last = [], None
    for m in CITATION.finditer(line):
        if m["path"]:
            last = cited_file(m["path"])
            if not last.is_file():
                wrong.append(f"{m['path']} (no such file)")
            elif m["names"] and not defined(m["names"][2:], names_in(last)):
                wrong.append(f"{m['path']}{m['names']} (not in that file)")
        elif m["more"] and last is not None and last.is_file() and not defined(m["more"], names_in(last)):
            wrong.append(f"::{m['more']} (not in {last.relative_to(ROOT)})")
        elif m["bare"] and m["bare"] not in every_test_name():
            wrong.append(f"{m['bare']} (no test of that name)")
    return wrong


def test_the_citation_finder_reads_every_form_of_citation():
    line = (
        "`tests/test_docs.py::cited_file`, `::names_in`, `test_docs.py::dangl*`, `system/test_nothing.py`, "
        "`tests/test_docs.py::test_gone`, `::gone_too`, `test_not_a_test_anywhere[param]`, "
        "`test_the_citation_finder_reads_every_form_of_citation`"
    )
    assert dangling(line) == [
        "system/test_nothing.py (no such file)",
        "tests/test_docs.py::test_gone (not in that file)",
        "::gone_too (not in tests/test_docs.py)",
        "test_not_a_test_anywhere (no test of that name)",
    ]


@pytest.mark.parametrize("page", PAGES, ids=[str(p.relative_to(ROOT)) for p in PAGES])
def test_every_test_a_page_cites_exists(page):
    wrong = [
        f"{page.relative_to(ROOT)}:{number}: {what}"
        for number, line in enumerate(page.read_text().splitlines(), 1)
        for what in dangling(line)
    ]
    assert not wrong, "the docs cite tests that are not where they say:\n" + "\n".join(wrong)


def test_the_readme_test_command_is_the_one_ci_runs():
    """.ci/run says it runs "exactly the README's test command": the two stay the same line."""
    readme = (ROOT / "README.md").read_text()
    block = re.search(r"Run the tests[^\n]*\n+```bash\n(.*?)\n```", readme, re.S)
    ci = [
        line
        for line in (ROOT / ".ci" / "run").read_text().splitlines()
        if line and not line.startswith(("#", "set ", "cd "))
    ]
    assert block and ci == [block.group(1)], "README.md's test command and .ci/run's differ"


def test_the_readme_stays_a_front_page():
    """The README is the front page (issue 53: at most 160 lines); the reference goes to docs/."""
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= 160, f"README.md has {len(lines)} lines: move reference material to docs/"

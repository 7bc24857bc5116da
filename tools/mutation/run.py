#!/usr/bin/env python
"""The mutation check of the core modules (issue 33): mutmut over model, loss, step, optim, the
loader, checkpoint, sample and eval, each mutant run against the core tests that reach its function.

    pip install -e '.[test,mutation]'        # this script installs nothing
    python tools/mutation/run.py              # all core modules, from HEAD (1-2 h on 2 cores)
    python tools/mutation/run.py sample loss  # some of them
    python tools/mutation/run.py --worktree --resume --survivors   # retest last run's survivors
                                              # against the working tree's tests (minutes)

It works in a snapshot (``.mutation/``, git-ignored): HEAD's ``src tests docs README.md
pyproject.toml`` (``--worktree``: the working tree's, committed or not), in which the decorators
mutmut 3 refuses to look under (``@torch.no_grad()``, ``@torch.library.custom_op(...)``) are moved to
an assignment after the function -- the same object, so ``evaluate``, ``generate`` and the fused loss
op are mutated too. Then ``mutmut run`` there (configuration: ``[tool.mutmut]`` in pyproject.toml),
and the result goes to tools/mutation/last_run.md and last_run.json (only for a run of every module
from HEAD, unless ``--record``; otherwise to .mutation/last_run.*). Survivors are matched against
the hand-kept explanations in tools/mutation/survivors.txt. tools/mutation/README.md says more.
"""

from __future__ import annotations

import argparse
import ast
import datetime
import fnmatch
import hashlib
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
HERE = REPO / "tools" / "mutation"
WORK = REPO / ".mutation"
#: mutmut's results of the last recorded run, per file (see save_cache): what --resume continues
CACHE = HERE / "cache.json"
SNAPSHOT = ("src", "tests", "docs", "README.md", "pyproject.toml")
#: the core modules: name on the command line -> (file, mutant-name prefix)
MODULES = {
    "model": ("src/gptspeed/model.py", "gptspeed.model."),
    "loss": ("src/gptspeed/loss.py", "gptspeed.loss."),
    "step": ("src/gptspeed/step.py", "gptspeed.step."),
    "optim": ("src/gptspeed/optim.py", "gptspeed.optim."),
    "schedules": ("src/gptspeed/schedules.py", "gptspeed.schedules."),  # optim.py's until issue 53
    "loader": ("src/gptspeed/data/loader.py", "gptspeed.data.loader."),
    "sample": ("src/gptspeed/sample.py", "gptspeed.sample."),
    "val_loss": ("src/gptspeed/eval/val_loss.py", "gptspeed.eval.val_loss."),
    "hellaswag": ("src/gptspeed/eval/hellaswag.py", "gptspeed.eval.hellaswag."),
    "checkpoint": ("src/gptspeed/checkpoint/", "gptspeed.checkpoint."),  # a package
    "locks": ("src/gptspeed/locks.py", "gptspeed.locks."),  # checkpoint.RunLock's until issue 53
}
#: decorators that only wrap the function object (no registration by name, no class magic): moved
#: below the function in the snapshot so that mutmut mutates its body
MOVABLE_DECORATORS = ("torch.no_grad(", "torch.library.custom_op(")
#: mutmut's exit-code -> status table (mutmut.stats.status_by_exit_code), kept here so the report
#: does not depend on mutmut internals beyond the .meta files
STATUS = {
    1: "killed",
    3: "killed",
    0: "survived",
    5: "no tests",
    33: "no tests",
    2: "interrupted",
    None: "not checked",
    34: "skipped",
    35: "suspicious",
    36: "timeout",
    37: "type check",
    -24: "timeout",
    24: "timeout",
    152: "timeout",
    255: "timeout",
    -11: "segfault",
    -9: "segfault",
}


#: ``mutmut`` itself, with its call-context bookkeeping (a ContextVar set and reset around every call
#: of a mutated function while it records which tests reach which function) made a no-op: only
#: its dependency tracking reads it, which is off here, and under CPython 3.11 it segfaulted the
#: stats pass now and then in tests that drain generators (gptspeed.data.loader.iter_eval_batches).
#: And its record of a hit hidden from torch.compile: traced in a compiled test, it put a guard on
#: mutmut's set of hits that failed on the frame that made it (a compiled training's stats pass failed
#: on unmutated code, 2026-11-28); disabled for dynamo it is a graph break, in the stats pass only.
MUTMUT = """
import sys
from mutmut.core import MutmutCallStack
MutmutCallStack.get = classmethod(lambda cls: (None, 0))
MutmutCallStack.set = classmethod(lambda cls, value: None)
MutmutCallStack.reset = classmethod(lambda cls, token: None)
import mutmut.mutation.trampoline as trampoline
record_hit = trampoline.record_trampoline_hit
try:  # torch.compile must not trace the stats pass's record of a hit (it guards on the set of hits and fails)
    import torch._dynamo
    trampoline.record_trampoline_hit = torch._dynamo.disable(lambda name, caller=None: record_hit(name, caller))
except ImportError:
    pass
from mutmut.__main__ import cli
sys.argv[0] = "mutmut"
cli()
"""


def move_decorators(source: str) -> str:
    """``@torch.no_grad()\\ndef f(...): ...`` -> ``def f(...): ...\\nf = torch.no_grad()(f)`` for
    module-level functions whose decorators are all in :data:`MOVABLE_DECORATORS`; the same
    function object results, and mutmut 3 (which skips decorated functions) mutates it."""
    tree = ast.parse(source)
    lines = source.splitlines(keepends=True)
    edits = []  # (first line of decorators, last line of decorators, end of function, new lines)
    for node in tree.body:
        if not isinstance(node, ast.FunctionDef) or not node.decorator_list:
            continue
        texts = [ast.get_source_segment(source, d) for d in node.decorator_list]
        if not all(t.startswith(MOVABLE_DECORATORS) for t in texts):
            continue
        first = node.decorator_list[0].lineno - 1  # the "@" line (0-based)
        last = node.decorator_list[-1].end_lineno - 1
        if not lines[first].lstrip().startswith("@") or node.lineno - 1 != last + 1:
            continue  # decorators not on lines of their own: leave it
        # mutmut's trampoline (functools.wraps) keeps the string annotations of ``from __future__
        # import annotations`` but not the module they resolve in: resolve them here (custom_op
        # reads them to infer the op's schema)
        f = node.name
        assign = (
            f"import typing as _t; _w = getattr({f}, '__wrapped__', {f}); "
            f"_w.__annotations__ = _t.get_type_hints(_w)  # moved by tools/mutation/run.py\n"
        )
        assign += "".join(f"{f} = {t}({f})  # moved by tools/mutation/run.py\n" for t in reversed(texts))
        edits.append((first, last, node.end_lineno, assign))
    for first, last, end, assign in reversed(edits):
        lines[end:end] = [assign]
        del lines[first : last + 1]
    return "".join(lines)


def git(*args: str) -> str:
    return subprocess.run(["git", *args], cwd=REPO, check=True, capture_output=True, text=True).stdout


def snapshot_files(worktree: bool) -> dict[str, bytes]:
    """Path -> content of the snapshot: HEAD's tracked files, or the working tree's (tracked and
    untracked, not ignored)."""
    files = {}
    if worktree:
        for rel in git("ls-files", "-co", "--exclude-standard", "-z", "--", *SNAPSHOT).split("\0"):
            if rel and (REPO / rel).is_file():
                files[rel] = (REPO / rel).read_bytes()
    else:
        import io
        import tarfile

        tar = subprocess.run(
            ["git", "archive", "--format=tar", "HEAD", "--", *SNAPSHOT], cwd=REPO, check=True, capture_output=True
        ).stdout
        with tarfile.open(fileobj=io.BytesIO(tar)) as t:
            for m in t.getmembers():
                if m.isfile():
                    files[m.name] = t.extractfile(m).read()
    for rel in files:
        if rel.endswith(".py") and any(
            rel == p or (p.endswith("/") and rel.startswith(p)) for p, _ in MODULES.values()
        ):
            files[rel] = move_decorators(files[rel].decode()).encode()
    return files


#: written into every work folder this script creates (or finds empty): it empties and deletes only a
#: folder holding it, never one of the user's (``--workdir ~`` must not cost a home folder)
MARKER = ".gptspeed-mutation-workdir"


class WorkdirRefused(Exception):
    """A ``--workdir`` this script did not make: one line, nothing touched."""


def claim_workdir(work: Path) -> None:
    """Make ``work`` this script's work folder, or refuse it: a new folder is created with
    :data:`MARKER` in it, an empty one gets the marker, one holding the marker is this script's;
    anything else -- a file, a folder of other files (an earlier tool's, the user's) -- raises
    :class:`WorkdirRefused` before anything is written or deleted."""
    if not os.path.lexists(work):
        work.mkdir(parents=True)
    elif work.is_symlink() or not work.is_dir():
        raise WorkdirRefused(f"--workdir {work} is not a folder: name a new or empty folder for the snapshot")
    elif not (work / MARKER).is_file():
        entries = sorted(p.name for p in work.iterdir())
        if entries:
            shown = ", ".join(entries[:3]) + (f" and {len(entries) - 3} more" if len(entries) > 3 else "")
            raise WorkdirRefused(
                f"--workdir {work} holds files this script did not write ({shown}; no {MARKER}): it "
                "empties its work folder, so it uses only one it made; name a new or empty folder "
                f"(an earlier run's folder of this script: `touch {work / MARKER}`)"
            )
    (work / MARKER).write_text("made by tools/mutation/run.py, which empties and deletes this folder at will\n")


def write_snapshot(files: dict[str, bytes], fresh: bool) -> None:
    """Write the snapshot to .mutation/; on --resume only files whose content changed are
    rewritten, and files gone from the snapshot are removed. A rewritten file's copy in
    ``mutants/`` is removed too (its ``.meta`` results stay): mutmut copies a source into
    ``mutants/`` only where none is, and measures which lines the tests run on that copy before it
    mutates -- on the old, mutated copy the line numbers are not the new file's, and only a few of
    its lines were mutated (hellaswag.py: 50 mutants for 404, 2026-11-27); a file it does not
    mutate would stay old. With the copy gone, mutmut copies the new file, measures it, mutates it
    again and keeps the result of every function whose text did not change. Only a work folder of
    this script's own is emptied or written (:func:`claim_workdir`; :class:`WorkdirRefused`)."""
    claim_workdir(WORK)
    if fresh:
        shutil.rmtree(WORK)
        claim_workdir(WORK)
    (WORK / ".gitignore").write_text("*\n")
    for rel, data in files.items():
        p = WORK / rel
        if p.is_file() and p.read_bytes() == data:
            continue
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(data)
        (WORK / "mutants" / rel).unlink(missing_ok=True)
    for top in SNAPSHOT:
        root = WORK / top
        for p in [root] if root.is_file() else root.rglob("*") if root.is_dir() else []:
            if p.is_file() and str(p.relative_to(WORK)) not in files and "__pycache__" not in p.parts:
                p.unlink()


def precheck(env: dict[str, str]) -> list[str]:
    """Run mutmut's test selection once on the unmutated snapshot; the node ids that fail (mutmut
    needs every selected test to pass before it mutates anything) are deselected in the snapshot's
    pyproject.toml and named in the report."""
    import tomllib

    cfg = tomllib.loads((WORK / "pyproject.toml").read_text())["tool"]["mutmut"]
    cmd = [
        sys.executable,
        "-m",
        "pytest",
        *cfg.get("pytest_add_cli_args", []),
        *cfg.get("pytest_add_cli_args_test_selection", []),
        "-q",
        "-rfE",
        "--tb=no",
    ]
    env = {**env, "PYTHONPATH": os.pathsep.join(p for p in (str(WORK / "src"), env.get("PYTHONPATH")) if p)}
    print("checking that the selected tests pass on the unmutated code ...", flush=True)
    out = subprocess.run(cmd, cwd=WORK, env=env, capture_output=True, text=True).stdout
    failing = sorted(
        {
            line.split(" ", 1)[1].split(" - ", 1)[0]
            for line in out.splitlines()
            if line.startswith(("FAILED ", "ERROR "))
        }
    )
    if failing:
        text = (WORK / "pyproject.toml").read_text()
        anchor = "pytest_add_cli_args = [\n"
        assert anchor in text, "pyproject.toml: [tool.mutmut] pytest_add_cli_args not found"
        extra = "".join(f'    "--deselect", {json.dumps(n)},  # fails on the unmutated code\n' for n in failing)
        (WORK / "pyproject.toml").write_text(text.replace(anchor, anchor + extra, 1))
        print(f"left out, failing on the unmutated code: {', '.join(failing)}", file=sys.stderr)
    return failing


def metas():
    """``(path, content)`` of each of mutmut's ``.meta`` files (one beside each mutated file: the exit
    code of each mutant, the hash of each function's text), in path order."""
    for meta in sorted((WORK / "mutants").rglob("*.py.meta")):
        yield meta, json.loads(meta.read_text())


def exit_codes() -> dict[str, int | None]:
    """Mutant name -> mutmut's exit code (None: not checked), from the .meta files."""
    out = {}
    for _, m in metas():
        out.update(m["exit_code_by_key"])
    return out


def mutant_counts() -> dict[str, tuple[int, str | None]]:
    """Function (mutmut's qualified name, e.g. ``gptspeed.step.x_check_step``) -> (its number of
    mutants, the hash of its text), from the .meta files."""
    out: dict[str, tuple[int, str | None]] = {}
    for _, m in metas():
        for name in m["exit_code_by_key"]:
            func = name.rpartition("__mutmut_")[0]
            n, _ = out.get(func, (0, None))
            out[func] = (n + 1, m["hash_by_function_name"].get(func.rpartition(".")[2]))
    return out


def shifted_functions(before: dict, after: dict) -> list[str]:
    """Functions (of :func:`mutant_counts`) whose number of mutants changed while their text did
    not. mutmut numbers a function's mutants in the order of its covered lines and carries a result
    over by that number when the function's text is unchanged; but which lines are covered depends
    on the tests and on the host (a bf16 CPU runs branches an AVX2 one does not): a line newly
    covered shifts every later number, and the carried results then belong to other mutants. Those
    functions must be retested whole (2026-11-27: loss.py's ``_backward`` went from 18 mutants to
    22 on an AVX-512 host, and two of its carried "killed" results, 15 and 18, survived a retest).
    A function whose text changed was retested by mutmut already."""
    return sorted(f for f, (n, h) in after.items() if f in before and before[f][0] != n and before[f][1] == h)


def load_results(prefixes: list[str]) -> dict[str, str]:
    """Mutant name -> status, from mutmut's .meta files. mutmut resets every result when the test
    selection or the pytest arguments change (its config fingerprint): such a run starts again, as
    it should -- the old verdicts were reached with other tests."""
    return {
        name: STATUS.get(code, "suspicious") for name, code in exit_codes().items() if name.startswith(tuple(prefixes))
    }


def run_time(info: dict) -> float:
    """Seconds a run has taken, from its ``run_info.json``: the ended segments' total (``wall_s``),
    plus, for a segment that did not end (still going, or killed), the time from its start to
    mutmut's last recorded result."""
    if "started" not in info:
        return info["wall_s"]
    last = max((p.stat().st_mtime for p in (WORK / "mutants").rglob("*.py.meta")), default=info["started"])
    return info["wall_s"] + max(0.0, last - info["started"])


def run_commit() -> str:
    """The commit the run's snapshot was taken at (HEAD may have moved on while it ran)."""
    info = WORK / "run_info.json"
    commit = json.loads(info.read_text()).get("git_commit") if info.exists() else None
    return commit or git("rev-parse", "HEAD").strip()


def save_cache(wall_s: float) -> None:
    """Keep mutmut's results (from its ``.meta`` files: the exit code of each mutant, the hash of each
    function's text) in :data:`CACHE`, committed with the record, so that ``--resume`` on a machine
    without ``.mutation/`` (a new session's) continues the run instead of starting it again. Compact:
    per function, the exit codes of its mutants 1, 2, ... in order (null: not checked)."""
    files = {}
    for meta, m in metas():
        codes: dict[str, list] = {}
        for name, code in m["exit_code_by_key"].items():
            func, _, i = name.rpartition("__mutmut_")
            codes.setdefault(func, []).append((int(i), code))
        files[str(meta.relative_to(WORK / "mutants"))] = {
            "hash_by_function_name": m["hash_by_function_name"],
            "exit_codes": {
                f: [c for _, c in sorted(v)]
                for f, v in codes.items()
                if sorted(i for i, _ in v) == list(range(1, len(v) + 1))
            },
        }
    data = {"git_commit": run_commit(), "wall_s": round(wall_s), "files": files}
    tmp = CACHE.with_suffix(".tmp")
    tmp.write_text(json.dumps(data, separators=(",", ":"), sort_keys=True, ensure_ascii=False) + "\n")
    tmp.replace(CACHE)


def restore_cache() -> int:
    """Write :data:`CACHE`'s results as ``.meta`` files into a fresh ``.mutation/mutants/``; mutmut
    regenerates the mutants and keeps the result of every mutant whose function's text is unchanged.
    Returns the number of results restored."""
    data = json.loads(CACHE.read_text())
    n = 0
    for rel, m in data["files"].items():
        codes = {f"{f}__mutmut_{i}": c for f, cs in m["exit_codes"].items() for i, c in enumerate(cs, 1)}
        p = WORK / "mutants" / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(
            json.dumps(
                {
                    "exit_code_by_key": codes,
                    "hash_by_function_name": m["hash_by_function_name"],
                    "type_check_error_by_key": {},
                    "durations_by_key": {},
                    "estimated_durations_by_key": {},
                }
            )
        )
        n += sum(c is not None for c in codes.values())
    (WORK / "run_info.json").write_text(json.dumps({"wall_s": data.get("wall_s", 0.0), "argv": ["(restored)"]}))
    return n


def fingerprint(diff: str) -> str:
    """8 hex digits naming a mutant by what it changes (its :func:`short_diff`), not by its number."""
    return hashlib.sha256(short_diff(diff).encode()).hexdigest()[:8]


def load_explanations() -> dict[str, tuple[str, str, str | None]]:
    """tools/mutation/survivors.txt: ``<mutant name> <fingerprint> <equivalent|gap> <why>`` a line, #
    comments -> ``{name: (kind, why, fingerprint)}``. The fingerprint (8 hex digits) may be left out
    (None): the line then vouches for the name, whatever mutant it names."""
    out = {}
    path = HERE / "survivors.txt"
    for line in path.read_text().splitlines() if path.exists() else []:
        line = line.strip()
        if line and not line.startswith("#"):
            name, rest = line.split(None, 1)
            fp = None
            if re.fullmatch(r"[0-9a-f]{8}", rest.split(None, 1)[0]):
                fp, rest = rest.split(None, 1)
            kind, why = rest.split(None, 1)
            assert kind in ("equivalent", "gap"), line
            out[name] = (kind, why, fp)
    return out


def match_explanations(expl: dict, survivors: dict[str, str]) -> tuple[dict[str, tuple[str, str]], list[str]]:
    """Match survivors (name -> diff) with their explanations: by the function and the fingerprint of
    what the mutant changes, so that an explanation follows its mutant when mutmut numbers the
    function's mutants otherwise (another CPU's coverage, new tests; see :func:`shifted_functions`);
    by name for a line without a fingerprint. Returns ``({survivor: (kind, why)}, [explanation
    names that matched no survivor])``."""
    by_fp: dict[tuple[str, str], list[str]] = {}  # one change can stand on two identical lines
    for n, (_, _, fp) in expl.items():
        if fp:
            by_fp.setdefault((n.rpartition("__mutmut_")[0], fp), []).append(n)
    found, used = {}, set()
    for n, diff in survivors.items():
        keys = by_fp.get((n.rpartition("__mutmut_")[0], fingerprint(diff)), []) if diff else []
        if not keys and n in expl and expl[n][2] is None:
            keys = [n]
        if keys:
            found[n] = expl[n if n in keys else keys[0]][:2]
            used.update(keys)
    return found, sorted(set(expl) - used)


def diffs(names: list[str]) -> dict[str, str]:
    """The diff of each mutant (mutmut show), read in the snapshot."""
    if not names:
        return {}
    code = (
        "import json, sys\nfrom mutmut.mutation.diff_apply import get_diff_for_mutant\n"
        "out = {}\nfor n in json.load(sys.stdin):\n"
        "    try: out[n] = get_diff_for_mutant(n)\n"
        "    except Exception as e: out[n] = f'(no diff: {e})'\nprint(json.dumps(out))\n"
    )
    r = subprocess.run(
        [sys.executable, "-c", code], cwd=WORK, input=json.dumps(names), capture_output=True, text=True, check=True
    )
    return json.loads(r.stdout)


def short_diff(diff: str) -> str:
    """The changed lines of a mutant's diff, without the file header."""
    keep = [l for l in diff.splitlines() if l[:1] in "+-" and not l.startswith(("+++", "---"))]
    return "\n".join(keep)


def machine() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return (
        f"{platform.system()} {platform.machine()}, {os.cpu_count()} cores ({cpu}), Python {platform.python_version()}"
    )


def report(modules: list[str], results: dict[str, str], wall_s: float, args, out_dir: Path) -> dict:
    import importlib.metadata as md

    survivors = sorted(n for n, s in results.items() if s == "survived")
    d = diffs(survivors)
    expl, unmatched = match_explanations(load_explanations(), {n: d.get(n, "") for n in survivors})
    counts = {}
    for _n, s in results.items():
        counts[s] = counts.get(s, 0) + 1
    per_module = {}
    for m in modules:
        prefix = MODULES[m][1]
        mine = [s for n, s in results.items() if n.startswith(prefix)]
        per_module[m] = {k: mine.count(k) for k in sorted(set(mine))} | {"mutants": len(mine)}
    total = len(results)
    killed = counts.get("killed", 0)
    checked = total - counts.get("not checked", 0)  # a run stopped part-way leaves the rest unchecked
    record = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "git_commit": run_commit(),
        "source": "working tree" if args.worktree else "HEAD",
        "library": f"mutmut {md.version('mutmut')}",
        "command": "python tools/mutation/run.py " + " ".join(sys.argv[1:]),
        "modules": {m: MODULES[m][0] for m in modules},
        "mutants": total,
        "killed": killed,
        "survived": counts.get("survived", 0),
        "timeouts": counts.get("timeout", 0),
        "no_tests": counts.get("no tests", 0),
        "skipped": counts.get("skipped", 0),
        "not_checked": counts.get("not checked", 0),
        "other": {
            k: v
            for k, v in counts.items()
            if k not in ("killed", "survived", "timeout", "no tests", "skipped", "not checked")
        },
        "killed_pct": round(100 * killed / checked, 2) if checked else None,  # of the mutants checked
        "detected_pct": round(100 * (killed + counts.get("timeout", 0)) / checked, 2) if checked else None,
        "wall_s": round(wall_s),
        "max_children": args.max_children,
        "machine": machine(),
        "per_module": per_module,
        "survivors": [
            {
                "name": n,
                "status": "survived",
                "explained_as": expl.get(n, ("unexplained", ""))[0],
                "why": expl.get(n, ("", ""))[1],
                "diff": short_diff(d.get(n, "")),
                "fingerprint": fingerprint(d.get(n, "")),
            }
            for n in survivors
        ],
        "not_killed_other": sorted(n for n, s in results.items() if s not in ("killed", "survived", "not checked")),
        # explained, but matching no survivor of a module this run mutated: killed now, or changed
        "explained_but_not_surviving": [n for n in unmatched if n.startswith(tuple(MODULES[m][1] for m in modules))],
        "tests_failing_unmutated": json.loads((WORK / "failing_tests.json").read_text())
        if (WORK / "failing_tests.json").exists()
        else [],
    }
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "last_run.json").write_text(json.dumps(record, indent=1, ensure_ascii=False) + "\n")
    (out_dir / "last_run.md").write_text(markdown(record))
    return record


def markdown(r: dict) -> str:
    lines = [
        "# Mutation check: last recorded run",
        "",
        f"Written by `{r['command']}` (tools/mutation/README.md says how to read it).",
        "",
        f"- date: {r['date']}, commit {r['git_commit'][:12]} ({r['source']})",
        f"- library: {r['library']}, {r['max_children']} workers",
        f"- machine: {r['machine']}",
        f"- wall time: {r['wall_s'] / 60:.0f} min ({r['wall_s']} s)",
        f"- mutants: {r['mutants']}; killed {r['killed']} ({r['killed_pct']}%); survived {r['survived']}; "
        f"timeouts {r['timeouts']}; no tests {r['no_tests']}; skipped {r['skipped']}"
        + (f"; other {r['other']}" if r["other"] else ""),
        f"- not checked (the run stopped before them): {r.get('not_checked', 0)}; the percentages are of the "
        f"{r['mutants'] - r.get('not_checked', 0)} checked",
        f"- killed or timed out: {r['detected_pct']}%",
        "",
        "| module | mutants | killed | survived | timeout | no tests | not checked |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for m, c in r["per_module"].items():
        lines.append(
            f"| {m} | {c['mutants']} | {c.get('killed', 0)} | {c.get('survived', 0)} | "
            f"{c.get('timeout', 0)} | {c.get('no tests', 0)} | {c.get('not checked', 0)} |"
        )
    if r["tests_failing_unmutated"]:
        lines += [
            "",
            "Left out of this run, failing on the unmutated code: "
            + ", ".join(f"`{t}`" for t in r["tests_failing_unmutated"]),
        ]
    lines += ["", f"## Survivors ({len(r['survivors'])})", ""]
    for s in r["survivors"]:
        lines.append(
            f"- `{s['name']}` `{s['fingerprint']}` -- **{s['explained_as']}**" + (f": {s['why']}" if s["why"] else "")
        )
        if s["diff"]:
            lines += ["  ```diff"] + ["  " + l for l in s["diff"].splitlines()] + ["  ```"]
    if r["not_killed_other"]:
        lines += ["", "## Neither killed nor survived", ""] + [f"- `{n}`" for n in r["not_killed_other"]]
    if r["explained_but_not_surviving"]:
        lines += ["", "## Explained in survivors.txt but no longer surviving (remove them there)", ""]
        lines += [f"- `{n}`" for n in r["explained_but_not_surviving"]]
    return "\n".join(lines) + "\n"


def to_retest(results: dict[str, str], patterns: list[str]) -> list[str]:
    """The mutants ``--survivors`` tests again: those that survived or timed out, only those whose name
    matches one of the glob ``patterns`` when any are given (``--mutant``), sorted."""
    again = (n for n, s in results.items() if s in ("survived", "timeout"))
    return sorted(n for n in again if not patterns or any(fnmatch.fnmatchcase(n, p) for p in patterns))


def main() -> int:
    global WORK
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "modules", nargs="*", metavar="MODULE", help=f"core modules to mutate (default: all): {', '.join(MODULES)}"
    )
    ap.add_argument("--worktree", action="store_true", help="snapshot the working tree instead of HEAD")
    ap.add_argument(
        "--resume",
        action="store_true",
        help="keep .mutation/ (mutmut's cache of mutants and results) and refresh only changed files",
    )
    ap.add_argument(
        "--survivors",
        action="store_true",
        help="retest only the survivors and timeouts of the run kept in .mutation/ (implies --resume)",
    )
    ap.add_argument(
        "--mutant",
        action="append",
        default=[],
        metavar="PATTERN",
        help="with --survivors (implied): retest only the survivors whose name matches this glob (repeatable), "
        "e.g. after a test written for them",
    )
    ap.add_argument("--max-children", type=int, default=os.cpu_count() or 2, help="mutants tested at once")
    ap.add_argument(
        "--record", action="store_true", help="write tools/mutation/last_run.* even for a partial or working-tree run"
    )
    ap.add_argument("--report-only", action="store_true", help="rewrite the report from .mutation/ and exit")
    ap.add_argument("--workdir", type=Path, default=WORK, help="where the snapshot and mutmut's cache live")
    ap.add_argument(
        "--no-precheck",
        action="store_true",
        help="skip the run of the selected tests on the unmutated code (which deselects the failing ones)",
    )
    args = ap.parse_args()
    WORK = args.workdir.expanduser().resolve()
    try:
        claim_workdir(WORK)  # before anything: a folder of the user's is refused, untouched
    except WorkdirRefused as e:
        print(f"tools/mutation/run.py: {e}", file=sys.stderr)
        return 2
    unknown = [m for m in args.modules if m not in MODULES]
    if unknown:
        ap.error(f"unknown module(s) {', '.join(unknown)}; the core modules: {', '.join(MODULES)}")
    modules = args.modules or list(MODULES)
    prefixes = [MODULES[m][1] for m in modules]
    if args.mutant:
        args.survivors = True
    full = not args.modules and not args.worktree and not args.survivors
    out_dir = HERE if (full or args.record) else WORK
    if args.survivors:
        args.resume = True
    if shutil.which("mutmut") is None:
        print("mutmut is not installed: pip install -e '.[test,mutation]'", file=sys.stderr)
        return 2
    t0 = time.monotonic()
    if not args.report_only:
        restore = args.resume and not (WORK / "mutants").exists() and CACHE.exists()
        write_snapshot(snapshot_files(args.worktree), fresh=not args.resume)
        if restore:  # another machine's run, carried over: mutmut keeps each unchanged function's results
            n = restore_cache()
            print(f"{n} mutant results restored from {CACHE.relative_to(REPO)}", flush=True)
        if args.survivors:
            names = to_retest(load_results(prefixes), args.mutant)
            if not names:
                print("no survivors in .mutation/ to retest")
                return 0
        elif args.resume and not args.modules:
            names = []  # mutmut then tests only the mutants without a result (a pattern retests all it matches)
        else:
            names = [p + "*" for p in prefixes]
        env = dict(os.environ)
        # conftest.py finds the corpora beside the checkout (../shared/data); the snapshot is elsewhere
        env.setdefault("GPTSPEED_DATA_MIRROR", str(REPO.parent / "shared" / "data"))
        # each mutant runs in its own worker process: one thread each, as pytest -n does
        env.update(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", MKL_CBWR="AUTO", MKL_DYNAMIC="FALSE")
        failing = [] if args.no_precheck else precheck(env)
        (WORK / "failing_tests.json").write_text(json.dumps(failing))
        info = WORK / "run_info.json"
        before_s = (
            run_time(json.loads(info.read_text()))  # a stopped run continued: its time adds up
            if args.resume and not args.survivors and info.exists()
            else 0.0
        )
        info.write_text(
            json.dumps(
                {
                    "wall_s": before_s,
                    "started": time.time() - (time.monotonic() - t0),
                    "argv": sys.argv[1:],
                    "git_commit": git("rev-parse", "HEAD").strip(),
                }
            )
        )
        log = WORK / "mutmut.log"
        print(
            f"mutmut run in {WORK} ({len(names) or 'every unchecked mutant, no'} name patterns), log: {log}", flush=True
        )
        before = mutant_counts() if args.resume else {}
        with open(log, "w") as f:
            rc = subprocess.run(
                [sys.executable, "-c", MUTMUT, "run", "--max-children", str(args.max_children), *names],
                cwd=WORK,
                env=env,
                stdout=f,
                stderr=subprocess.STDOUT,
            ).returncode
        shifted = shifted_functions(before, mutant_counts()) if rc == 0 else []
        if shifted:  # results carried over by a number that now names another mutant: test them again
            print(
                f"retesting {len(shifted)} functions whose mutants were renumbered (coverage changed): "
                f"{', '.join(shifted)}",
                flush=True,
            )
            with open(log, "a") as f:
                rc = subprocess.run(
                    [
                        sys.executable,
                        "-c",
                        MUTMUT,
                        "run",
                        "--max-children",
                        str(args.max_children),
                        *(fn + "__mutmut_*" for fn in shifted),
                    ],
                    cwd=WORK,
                    env=env,
                    stdout=f,
                    stderr=subprocess.STDOUT,
                ).returncode
        if rc != 0:
            tail = log.read_text(errors="replace").splitlines()[-30:]
            print("\n".join(l for l in tail if "DEBUG" not in l), file=sys.stderr)
            print(f"mutmut run failed (exit {rc}); see {log}", file=sys.stderr)
            return rc
    info = WORK / "run_info.json"
    if args.report_only:  # of a finished run, or of one still going ("started" is set until it ends)
        wall = run_time(json.loads(info.read_text())) if info.exists() else float("nan")
    else:
        wall = before_s + time.monotonic() - t0
        i = json.loads(info.read_text())
        i.pop("started", None)  # the run ended
        info.write_text(json.dumps({**i, "wall_s": wall}))
    results = load_results(prefixes)
    r = report(modules, results, wall, args, out_dir)
    if out_dir == HERE:
        save_cache(wall)
    unexplained = [s["name"] for s in r["survivors"] if s["explained_as"] == "unexplained"]
    print(
        f"{r['mutants']} mutants: {r['killed']} killed ({r['killed_pct']}%), {r['survived']} survived "
        f"({len(unexplained)} unexplained), {r['timeouts']} timeouts, {r['no_tests']} without tests; "
        f"{wall / 60:.0f} min; report: {out_dir / 'last_run.md'}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""tools/mutation/run.py, the mutation check's driver: the parts that decide what is mutated, resumed and recorded."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[2]


def load_run_py(tmp_path: Path):
    spec = importlib.util.spec_from_file_location("mutation_run", REPO / "tools" / "mutation" / "run.py")
    run = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(run)
    run.WORK = tmp_path / "work"
    run.CACHE = tmp_path / "cache.json"
    return run


def write_meta(work: Path, rel: str, codes: dict, hashes: dict) -> None:
    p = work / "mutants" / rel
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(
        json.dumps(
            {
                "exit_code_by_key": codes,
                "hash_by_function_name": hashes,
                "type_check_error_by_key": {},
                "durations_by_key": {k: 1.5 for k in codes},
                "estimated_durations_by_key": {},
            }
        )
    )


def test_moved_decorator_gives_the_same_function_and_no_decorator_line(tmp_path):
    run = load_run_py(tmp_path)
    source = (
        "import torch\n\n\n@torch.no_grad()\ndef double(x):\n    return x * 2\n\n\n"
        "@staticmethod\ndef kept(x):\n    return x\n"
    )
    moved = run.move_decorators(source)
    assert "@torch.no_grad()" not in moved, moved
    assert "@staticmethod" in moved, "a decorator outside MOVABLE_DECORATORS must stay where it is"
    ns: dict = {}
    exec(compile(moved, "moved.py", "exec"), ns)
    y = ns["double"](torch.ones(2, requires_grad=True))
    assert torch.equal(y, torch.full((2,), 2.0)) and not y.requires_grad, "the moved no_grad must still apply"


def test_cache_round_trip_restores_every_result_in_a_fresh_folder(tmp_path):
    run = load_run_py(tmp_path)
    codes = {
        "gptspeed.sample.x_f__mutmut_1": 1,
        "gptspeed.sample.x_f__mutmut_2": 0,
        "gptspeed.sample.x_f__mutmut_3": None,
        "gptspeed.sample.xǁAǁg__mutmut_1": 36,
    }
    write_meta(run.WORK, "src/gptspeed/sample.py.meta", codes, {"x_f": "h1", "xǁAǁg": "h2"})
    write_meta(run.WORK, "src/gptspeed/data/loader.py.meta", {"gptspeed.data.loader.x_h__mutmut_1": 3}, {"x_h": "h3"})
    (run.WORK / "run_info.json").write_text(json.dumps({"wall_s": 10.0, "git_commit": "abc"}))
    run.save_cache(wall_s=4321.0)
    saved = json.loads(run.CACHE.read_text())
    assert saved["git_commit"] == "abc", "the cache names the run's commit, not the HEAD of the moment"
    assert saved["wall_s"] == 4321

    run.WORK = tmp_path / "fresh"
    assert run.restore_cache() == 4, "four mutants had a result"
    restored = run.exit_codes()
    assert restored == {**codes, "gptspeed.data.loader.x_h__mutmut_1": 3}
    meta = json.loads((run.WORK / "mutants/src/gptspeed/sample.py.meta").read_text())
    assert meta["hash_by_function_name"] == {"x_f": "h1", "xǁAǁg": "h2"}, "mutmut keeps results by function hash"
    assert json.loads((run.WORK / "run_info.json").read_text())["wall_s"] == 4321, "a continued run adds its time"


def test_cache_leaves_out_a_function_whose_mutants_are_not_numbered_from_one(tmp_path):
    run = load_run_py(tmp_path)
    write_meta(
        run.WORK,
        "src/gptspeed/sample.py.meta",
        {"gptspeed.sample.x_f__mutmut_1": 1, "gptspeed.sample.x_f__mutmut_3": 0, "gptspeed.sample.x_g__mutmut_1": 0},
        {"x_f": "h1", "x_g": "h2"},
    )
    run.save_cache(wall_s=1.0)
    run.WORK = tmp_path / "fresh"
    run.restore_cache()
    assert run.exit_codes() == {"gptspeed.sample.x_g__mutmut_1": 0}, (
        "results that cannot be put back under their own names must not be restored under others"
    )


def test_run_time_counts_a_killed_segment_up_to_its_last_result(tmp_path):
    """A segment killed part-way (or still going) counts from its start to mutmut's last result,
    added to the ended segments' total; an ended run is its total."""
    import os

    run = load_run_py(tmp_path)
    write_meta(run.WORK, "src/gptspeed/sample.py.meta", {"gptspeed.sample.x_f__mutmut_1": 1}, {"x_f": "h"})
    meta = run.WORK / "mutants/src/gptspeed/sample.py.meta"
    os.utime(meta, (1000.0 + 600, 1000.0 + 600))  # the last result, 10 minutes after the start
    assert run.run_time({"wall_s": 50.0, "started": 1000.0}) == 650.0
    assert run.run_time({"wall_s": 50.0}) == 50.0


def test_resume_drops_the_mutated_copy_of_a_changed_file_and_keeps_its_results(tmp_path):
    """mutmut measures coverage on ``mutants/``'s copy before mutating: a changed file's old mutated
    copy left there gives the new file the old copy's line numbers (few mutants), and an unmutated
    file is never copied again. A continued run removes the copy of each changed file only, and keeps
    the results (``.meta``) from which mutmut carries over the unchanged functions."""
    run = load_run_py(tmp_path)
    run.write_snapshot({"src/gptspeed/a.py": b"x = 1\n", "src/gptspeed/b.py": b"y = 1\n"}, fresh=True)
    for rel in ("src/gptspeed/a.py", "src/gptspeed/b.py"):
        (run.WORK / "mutants" / rel).parent.mkdir(parents=True, exist_ok=True)
        (run.WORK / "mutants" / rel).write_text("# mutated copy\n")
    write_meta(run.WORK, "src/gptspeed/a.py.meta", {"gptspeed.a.x_f__mutmut_1": 1}, {"x_f": "h"})

    run.write_snapshot({"src/gptspeed/a.py": b"x = 2\n", "src/gptspeed/b.py": b"y = 1\n"}, fresh=False)
    assert (run.WORK / "src/gptspeed/a.py").read_text() == "x = 2\n"
    assert not (run.WORK / "mutants/src/gptspeed/a.py").exists(), "the changed file's old mutated copy was kept"
    assert (run.WORK / "mutants/src/gptspeed/b.py").read_text() == "# mutated copy\n", "an unchanged file is redone"
    assert run.exit_codes() == {"gptspeed.a.x_f__mutmut_1": 1}, "the changed file's results were dropped"


def test_a_function_renumbered_by_coverage_is_retested_and_only_it(tmp_path):
    """mutmut carries a result over by the mutant's number when a function's text is unchanged; a
    line newly covered (new tests, another CPU's branches) renumbers the function's mutants: such a
    function is named for a retest; one whose count is unchanged, whose text changed (mutmut
    retested it), or that is new, is not."""
    run = load_run_py(tmp_path)

    def mutants(counts: dict, hashes: dict):
        write_meta(
            run.WORK,
            "src/gptspeed/step.py.meta",
            {f"gptspeed.step.{f}__mutmut_{i}": 1 for f, n in counts.items() for i in range(1, n + 1)},
            hashes,
        )
        return run.mutant_counts()

    before = mutants({"x_a": 3, "x_b": 2, "xǁTǁm": 4}, {"x_a": "h", "x_b": "h", "xǁTǁm": "h"})
    assert before == {"gptspeed.step.x_a": (3, "h"), "gptspeed.step.x_b": (2, "h"), "gptspeed.step.xǁTǁm": (4, "h")}
    after = mutants(
        {"x_a": 5, "x_b": 2, "xǁTǁm": 6, "x_c": 1}, {"x_a": "h", "x_b": "h", "xǁTǁm": "changed", "x_c": "h"}
    )
    assert run.shifted_functions(before, after) == ["gptspeed.step.x_a"]


def test_an_explanation_follows_its_mutant_when_mutmut_renumbers_it(tmp_path):
    """survivors.txt's lines are matched by function and by what the mutant changes (its
    fingerprint), not by mutmut's number: renumbered, a survivor keeps its explanation, and the
    line's old number, now another mutant's, does not explain that one; a line without a fingerprint
    matches by name; a line matching no survivor is listed for removal."""
    run = load_run_py(tmp_path)
    a = "--- a\n+++ b\n-    x = f(1)\n+    x = f(2)\n"
    b = "--- a\n+++ b\n-    y = g(0)\n+    y = g(None)\n"
    fa, fb = run.fingerprint(a), run.fingerprint(b)
    assert fa != fb and len(fa) == 8 and run.fingerprint("@@ 1 @@\n" + a) == fa  # only the -/+ lines count
    (tmp_path / "survivors.txt").write_text(
        f"# a comment\ngptspeed.m.x_f__mutmut_3 {fa} equivalent f(2) is f(1)\n"
        f"gptspeed.m.x_f__mutmut_9 {fb} gap g's None\ngptspeed.m.x_h__mutmut_1 equivalent by name\n"
    )
    run.HERE = tmp_path
    expl = run.load_explanations()
    assert expl["gptspeed.m.x_f__mutmut_3"] == ("equivalent", "f(2) is f(1)", fa)
    assert expl["gptspeed.m.x_h__mutmut_1"] == ("equivalent", "by name", None)
    found, unmatched = run.match_explanations(
        expl,
        {
            "gptspeed.m.x_f__mutmut_5": a,  # was 3: renumbered, same change
            "gptspeed.m.x_f__mutmut_3": b,  # number 3 is now g's mutant: explained by g's line, not f's
            "gptspeed.m.x_g__mutmut_1": a,  # the same change in another function: not explained
            "gptspeed.m.x_h__mutmut_1": "",
        },
    )
    assert found == {
        "gptspeed.m.x_f__mutmut_5": ("equivalent", "f(2) is f(1)"),
        "gptspeed.m.x_f__mutmut_3": ("gap", "g's None"),
        "gptspeed.m.x_h__mutmut_1": ("equivalent", "by name"),
    }
    found, unmatched = run.match_explanations(expl, {"gptspeed.m.x_f__mutmut_5": a})
    assert unmatched == ["gptspeed.m.x_f__mutmut_9", "gptspeed.m.x_h__mutmut_1"]

    # the same change on two identical lines: two mutants, two lines, one fingerprint; each keeps its own
    (tmp_path / "survivors.txt").write_text(
        f"gptspeed.m.x_f__mutmut_2 {fa} equivalent first line\ngptspeed.m.x_f__mutmut_7 {fa} equivalent second line\n"
    )
    found, unmatched = run.match_explanations(
        run.load_explanations(), {"gptspeed.m.x_f__mutmut_2": a, "gptspeed.m.x_f__mutmut_7": a}
    )
    assert (
        found
        == {
            "gptspeed.m.x_f__mutmut_2": ("equivalent", "first line"),
            "gptspeed.m.x_f__mutmut_7": ("equivalent", "second line"),
        }
        and unmatched == []
    )


def test_the_workdir_is_emptied_only_when_the_script_made_it(tmp_path, monkeypatch, capsys):
    """``--workdir DIR`` used to be deleted whatever it held (``--workdir ~``: a home folder). The
    script marks each folder it makes and empties only a marked one; any other is one line, untouched."""
    import sys

    import pytest

    run = load_run_py(tmp_path)
    theirs = tmp_path / "thesis"
    theirs.mkdir()
    (theirs / "chapter1.tex").write_text("years of work")
    a_file = tmp_path / "notes.txt"
    a_file.write_text("notes")
    for workdir in (theirs, a_file):
        monkeypatch.setattr(sys, "argv", ["run.py", "--workdir", str(workdir), "--report-only"])
        assert run.main() == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "Traceback" not in err and str(workdir) in err, err
        run.WORK = workdir
        with pytest.raises(run.WorkdirRefused):
            run.write_snapshot({"src/gptspeed/a.py": b"x = 1\n"}, fresh=True)
    assert (theirs / "chapter1.tex").read_text() == "years of work" and sorted(p.name for p in theirs.iterdir()) == [
        "chapter1.tex"
    ]
    assert a_file.read_text() == "notes"

    run.WORK = tmp_path / "made"  # a folder the script makes is its own: a fresh run empties it, marker kept
    run.write_snapshot({"src/gptspeed/a.py": b"x = 1\n"}, fresh=True)
    (run.WORK / "mutants").mkdir()
    run.write_snapshot({"src/gptspeed/b.py": b"y = 1\n"}, fresh=True)
    assert sorted(p.name for p in run.WORK.iterdir()) == [".gitignore", run.MARKER, "src"]
    assert not (run.WORK / "src/gptspeed/a.py").exists()
    empty = tmp_path / "empty"  # an empty folder loses nothing: taken
    empty.mkdir()
    run.WORK = empty
    run.write_snapshot({"src/gptspeed/a.py": b"x = 1\n"}, fresh=True)
    assert (empty / run.MARKER).is_file() and (empty / "src/gptspeed/a.py").is_file()


def test_survivors_are_retested_with_the_timeouts_and_only_those_a_mutant_pattern_names(tmp_path):
    """``--survivors`` retests what survived or timed out (not the killed, nor those without tests);
    ``--mutant GLOB`` (repeatable) narrows that to the names a pattern matches."""
    run = load_run_py(tmp_path)
    results = {
        "gptspeed.optim.x_a__mutmut_1": "survived",
        "gptspeed.optim.x_a__mutmut_2": "killed",
        "gptspeed.optim.x_b__mutmut_1": "timeout",
        "gptspeed.model.x_c__mutmut_3": "survived",
        "gptspeed.model.x_c__mutmut_4": "no tests",
    }
    assert run.to_retest(results, []) == [
        "gptspeed.model.x_c__mutmut_3",
        "gptspeed.optim.x_a__mutmut_1",
        "gptspeed.optim.x_b__mutmut_1",
    ]
    assert run.to_retest(results, ["gptspeed.optim.*"]) == [
        "gptspeed.optim.x_a__mutmut_1",
        "gptspeed.optim.x_b__mutmut_1",
    ]
    assert run.to_retest(results, ["*x_c__mutmut_3", "*x_b*"]) == [
        "gptspeed.model.x_c__mutmut_3",
        "gptspeed.optim.x_b__mutmut_1",
    ]
    assert run.to_retest(results, ["gptspeed.loss.*"]) == []

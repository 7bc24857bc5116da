"""``gptspeed.bench.cli``: ``gptspeed bench ladder | verify | profile | race | tune``, each subcommand's flags
made of its configuration dataclass, and the old ``bench --race`` spelling for one more release."""

from __future__ import annotations

import dataclasses
import re

import pytest

from gptspeed import cli
from gptspeed.bench import cli as bench_cli

from support.cli import run_cli, run_main
from support.shapes import BENCH_MODEL_FLAGS

MODES = ("ladder", "verify", "profile", "race", "tune")


def _help_flags(text: str) -> set[str]:
    """The options ``--help`` lists (each at the start of its entry), not those its texts mention."""
    return set(re.findall(r"^  (--[a-z][a-z0-9-]*)", text, re.M)) - {"--help"}


def _declared_flags(cls) -> set[str]:
    return {
        f.metadata.get("flag") or "--" + f.name.replace("_", "-")
        for f in dataclasses.fields(cls)
        if "help" in f.metadata and f.metadata.get("cli", True) and not f.metadata.get("positional")
    }


def test_bench_help_lists_the_five_subcommands():
    proc = run_main("bench", "--help")
    assert proc.returncode == 0
    assert "{ladder,verify,profile,race,tune}" in proc.stdout
    for mode in MODES:
        assert re.search(rf"^\s+{mode}\s+\S", proc.stdout, re.M), mode


@pytest.mark.parametrize("mode", MODES)
def test_each_subcommands_help_shows_its_dataclasss_flags_and_no_other(mode):
    """A subcommand's --help is its configuration's fields: race's has its arms and seeds but not the
    ladder's shape, stages or peers; the ladder's has no race or tune flag."""
    proc = run_main("bench", mode, "--help")
    assert proc.returncode == 0
    cls = bench_cli._modes()[mode][0]
    assert _help_flags(proc.stdout) == _declared_flags(cls)
    if mode == "race":
        assert {"--arms", "--arm", "--seeds", "--run-timeout"} <= _help_flags(proc.stdout)
        assert not {"--n-layer", "--stages", "--no-peers", "--synthetic", "--flags"} & _help_flags(proc.stdout)
    if mode == "ladder":
        assert not {"--arms", "--seeds", "--force", "--flags", "--budget-s"} & _help_flags(proc.stdout)


@pytest.mark.parametrize(
    "args, refused",
    [
        (["race", "--arms", "gpt2", "--n-layer", "4"], "--n-layer 4"),
        (["race", "--arms", "gpt2", "--stages", "all"], "--stages all"),
        (["tune", *BENCH_MODEL_FLAGS, "--no-peers"], "--no-peers"),
        (["profile", "baseline", *BENCH_MODEL_FLAGS, "--stages", "baseline"], "--stages baseline"),
        (["verify", *BENCH_MODEL_FLAGS, "--seeds", "2"], "--seeds 2"),
    ],
)
def test_a_flag_of_another_subcommand_is_refused_by_argparse_in_one_line(args, refused, tmp_path):
    proc = run_cli("bench", *args, "--out", str(tmp_path / "o"), "--device", "cpu")
    assert proc.returncode == 2
    assert proc.stderr.count("\n") == 1 and "Traceback" not in proc.stderr
    assert f"unrecognized arguments: {refused}" in proc.stderr
    assert not (tmp_path / "o").exists()


def _record_runs(monkeypatch) -> list:
    """Every bench function a subcommand ends in, replaced by one that records the configuration it got."""
    from gptspeed.bench import ladder, race, tune, verify

    got = []
    monkeypatch.setattr(ladder, "run_ladder", lambda cfg, command="": got.append(cfg) or {"ok": True})
    monkeypatch.setattr(ladder, "profile_stage", lambda cfg: got.append(cfg) or {})
    monkeypatch.setattr(
        verify, "run_verify", lambda cfg, command="": got.append(cfg) or {"failing": [], "not_verified": []}
    )
    monkeypatch.setattr(race, "run_race", lambda cfg, command="": got.append(cfg) or {})
    monkeypatch.setattr(
        tune,
        "run_tune",
        lambda cfg, command="": got.append(cfg) or {"best_flags": "", "tuned_yaml": "t", "train_command": "c"},
    )
    return got


@pytest.mark.parametrize(
    "old, new",
    [
        (["--ladder"], ["ladder"]),
        (["--verify"], ["verify"]),
        (["--profile", "compile"], ["profile", "compile"]),
        (["--profile=compile"], ["profile", "compile"]),
        (["--tune"], ["tune"]),
        (["--race", "--arms", "gpt2"], ["race", "--arms", "gpt2"]),
    ],
)
def test_the_old_spelling_runs_the_new_subcommand_with_one_line_naming_it(old, new, tmp_path, monkeypatch, capsys):
    """``bench --race ...`` (the release before's spelling) reaches the same function with the same
    configuration as ``bench race ...``, and says once, on stderr, what to type instead."""
    got = _record_runs(monkeypatch)
    rest = ["--out", str(tmp_path / "o"), "--device", "cpu", "--preset", "pico"]
    if new[0] != "race":
        rest += ["--seq-len", "32", "--synthetic", "--warmup", "2"]
    assert cli.main(["bench", *new, *rest]) == 0
    assert capsys.readouterr().err == ""
    assert cli.main(["bench", *rest[:2], *old, *rest[2:]]) == 0  # the mode flag anywhere, as before
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("note: `bench --")
    assert f"is now `gptspeed bench {new[0]}" in err and "the old spelling goes in the next release" in err
    assert len(got) == 2 and type(got[0]) is type(got[1]) is bench_cli._modes()[new[0]][0]
    if new[0] == "race":  # arms carry the runs they will hold: compare what was asked
        got = [dataclasses.replace(g, arms=[a.name for a in g.arms]) for g in got]
    assert got[0] == got[1]


def test_two_modes_in_the_old_spelling_are_one_usage_error(capsys):
    with pytest.raises(SystemExit) as e:
        bench_cli.new_spelling(["bench", "--race", "--out", "o", "--verify"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--race and --verify: give one mode" in err


def test_new_spelling_leaves_other_commands_and_the_new_spelling_alone(capsys):
    for argv in (["train", "--race"], ["bench", "race", "--out", "o"], ["bench", "--help"], ["bench"]):
        assert bench_cli.new_spelling(list(argv)) == argv
    assert bench_cli.new_spelling(["bench", "--out", "o", "--profile", "fp8", "--synthetic"]) == [
        "bench",
        "profile",
        "fp8",
        "--out",
        "o",
        "--synthetic",
    ]
    assert capsys.readouterr().err.count("\n") == 1


def test_bench_flags_without_a_subcommand_ask_for_one(capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["bench", "--out", "o", "--synthetic"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "choose a subcommand: ladder, verify, profile, race or tune" in err


@pytest.mark.parametrize("mode", MODES)
def test_a_flag_not_given_is_its_fields_default(mode, tmp_path, monkeypatch):
    """The configuration a subcommand runs with holds each field's declared default where no flag was given
    (the parser repeats no default); --preset left out is the subcommand's own (gpt2; tune: your --config's)."""
    got = _record_runs(monkeypatch)
    args = {"profile": ["profile", "baseline"], "race": ["race", "--arms", "gpt2"]}.get(mode, [mode])
    data = [] if mode == "race" else ["--synthetic"]
    assert cli.main(["bench", *args, "--out", str(tmp_path / "o"), *data]) == 0
    (cfg,) = got
    for f in dataclasses.fields(cfg):
        if f.name in ("out", "stage", "arms", "recipes", "run", "synthetic", "preset"):
            continue
        assert getattr(cfg, f.name) == f.default, f.name
    assert cfg.preset == ("gpt2" if mode != "tune" else None)
    if mode == "tune":
        assert cfg.run.preset == "gpt2" and cfg.data is None

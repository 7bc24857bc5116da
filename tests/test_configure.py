"""``gptspeed.configure``: the configuration a ``gptspeed train`` runs with: a preset, a config file and the flags -- or, with ``--resume``, the run folder's own (its newest valid checkpoint's), then the file and flags."""

from __future__ import annotations

import json

import pytest

from gptspeed.config import AUTO_BATCH_SIZE, PRESETS, config_to_yaml, preset
from gptspeed.configure import build_train_config
from gptspeed.errors import GptspeedError

from support.cli import assert_user_error, run_cli, run_main

pytestmark = pytest.mark.usefixtures("one_thread")


def test_yaml_values_are_typed_like_json(tmp_path):
    """YAML 1.2 floats (1e-3, which PyYAML alone reads as a string), null, booleans, `auto` for
    the batch size, nested groups or flat keys; the file's preset is the base unless --preset is
    given; flags win over the file."""
    path = tmp_path / "run.yml"
    path.write_text(
        "preset: nano\nlr: 1e-3\noptim:\n  warmup_ratio: .05\n  fused_adamw: no\n"
        "train:\n  batch_size: auto\n  total_batch_tokens: 4096\nruntime:\n  compile: null\n"
    )
    cfg = build_train_config(None, {"max_steps": 7}, str(path))
    assert cfg.preset == "nano" and cfg.model.n_layer == 4  # nano's shape
    assert cfg.optim.lr == 1e-3 and isinstance(cfg.optim.lr, float) and cfg.optim.warmup_ratio == 0.05
    assert cfg.optim.fused_adamw is False and cfg.runtime.compile is None
    assert cfg.train.batch_size == AUTO_BATCH_SIZE and cfg.train.max_steps == 7
    assert build_train_config("pico", {}, str(path)).model.n_layer == 2  # --preset wins over the file's
    # --print-config's YAML reads back to the same configuration, `auto` included
    printed = tmp_path / "printed.yaml"
    printed.write_text(config_to_yaml(cfg))
    assert "batch_size: auto" in printed.read_text()
    assert build_train_config(None, {}, str(printed)) == cfg


@pytest.mark.parametrize(
    "text, fragments",
    [
        ("model:\n  n_layr: 3\n", ["unknown setting 'n_layr'", "did you mean 'n_layer'"]),
        ("seq_len: 32\n", ["unknown setting 'seq_len'", "did you mean 'block_size'"]),  # the flag's name
        ("modle:\n  n_layer: 3\n", ["unknown setting 'modle'"]),
        ("lr: fast\n", ["lr must be float, got 'fast'"]),
        ("optimizer: adam\n", ["optimizer must be one of adamw, muon"]),
        ("model: 4\n", ["'model' must be a mapping of settings"]),
        ("lr: 1\nmodel: {n_layer: 3\n", ["is not valid YAML", "(line 3, column 1)"]),
        ("- lr: 1\n", ["expected a YAML mapping of settings, got list"]),
        ("preset: nanno\n", ["unknown preset 'nanno'", "did you mean 'nano'"]),
        ("log_to: tensorbord\n", ["--log-to: unknown tracker 'tensorbord'", "did you mean 'tensorboard'"]),
    ],
)
def test_bad_yaml_is_one_line(tmp_path, text, fragments):
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    with pytest.raises(GptspeedError) as err:
        build_train_config(None, {}, str(path)).validate()
    message = str(err.value)
    assert "\n" not in message
    for f in fragments:
        assert f in message, message


def test_a_configuration_is_validated_where_it_is_built_for_the_launched_world(monkeypatch):
    """build_train_config validates once, for the processes torchrun's environment names: a global
    batch that 3 processes cannot share is refused there, before any training code runs."""
    flags = {"total_batch_tokens": 2 * 8 * 64, "batch_size": 8, "data": "d", "out": "o"}
    assert build_train_config("pico", flags).grad_accum_steps(1) == 2
    monkeypatch.setenv("WORLD_SIZE", "3")
    monkeypatch.setenv("RANK", "2")
    with pytest.raises(GptspeedError, match="not a multiple of batch_size"):
        build_train_config("pico", flags)
    with pytest.raises(GptspeedError, match="--max-steps must be at least 1"):
        build_train_config("pico", {"max_steps": 0})


@pytest.mark.parametrize("n_embd,n_head", [(6, 2), (4, 4)])
def test_rope_on_an_odd_head_dimension_is_one_line(tmp_path, n_embd, n_head):
    """Head dimension 3 trained silently with queries and keys grown to 4 channels (the rotation
    broadcast its odd half); 1 was a ValueError traceback from the first forward."""
    head = n_embd // n_head
    with pytest.raises(GptspeedError, match=f"n_embd / n_head = {n_embd} / {n_head} = {head} must be even"):
        build_train_config("pico", dict(pos_emb="rope", n_embd=n_embd, n_head=n_head, out=str(tmp_path / "r")))
    res = run_main(
        "train",
        "--preset",
        "pico",
        "--pos-emb",
        "rope",
        "--n-embd",
        str(n_embd),
        "--n-head",
        str(n_head),
        "--out",
        str(tmp_path / "r"),
    )
    assert_user_error(res, "--pos-emb rope rotates pairs of channels")
    for name in PRESETS:  # every preset's shape takes rope
        cfg = preset(name)
        cfg.model.pos_emb = "rope"
        cfg.model.validate()


def test_config_file_applies_and_flags_win(tmp_path):
    path = tmp_path / "c.json"
    path.write_text(json.dumps({"model": {"n_layer": 3}, "lr": 0.01}))
    cfg = build_train_config("pico", {"lr": 0.02}, str(path))
    assert cfg.model.n_layer == 3 and cfg.optim.lr == 0.02
    path.write_text("{not json")
    assert_user_error(
        run_cli("train", "--config", str(path), "--data", "x", "--out", str(tmp_path / "r")), "not valid JSON"
    )


@pytest.mark.parametrize("nested", [False, True], ids=["flat", "nested"])
def test_a_setting_the_file_or_a_flag_gives_replaces_the_recipes_relative_one(tmp_path, nested):
    """``--recipe speedrun`` declares its warm-up as a share of the steps and its rates as multiples of ``--lr``:
    ``--warmup-steps`` or ``--embed-lr`` from a config file (flat or nested) or a flag is what the run uses, not the
    recipe's ratio (which would replace it); the settings nobody gave stay the recipe's."""
    settings = {"warmup_steps": 9, "scalar_lr": 0.5}
    file = tmp_path / "run.json"
    file.write_text(json.dumps({"optim": settings} if nested else settings))
    cfg = build_train_config("pico", {"embed_lr": 0.25}, str(file), recipe_name="speedrun")
    assert (cfg.warmup_steps(), cfg.optim.group_lr("embed"), cfg.optim.group_lr("scalar")) == (9, 0.25, 0.5)
    plain = build_train_config("pico", {}, recipe_name="speedrun")
    assert plain.warmup_steps() == 1 and plain.optim.group_lr("embed") == pytest.approx(3e-3)  # 2% of 50; 3x 1e-3


def _started_run(folder, cfg) -> None:
    """A run killed before its first checkpoint: the config.json it wrote at its start."""
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({**cfg.to_dict(), "derived": {"run_id": "r1"}}))


def test_a_recipe_on_the_resume_of_a_run_not_trained_with_it_is_refused_unless_forced(tmp_path):
    """`--recipe gpt2` on the resume of a modern run was ignored silently (the recipe was applied over the
    run's own settings, and gpt2's sets none): a recipe on a resume must describe the run -- every setting a
    recipe sets, as this one (or the preset) has it -- or it is one line naming what would change;
    --force-resume applies it. The recipe the run was trained with, and a flag that replaces the setting,
    are fine."""
    modern = tmp_path / "modern"
    _started_run(modern, build_train_config("pico", {}, recipe_name="modern"))
    resume = {"out": str(modern), "resume": True}
    with pytest.raises(GptspeedError) as e:
        build_train_config(None, resume, recipe_name="gpt2")
    assert str(e.value) == (
        f"--recipe gpt2 with --resume: {modern} was not trained with it (decay_ratio, lr_schedule, mlp, norm, "
        "optimizer, pos_emb, qk_norm would change): drop --recipe, or pass --force-resume to change the run"
    )
    assert build_train_config(None, resume, recipe_name="modern").model.pos_emb == "rope"
    with pytest.raises(GptspeedError, match=r"--recipe speedrun with --resume: .* \(embed_lr_ratio, scalar_lr_ratio, "):
        build_train_config(None, resume, recipe_name="speedrun")
    forced = build_train_config(None, {**resume, "force_resume": True}, recipe_name="gpt2")
    assert (forced.model.pos_emb, forced.optim.optimizer, forced.model.norm) == ("learned", "adamw", "layernorm")
    plain = tmp_path / "plain"
    _started_run(plain, build_train_config("pico", {}))
    with pytest.raises(GptspeedError, match="--recipe modern with --resume: "):
        build_train_config(None, {"out": str(plain), "resume": True}, recipe_name="modern")
    assert build_train_config(None, {"out": str(plain), "resume": True}, recipe_name="gpt2").model.pos_emb == "learned"


def test_a_config_files_preset_on_a_resume_must_be_the_runs(tmp_path):
    """A config file's ``preset:`` on a resume was ignored silently (the run's own configuration is the
    base), as --preset is refused when it names another preset: one line; the run's own preset is fine."""
    run = tmp_path / "run"
    _started_run(run, build_train_config("pico", {}))
    file = tmp_path / "nano.yaml"
    file.write_text("preset: nano\n")
    with pytest.raises(GptspeedError) as e:
        build_train_config(None, {"out": str(run), "resume": True}, str(file))
    assert str(e.value) == (
        f"config file {file}'s preset 'nano' with --resume: {run} is a pico run; drop the file's preset: line"
    )
    file.write_text("preset: pico\nmax_steps: 9\n")
    assert build_train_config(None, {"out": str(run), "resume": True}, str(file)).train.max_steps == 9


def test_any_dataclass_becomes_flags_from_its_fields_declarations():
    """add_dataclass_flags: a field's flag, type, choices and default come from its _f declaration; a
    field without a default is a required flag; kind off / append, positional and exclusive groups as
    declared; cli=False and undeclared fields make no flag."""
    import argparse
    import dataclasses

    from gptspeed.config import _f
    from gptspeed.configure import add_dataclass_flags, dataclass_values

    @dataclasses.dataclass(kw_only=True)
    class Options:
        out: str = _f(dataclasses.MISSING, "folder")
        steps: int = _f(20, "steps")
        mode: str = _f("a", "mode", choices=("a", "b"))
        timeout_s: float | None = _f(None, "seconds", flag="--run-timeout")
        peers: bool = _f(True, "no peers", flag="--no-peers", kind="off")
        arm: list[str] | None = _f(None, "an arm", kind="append")
        data: str | None = _f(None, "data", exclusive="source")
        synthetic: bool = _f(False, "synthetic", kind="flag", exclusive="source")
        stage: str = _f("x", "the stage", positional=True)
        hidden: int = _f(0, "not a flag", cli=False)
        plain: int = 0

    p = argparse.ArgumentParser(exit_on_error=False)
    add_dataclass_flags(p, Options)
    a = p.parse_args(
        ["s", "--out", "o", "--steps", "3", "--run-timeout", "1.5", "--no-peers", "--arm", "x", "--arm", "y"]
    )
    assert Options(**dataclass_values(Options, a)) == Options(
        out="o", steps=3, timeout_s=1.5, peers=False, arm=["x", "y"], stage="s"
    )
    assert dataclass_values(Options, p.parse_args(["s", "--out", "o"])) == {
        "out": "o",
        "steps": 20,
        "mode": "a",
        "timeout_s": None,
        "peers": True,
        "arm": None,
        "data": None,
        "synthetic": False,
        "stage": "s",
    }
    for argv in (["s"], ["s", "--out", "o", "--mode", "c"], ["s", "--out", "o", "--data", "d", "--synthetic"]):
        with pytest.raises((argparse.ArgumentError, SystemExit)):
            p.parse_args(argv)
    assert "--hidden" not in p.format_help() and "--plain" not in p.format_help()

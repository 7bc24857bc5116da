"""The configuration a ``gptspeed train`` runs with: a preset, a config file and the flags -- or,
with ``--resume``, the run folder's own (its newest valid checkpoint's), then the file and flags.

Above :mod:`gptspeed.config` (dataclasses, presets, validation; imports nothing of gptspeed's but
its errors) and :mod:`gptspeed.checkpoint` (the run folder), so neither imports the other's
callers. Imports no torch unless ``--init-from`` names a Hugging Face model.
"""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path
from typing import Any

from gptspeed.checkpoint import list_checkpoints, newest_run_config, started_run
from gptspeed.config import (
    PRESETS,
    RECIPE_YIELDS,
    RunConfig,
    changed_settings,
    did_you_mean,
    drop_inert,
    expand_path_setting,
    preset,
    read_config_file,
    recipe,
)
from gptspeed.errors import GptspeedError
from gptspeed.paths import real_path
from gptspeed.run_tokenizer import fit_model_to_data

__all__ = [
    "build_train_config",
    "add_train_arguments",
    "add_dataclass_flags",
    "dataclass_values",
    "config_from_arguments",
    "config_from_flags",
]


def build_train_config(
    preset_name: str | None, overrides: dict[str, Any], config_file: str | None = None, recipe_name: str | None = None
) -> RunConfig:
    """The configuration ``gptspeed train`` runs with.

    Fresh run: the preset (``preset_name``, else the config file's ``preset:``, else ``gpt2``),
    then ``recipe_name``'s settings (:data:`gptspeed.config.RECIPES`: ``modern``, ...), then
    ``config_file`` (YAML or JSON, :func:`read_config_file`), then ``overrides`` (flat field
    names, the flags given). With ``resume`` and a valid checkpoint in ``out``, the checkpoint's
    configuration (read from its seal, without loading it) is the base instead, so
    ``gptspeed train --out RUN --resume`` alone continues a run; with ``resume``, no checkpoint
    and the ``config.json`` a run wrote when it started there (a run killed before its first
    checkpoint: :func:`gptspeed.checkpoint.started_run`), that configuration is the base, and the
    run restarts from step 0 as itself. A config file and flags given still apply on top.

    Raises:
        GptspeedError: an unknown preset, an unreadable config file or a bad setting in it, or
            ``--preset`` naming another preset than the run being resumed, or a configuration
            that does not validate (:meth:`RunConfig.validate`).
    """
    out = expand_path_setting("out", overrides.get("out"))  # as cfg.override will set it
    if out and ".." in Path(out).parts:  # new/../victim: the folder the system will write, checked as such
        overrides = {**overrides, "out": str(real_path(out))}
        out = overrides["out"]
    path, cfg = _resume_base(out, overrides, preset_name, config_file)
    resumed = out if cfg is not None else None  # a run's own configuration is the base
    if cfg is None:
        if preset_name is None and config_file:
            named = read_config_file(config_file).get("preset")
            if named is not None and not isinstance(named, str):
                raise GptspeedError(f"config file {config_file}: preset must be a string, got {named!r}"[:300])
            if named is not None and named not in PRESETS and named != "custom":  # custom: an imported model's
                raise GptspeedError(
                    f"config file {config_file}: unknown preset {named!r}: choose one of "
                    f"{', '.join(PRESETS)}{did_you_mean(named, list(PRESETS))}"
                )
            preset_name = named
        cfg = preset("gpt2" if preset_name in (None, "custom") else preset_name)
        if preset_name == "custom":
            cfg.preset = preset_name
    base, from_recipe, given = cfg, {}, set(overrides)  # given: what the user set (config.check_companions)
    if recipe_name:  # less what the file and flags replace (config.RECIPE_YIELDS)
        named = read_config_file(config_file) if config_file else {}
        inner = {k for v in named.values() if isinstance(v, dict) for k in v}
        names = set(overrides) | set(named) | inner
        from_recipe = recipe(recipe_name, names)
        cfg = _apply_recipe(cfg, recipe_name, names, resumed, overrides)
    if config_file:
        before, cfg = cfg, cfg.apply_file(config_file)
        given |= changed_settings(before, cfg)  # a --print-config file's unchanged values are not the user's
    cfg = drop_inert(cfg.override(overrides), set(from_recipe) - given, base)  # a recipe's setting made inert
    cfg = fit_model_to_data(cfg, given, resumed is not None)  # the vocabulary and <|endoftext|> of the data
    if cfg.train.out and ".." in Path(cfg.train.out).parts:  # from a config file
        cfg.train.out = str(real_path(cfg.train.out))
    if cfg.train.init_from and path is None:  # the model shape is the pretrained model's
        from gptspeed.hf.load import shape_for_init_from

        cfg.model = shape_for_init_from(cfg.train.init_from, cfg.model, overrides)
    cfg.validate(given=given)  # once, here, for the processes torchrun's environment names
    return cfg


def _resume_base(
    out: str | None, overrides: dict[str, Any], preset_name: str | None, config_file: str | None
) -> tuple[Path | None, RunConfig | None]:
    """With ``resume``: the newest valid checkpoint of ``out`` and its configuration, or -- a run
    killed before its first checkpoint -- ``(None, the configuration its config.json recorded)``;
    ``(None, None)`` for a new run. GptspeedError when ``--preset`` or the config file's ``preset:``
    names another preset than the run's (a run keeps its preset: it would be ignored)."""
    path, cfg = newest_run_config(Path(out)) if overrides.get("resume") and out else (None, None)
    if path is None and overrides.get("resume") and out and not list_checkpoints(Path(out)):
        # killed before its first checkpoint: the run restarts as itself, from the config.json it wrote
        # at its start (a folder whose checkpoints all failed their check is refused by the resume)
        started = started_run(Path(out))
        cfg = started[0] if started is not None else None
    if cfg is not None:
        named = read_config_file(config_file).get("preset") if config_file else None
        for given, what, drop in (
            (preset_name, f"--preset {preset_name}", "--preset"),
            (named, f"config file {config_file}'s preset {named!r}", "the file's preset: line"),
        ):
            if given is not None and given != cfg.preset:
                raise GptspeedError(f"{what} with --resume: {out} is a {cfg.preset} run; drop {drop}"[:400])
    return path, cfg


def _apply_recipe(
    cfg: RunConfig, name: str, given: set[str], resumed: str | None, overrides: dict[str, Any]
) -> RunConfig:
    """``cfg`` with recipe ``name``'s settings applied, less those ``given`` replaces. A new run takes
    them on top of its preset. A resumed run (``resumed``: its folder) keeps the settings it started
    with, so a recipe there must describe it: every setting any recipe sets (:data:`RECIPES`) takes
    this recipe's value, or the preset's where the recipe leaves it (``gpt2`` is the presets' own
    architecture); one that differs from the run's is refused in one line naming the recipe and the
    settings, unless ``--force-resume`` (then they are applied, and the resume says what changed)."""
    from gptspeed.config import RECIPES

    chosen = recipe(name, given)
    if resumed is None:
        return cfg.override(chosen)
    base = preset(cfg.preset if cfg.preset in PRESETS else "gpt2").to_dict()
    flat = {k: v for group in base.values() if isinstance(group, dict) for k, v in group.items()}
    keys = sorted({k for r in RECIPES.values() for k in r} - given)
    full = {k: chosen.get(k, flat[k]) for k in keys if k in chosen or k in flat}
    full = {k: v for k, v in full.items() if k in chosen or RECIPE_YIELDS.get(k) not in given}
    now = {k: v for group in cfg.to_dict().values() if isinstance(group, dict) for k, v in group.items()}
    changed = [k for k, v in full.items() if now.get(k) != v]
    if changed and not overrides.get("force_resume"):
        raise GptspeedError(
            f"--recipe {name} with --resume: {resumed} was not trained with it ({', '.join(changed)} would change): "
            "drop --recipe, or pass --force-resume to change the run"
        )
    return cfg.override(full)


# ------------------------------------------------------------------------------- train's arguments
def add_train_arguments(s: argparse.ArgumentParser) -> None:
    """``gptspeed train``'s arguments on ``s``: --preset, --recipe, --config, --print-config and a flag
    per setting (:func:`add_setting_flags`)."""
    from gptspeed.config import PRESETS

    s.description = (
        "Flags override the preset; with --resume, the run's own configuration. The defaults shown "
        "are the gpt2 preset's; the other presets set their own shape, lr, batch and steps (docs/settings.md, "
        "Presets)."
    )
    s.add_argument(
        "--preset",
        choices=list(PRESETS),
        default=None,
        help="model shape and training defaults (default gpt2; pico and nano are CPU-sized)",
    )
    s.add_argument("--recipe", default=None, metavar="NAME", help=recipe_help())
    s.add_argument(
        "--config",
        dest="config_file",
        default=None,
        help="YAML (or .json) file of settings, flat or nested like --print-config's output (its "
        "preset: is the base when --preset is not given), applied before flags",
    )
    s.add_argument(
        "--print-config",
        action="store_true",
        help="print the resolved configuration (preset, --config file, flags) as YAML and exit: "
        "a file that --config turns back into the same run",
    )
    add_setting_flags(s)


def recipe_help() -> str:
    """``--recipe``'s help, written from :data:`gptspeed.config.RECIPES` itself (each recipe's flags),
    so it cannot name a switch the recipe does not set."""
    from gptspeed.config import RECIPES, setting_flag

    def flags(settings: dict[str, Any]) -> str:
        return " ".join(setting_flag(k) if v is True else f"{setting_flag(k)} {v}" for k, v in settings.items())

    named = " | ".join(f"{name} ({flags(settings) or 'as the presets'})" for name, settings in RECIPES.items())
    return f"a named set of settings on top of the preset, before --config and flags: {named}"


def add_setting_flags(p: argparse.ArgumentParser) -> None:
    """Every setting of the configuration dataclasses as a flag, from what its field declares
    (:func:`gptspeed.config._f`: flag, help, choices, kind), one argument group per dataclass. A flag
    not given sets nothing (``argparse.SUPPRESS``): the preset, recipe and config file fill it."""
    from gptspeed.config import GROUPS

    titles = {"model": "model (override the preset)", "optim": "optimizer", "train": "training", "runtime": "runtime"}
    for group, cls in GROUPS.items():
        add_dataclass_flags(p.add_argument_group(titles[group]), cls, given_only=True, show_default=group != "model")


def add_dataclass_flags(
    p: argparse.ArgumentParser | argparse._ArgumentGroup,
    cls: type,
    *,
    given_only: bool = False,
    show_default: bool = False,
) -> None:
    """A flag for every field of dataclass ``cls`` declared with :func:`gptspeed.config._f` (but those
    declared ``cli=False``), on ``p``, its ``dest`` the field's name (so :func:`dataclass_values` of the
    parsed arguments are keyword arguments of ``cls``). What the field's metadata declares: ``flag``
    (default ``--`` + the name with dashes), ``help``, ``choices``, ``kind`` (``flag``: store_true;
    ``bool``: ``--x`` / ``--no-x``; ``off``: store_false under the declared flag, e.g. ``--no-peers``;
    ``append``: repeatable; ``list``: one or more values), ``parse`` (``batch_size``: a number or ``auto``; ``seed``:
    :func:`gptspeed.config.parse_seed`), ``positional``, ``metavar`` and ``exclusive`` (the fields naming
    the same key are one mutually exclusive group). A field without a default is a required flag.

    ``given_only``: a flag not given sets nothing (``train``'s: the preset fills it); else it sets the
    field's default, which ``--help`` shows (:class:`gptspeed.cli._DefaultsFormatter`). ``show_default``:
    the default appended to the help here (with ``given_only``, where argparse cannot show it)."""
    from gptspeed.config import field_type, parse_batch_size, parse_seed

    parsers = {"batch_size": parse_batch_size, "seed": parse_seed}
    groups: dict[str, Any] = {}
    for f in dataclasses.fields(cls):
        meta = f.metadata
        if "help" not in meta or not meta.get("cli", True):
            continue
        kind = meta.get("kind")
        required = f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
        shown = "" if not show_default or f.default in (None, "", False) or required else f" (default: {f.default})"
        kw: dict[str, Any] = dict(help=(meta["help"] + shown).replace("%", "%%"))  # argparse %-formats help
        if not meta.get("positional"):
            kw.update(dest=f.name, default=argparse.SUPPRESS if given_only or required else f.default)
            if required:
                kw["required"] = True
        if "metavar" in meta:
            kw["metavar"] = meta["metavar"]
        if kind == "flag":
            kw["action"] = "store_true"
        elif kind == "off":
            kw["action"] = "store_false"
        elif kind == "bool":
            kw["action"] = argparse.BooleanOptionalAction
        elif kind == "append":
            kw["action"] = "append"
        elif kind == "list":
            kw["nargs"] = "+"
        else:
            kw.update(type=parsers.get(meta.get("parse")) or field_type(cls, f.name), choices=meta.get("choices"))
        target = p
        if meta.get("exclusive"):
            if meta["exclusive"] not in groups:
                groups[meta["exclusive"]] = p.add_mutually_exclusive_group()
            target = groups[meta["exclusive"]]
        name = f.name if meta.get("positional") else meta.get("flag") or "--" + f.name.replace("_", "-")
        target.add_argument(name, **kw)


def dataclass_values(cls: type, a: argparse.Namespace) -> dict[str, Any]:
    """The parsed values of :func:`add_dataclass_flags`' flags of ``cls``, by field name: the keyword
    arguments that make a ``cls`` of the command line."""
    return {f.name: getattr(a, f.name) for f in dataclasses.fields(cls) if hasattr(a, f.name)}


def config_from_arguments(a: argparse.Namespace) -> RunConfig:
    """The configuration of parsed ``gptspeed train`` arguments (:func:`add_train_arguments`):
    :func:`build_train_config` of the preset, recipe, config file and the flags given."""
    overrides = {
        k: v for k, v in vars(a).items() if k not in ("command", "preset", "config_file", "print_config", "recipe")
    }
    return build_train_config(a.preset, overrides, a.config_file, a.recipe)


def config_from_flags(flags: list[str], source: str, shown: list[str] | None = None) -> RunConfig:
    """The configuration ``gptspeed train FLAGS`` would run (validated), for the commands that take a
    training run's flags (``bench race``'s arms, ``bench tune``'s run). GptspeedError (one line,
    naming ``source`` and the flags ``shown``, default all) for flags ``train`` does not take, or a
    configuration it refuses."""
    import contextlib
    import io
    import shlex

    class Parser(argparse.ArgumentParser):
        def error(self, message):
            raise GptspeedError(
                f"{source}: {shlex.join(flags if shown is None else shown)!r} are not gptspeed train flags ({message})"
            )

    parser = Parser(prog="gptspeed train", add_help=False)
    add_train_arguments(parser)
    with contextlib.redirect_stderr(io.StringIO()):
        return config_from_arguments(parser.parse_args(flags))

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
from gptspeed.config import PRESETS, RunConfig, did_you_mean, expand_path_setting, preset, read_config_file, recipe
from gptspeed.errors import GptspeedError

__all__ = ["build_train_config", "add_train_arguments", "config_from_arguments", "config_from_flags"]


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
    path, cfg = newest_run_config(Path(out)) if overrides.get("resume") and out else (None, None)
    if path is None and overrides.get("resume") and out and not list_checkpoints(Path(out)):
        # killed before its first checkpoint: the run restarts as itself, from the config.json it wrote
        # at its start (a folder whose checkpoints all failed their check is refused by the resume)
        started = started_run(Path(out))
        cfg = started[0] if started is not None else None
    if cfg is not None:
        if preset_name is not None and preset_name != cfg.preset:
            raise GptspeedError(f"--preset {preset_name} with --resume: {out} is a {cfg.preset} run; drop --preset")
    else:
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
    if recipe_name:  # less what the file and flags replace (config.RECIPE_YIELDS)
        named = read_config_file(config_file) if config_file else {}
        inner = {k for v in named.values() if isinstance(v, dict) for k in v}
        cfg = cfg.override(recipe(recipe_name, set(overrides) | set(named) | inner))
    if config_file:
        cfg = cfg.apply_file(config_file)
    cfg = cfg.override(overrides)
    if cfg.train.init_from and path is None:  # the model shape is the pretrained model's
        from gptspeed.hf.load import shape_for_init_from

        cfg.model = shape_for_init_from(cfg.train.init_from, cfg.model, overrides)
    cfg.validate()  # once, here, for the processes torchrun's environment names
    return cfg


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
    (:func:`gptspeed.config._f`: flag, help, choices, kind), one argument group per dataclass."""
    from gptspeed.config import GROUPS, field_type, parse_batch_size, setting_flag

    titles = {"model": "model (override the preset)", "optim": "optimizer", "train": "training", "runtime": "runtime"}
    for group, cls in GROUPS.items():
        g = p.add_argument_group(titles[group])
        for f in dataclasses.fields(cls):
            meta = f.metadata
            if not meta.get("cli", True):
                continue
            kind = meta.get("kind")
            shown = "" if f.default in (None, "", False) or group == "model" else f" (default: {f.default})"
            kw = dict(dest=f.name, help=meta["help"] + shown, default=argparse.SUPPRESS)
            if kind == "flag":
                g.add_argument(setting_flag(f.name), action="store_true", **kw)
            elif kind == "bool":
                g.add_argument(setting_flag(f.name), action=argparse.BooleanOptionalAction, **kw)
            elif meta.get("parse") == "batch_size":
                g.add_argument(setting_flag(f.name), type=parse_batch_size, **kw)
            else:
                g.add_argument(setting_flag(f.name), type=field_type(cls, f.name), choices=meta.get("choices"), **kw)


def config_from_arguments(a: argparse.Namespace) -> RunConfig:
    """The configuration of parsed ``gptspeed train`` arguments (:func:`add_train_arguments`):
    :func:`build_train_config` of the preset, recipe, config file and the flags given."""
    overrides = {
        k: v for k, v in vars(a).items() if k not in ("command", "preset", "config_file", "print_config", "recipe")
    }
    return build_train_config(a.preset, overrides, a.config_file, a.recipe)


def config_from_flags(flags: list[str], source: str, shown: list[str] | None = None) -> RunConfig:
    """The configuration ``gptspeed train FLAGS`` would run (validated), for the commands that take a
    training run's flags (``bench --race``'s arms, ``bench --tune``'s run). GptspeedError (one line,
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

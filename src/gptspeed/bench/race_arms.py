"""``gptspeed bench race``'s arms: each parsed (``--arms`` recipes, ``--arm NAME="FLAGS"``) and checked whole,
as its own ``gptspeed train`` would check it, before the first run (:func:`check_arms`); the settings the race
sets itself are refused in an arm (:data:`RACE_SETTINGS`). See :mod:`gptspeed.bench.race`."""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass, field
from typing import Any

from gptspeed.config import RECIPES
from gptspeed.errors import GptspeedError

ARM_NAME = re.compile(r"^[A-Za-z0-9_.-]{1,100}$")  # a folder name under --out/runs, never a path


@dataclass
class Arm:
    """One side of a race: a name and the ``gptspeed train`` flags it adds (a recipe's ``--recipe
    NAME``, or any flags)."""

    name: str
    flags: list[str]
    runs: list[dict[str, Any]] = field(default_factory=list)


def parse_arms(names: str | None, specs: list[str] | None) -> list[Arm]:
    """``--arms gpt2,modern`` (recipe names) then each ``--arm NAME="FLAGS"``, in order. GptspeedError
    for an unknown recipe, a malformed ``--arm``, a repeated name, or fewer than one arm."""
    arms = []
    for name in [n.strip() for n in (names or "").split(",") if n.strip()]:
        if name not in RECIPES:
            raise GptspeedError(
                f'--arms: unknown recipe {name!r}: choose from {", ".join(RECIPES)}, or give --arm {name}="FLAGS"'
            )
        arms.append(Arm(name, ["--recipe", name]))
    for spec in specs or []:
        name, eq, flags = spec.partition("=")
        if not eq or not name.strip():
            raise GptspeedError(f'--arm {spec!r}: give NAME="FLAGS" (e.g. --arm muon="--optimizer muon")')
        if not ARM_NAME.match(name.strip()) or name.strip() in (".", ".."):
            raise GptspeedError(
                f"--arm {spec[:200]!r}: an arm's name names its runs' folders under --out: letters, "
                f"digits, '-', '_' and '.' only, at most 100 (got {name.strip()[:100]!r})"
            )
        try:
            arms.append(Arm(name.strip(), shlex.split(flags)))
        except ValueError as e:
            raise GptspeedError(f"--arm {spec!r}: {e}") from None
    if not arms:
        raise GptspeedError('bench race needs arms: --arms gpt2,modern and/or --arm NAME="FLAGS"')
    names_seen = [a.name for a in arms]
    if len(set(names_seen)) != len(names_seen):
        raise GptspeedError(f"bench race: arm names must differ, got {', '.join(names_seen)}")
    return arms


def arm_config(arm: Arm, base: list[str]):
    """The configuration ``gptspeed train BASE ARM-FLAGS`` would run (validated): the race reads its
    ``max_steps`` and checks every arm before the first run starts."""
    from gptspeed.configure import config_from_flags

    return config_from_flags([*base, *arm.flags], f"arm {arm.name}", shown=arm.flags)


#: settings the race sets for every run itself: an arm that sets one (by a flag or in its --config
#: file) is refused, never silently overridden
RACE_SETTINGS = {
    "seed": "the race runs seeds 1337, 1338, ...: give bench --seeds N",
    "eval_every": "every arm is evaluated at the same steps: give it to bench",
    "eval_tokens": "every arm is evaluated on the same val tokens: give it to bench",
    "stop_at_val_loss": "the race stops each run at its target: give bench --target-val-loss",
    "eval_bpb": "every arm is evaluated alike: give bench --target-bpb to race to bits per byte",
    "sampling": "every arm reads the data in the same order: give bench --sampling",
    "out": "the race names each run's folder under its own --out",
    "resume": "every race run is a new run",
    "device": "bench's --device is every arm's",
}


def given_settings(arm: Arm) -> dict[str, str]:
    """The settings ``arm``'s flags give, by field name -> how they were given (its flag, or its
    ``--config`` file); ``print_config`` when it has ``--print-config``. The flags parse (checked
    by :func:`arm_config` first)."""
    import argparse
    import contextlib
    import io

    from gptspeed.config import GROUPS, read_config_file, setting_flag
    from gptspeed.configure import add_train_arguments

    parser = argparse.ArgumentParser(add_help=False)
    add_train_arguments(parser)
    with contextlib.redirect_stderr(io.StringIO()):
        a = parser.parse_args(arm.flags)
    given = {k: setting_flag(k) for k in vars(a) if k not in ("preset", "recipe", "config_file", "print_config")}
    if a.print_config:
        given["print_config"] = "--print-config"
    if a.config_file:
        for k, v in read_config_file(a.config_file).items():
            for name in v if k in GROUPS and isinstance(v, dict) else {k: v}:
                given.setdefault(name, f"{name}: in its --config {a.config_file}")
    return given


def check_arms(arms: list[Arm], base: list[str], data: str) -> list:
    """Every arm's configuration (:func:`arm_config`), each checked whole before the first run, as
    its own ``gptspeed train`` would check it before its first step: its flags, the settings the
    race sets itself (:data:`RACE_SETTINGS`, ``--print-config``; ``--max-steps`` at most twice the
    first arm's), the data (bench's ``data``, or the arm's own ``--data``: a prepared folder with a val
    split that holds a sequence of the arm's length; whether arms of different data can be raced is
    :func:`gptspeed.bench.race_data.check_race_data`'s), the device rules
    (:func:`gptspeed.runtime.resolve_runtime`, then :func:`gptspeed.step.check_step`: SDPA backend,
    loss path, FP8, compile toolchain, residual dtype; the model's size against memory, from its
    shape). No model is built. GptspeedError (one line, naming the arm) for the first arm that could
    not run."""
    found = {data: _val_data(data)}
    configs = []
    for arm in arms:
        try:
            cfg = arm_config(arm, base)
        except GptspeedError as e:  # the configuration's own rules: name the arm too
            raise GptspeedError(str(e) if str(e).startswith(f"arm {arm.name}:") else f"arm {arm.name}: {e}") from None
        _refuse_race_settings(arm)
        cap = 2 * (configs[0] if configs else cfg).train.max_steps
        if cfg.train.max_steps > cap:
            raise GptspeedError(
                f"arm {arm.name}: --max-steps {cfg.train.max_steps} is beyond the race's cap of "
                f"{cap} (twice the first arm's steps): lower it, or raise the first arm's"
            )
        try:
            if cfg.train.data not in found:  # the arm's own --data
                found[cfg.train.data] = _val_data(cfg.train.data)
            _check_device(cfg)
            found[cfg.train.data].check_val(cfg.model.block_size)
        except GptspeedError as e:
            raise GptspeedError(f"arm {arm.name}: {e}") from None
        configs.append(cfg)
    return configs


def _val_data(data: str):
    """``data`` found (:func:`gptspeed.data.train_data.find_train_data`), which must have a val split."""
    from gptspeed.data.train_data import find_train_data

    train_data = find_train_data(data)
    if not train_data.has_val:
        what = "a stream" if train_data.is_stream else f"{data} has no val shards"
        raise GptspeedError(
            f"--data {data}: the race measures the val loss, and {what} has no val split: give "
            "a folder from `gptspeed prepare` (it has one)"
        )
    return train_data


def _refuse_race_settings(arm: Arm) -> None:
    """GptspeedError when ``arm`` sets what the race sets (:data:`RACE_SETTINGS`) or ``--print-config``."""
    for name, how in given_settings(arm).items():
        if name == "print_config":
            raise GptspeedError(
                f"arm {arm.name}: --print-config prints a configuration instead of training; drop "
                "it from the arm (`gptspeed train --print-config FLAGS` shows an arm's)"
            )
        if name in RACE_SETTINGS:
            raise GptspeedError(
                f"arm {arm.name}: {how} is the race's to set ({RACE_SETTINGS[name]}); drop it from the arm"
            )


def _check_device(cfg) -> None:
    """The device rules for ``cfg`` (:func:`gptspeed.runtime.resolve_runtime`, :func:`gptspeed.step.check_step`,
    :func:`gptspeed.step.check_model_fits`)."""
    from gptspeed.runtime import resolve_runtime
    from gptspeed.step import check_model_fits, check_step

    r = cfg.runtime
    rt = resolve_runtime(r.device, r.dtype, r.compile, r.parallel, planned_steps=cfg.train.max_steps)
    check_step(cfg, rt, cfg.grad_accum_steps(rt.world_size))
    check_model_fits(cfg, rt)

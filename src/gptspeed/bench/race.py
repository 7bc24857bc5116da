"""``gptspeed bench race``: wall-clock training time to a target validation loss, arm against arm.

The modded-nanogpt speedrun's measure (time to 3.28 FineWeb val loss for GPT-2 124M), on any data
and device: each *arm* is a set of ``gptspeed train`` flags (a named recipe of
:data:`gptspeed.config.RECIPES`, or any flags); every arm trains with ``--seeds`` seeds, arms
interleaved (A B A B ...) so they share the machine's noise, each run a fresh ``gptspeed train``
process evaluating a fixed set of val tokens every ``--eval-every`` steps.

The clock is the training step's only: evaluation is never timed (the trainer stops its clock while
evaluating) and the first step -- compilation and warm-up -- is counted at the speed of the
steps after it, so an arm is not charged for a compile the speedrun leaves untimed either. The
training time to a step is read from each run's ``metrics.jsonl``: the mean step time of each
logged interval times its steps. A run reaches the target at its first evaluation at or below
it; one that never does (by its own ``--max-steps``, at most twice the first arm's) counts as
not reached. The target is ``--target-val-loss``, else the first arm's mean final val loss (the
runs then train to their own ``--max-steps`` and the target is applied afterwards): the first arm
then *defines* the target, and its time to it is its whole training time -- the speedrun's
baseline is the quality its full run reaches, in the time that run takes (about half its runs end
above their own mean, which would otherwise leave the baseline with no time at all).

Nothing of the user's is lost to a race. Every arm is checked whole before the first run
(:func:`check_arms`: its flags, the data, the device rules; settings the race sets itself --
seeds, evaluation, the target, data, device, run folders -- are refused in an arm, never
overridden). An arm's name is a folder name (``OUT/runs/NAME-seedN``), never a path. ``--out`` is
a new or empty folder, or an earlier race's, replaced only with ``--force`` (its runs, logs and
``race.*``); a file, a run or data folder, or a folder holding anything else is refused
(:func:`race_entries`). ``--out`` is locked for the whole race with the run folder's lock
(:func:`gptspeed.checkpoint.run_lock`), so a second race on it is refused. A stop signal (Ctrl-C,
SIGTERM, SIGHUP) is passed on to the running ``gptspeed train`` as SIGTERM -- it saves its last
finished step -- and the race waits for it (at most :data:`STOP_WAIT_S`), says so in one line and
exits 128 + the signal (:func:`spawn`).

Records are accepted, as the speedrun accepts them, on repeated runs: each arm's mean and
standard deviation of time, tokens and steps to the target, its ratio to the first arm's mean
time, and a one-sided Welch t-test (``scipy.stats.ttest_ind(equal_var=False,
alternative="less")``) that the arm's time to target is shorter than the first arm's. Writes
``race.json`` (at the start and after every run, atomically), ``race.md`` and ``race.png`` (val loss against
training time, every run).
"""

from __future__ import annotations

import json
import math
import re
import shlex
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gptspeed.bench.settings import BenchBase
from gptspeed.config import RECIPES, _f
from gptspeed.errors import GptspeedError
from gptspeed.fileio import write_text_atomic

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
    "data": "every arm trains on bench's --data",
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
    first arm's), the data (a prepared folder with a val split that holds a sequence of the arm's
    length), the device rules (:func:`gptspeed.runtime.resolve_runtime`, then
    :func:`gptspeed.step.check_step`: SDPA backend, loss path, FP8, compile toolchain, residual
    dtype; the model's size against memory, from its shape). No model is built. GptspeedError
    (one line, naming the arm) for the first arm that could not run."""
    from gptspeed.data.train_data import find_train_data
    from gptspeed.runtime import resolve_runtime
    from gptspeed.step import check_model_fits, check_step

    train_data = find_train_data(data)
    if not train_data.has_val:
        what = "a stream" if train_data.is_stream else f"{data} has no val shards"
        raise GptspeedError(
            f"--data {data}: the race measures the val loss, and {what} has no val split: give "
            "a folder from `gptspeed prepare` (it has one)"
        )
    configs = []
    for arm in arms:
        try:
            cfg = arm_config(arm, base)
        except GptspeedError as e:  # the configuration's own rules: name the arm too
            raise GptspeedError(str(e) if str(e).startswith(f"arm {arm.name}:") else f"arm {arm.name}: {e}") from None
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
        cap = 2 * (configs[0] if configs else cfg).train.max_steps
        if cfg.train.max_steps > cap:
            raise GptspeedError(
                f"arm {arm.name}: --max-steps {cfg.train.max_steps} is beyond the race's cap of "
                f"{cap} (twice the first arm's steps): lower it, or raise the first arm's"
            )
        try:
            r = cfg.runtime
            rt = resolve_runtime(r.device, r.dtype, r.compile, r.parallel, planned_steps=cfg.train.max_steps)
            check_step(cfg, rt, cfg.grad_accum_steps(rt.world_size))
            check_model_fits(cfg, rt)
            train_data.check_val(cfg.model.block_size)
        except GptspeedError as e:
            raise GptspeedError(f"arm {arm.name}: {e}") from None
        configs.append(cfg)
    return configs


def training_curve(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Points ``{step, tokens, train_s, val_loss}`` at each evaluation of a run's metrics records:
    ``train_s`` is the training time to that step, the sum over logged intervals of their mean step
    time (``step_ms``) times their steps, the first interval's warm-up replaced by the next one's
    mean step time. Evaluation time is not in it: the trainer's clock stops while evaluating."""
    points, last_step, train_s, warm_steps = [], 0, 0.0, 0
    for r in records:
        step = r.get("step", 0)
        if isinstance(r.get("step_ms"), (int, float)) and step > last_step:
            n = step - last_step
            if r.get("includes_warmup"):
                warm_steps += n  # counted below at the next interval's speed
            else:
                train_s += (n + warm_steps) * r["step_ms"] / 1000
                warm_steps = 0
            last_step = step
        if isinstance(r.get("val_loss"), (int, float)):
            t = train_s + warm_steps * r.get("step_ms", 0) / 1000 if warm_steps else train_s
            points.append({"step": step, "tokens": r.get("tokens", 0), "train_s": t, "val_loss": r["val_loss"]})
    return points


def time_to_target(curve: list[dict[str, Any]], target: float) -> dict[str, Any]:
    """The first point of ``curve`` at or below ``target``: ``reached``, ``time_to_target_s``,
    ``tokens_to_target``, ``steps_to_target`` (None when never reached), ``final_val_loss``."""
    hit = next((p for p in curve if p["step"] > 0 and p["val_loss"] <= target), None)
    return {
        "reached": hit is not None,
        "time_to_target_s": hit["train_s"] if hit else None,
        "tokens_to_target": hit["tokens"] if hit else None,
        "steps_to_target": hit["step"] if hit else None,
        "final_val_loss": curve[-1]["val_loss"] if curve else None,
    }


def whole_run(curve: list[dict[str, Any]]) -> dict[str, Any]:
    """:func:`time_to_target`'s record for a run that defines the target: reached at its last
    evaluation, in its whole training time, tokens and steps."""
    end = curve[-1]
    return {
        "reached": True,
        "time_to_target_s": end["train_s"],
        "tokens_to_target": end["tokens"],
        "steps_to_target": end["step"],
        "final_val_loss": end["val_loss"],
    }


def summarize(arms: list[Arm], target: float, *, first_defines_target: bool = False) -> list[dict[str, Any]]:
    """Each arm's runs against ``target``, with means, standard deviations, the time ratio to the
    first arm and the one-sided Welch t-test's p-value (None with fewer than 2 reached runs a side).
    ``first_defines_target``: ``target`` is the first arm's mean final val loss, and its runs count
    their whole training (:func:`whole_run`)."""
    out, first_times = [], None
    for arm in arms:
        defines = first_defines_target and arm is arms[0]
        runs = [
            {
                "seed": r["seed"],
                **(whole_run(r["curve"]) if defines and r["curve"] else time_to_target(r["curve"], target)),
            }
            for r in arm.runs
        ]
        times = [r["time_to_target_s"] for r in runs if r["reached"]]
        row = {"name": arm.name, "flags": arm.flags, "runs": runs, "reached": len(times), "of": len(runs)}
        for key in ("time_to_target_s", "tokens_to_target", "steps_to_target", "final_val_loss"):
            vals = [r[key] for r in runs if r[key] is not None]
            row[f"{key}_mean"] = statistics.fmean(vals) if vals else None
            row[f"{key}_std"] = statistics.stdev(vals) if len(vals) > 1 else None
        if first_times is None:
            first_times = times
        row["time_ratio"] = (
            row["time_to_target_s_mean"] / statistics.fmean(first_times) if times and first_times else None
        )
        row["p_value"] = welch_p(times, first_times) if arm is not arms[0] else None
        out.append(row)
    return out


def welch_p(faster: list[float], than: list[float]) -> float | None:
    """One-sided Welch t-test p-value that ``faster``'s mean is below ``than``'s (SciPy); None with
    fewer than two values a side or identical constant samples."""
    if len(faster) < 2 or len(than) < 2:
        return None
    from scipy import stats

    p = float(stats.ttest_ind(faster, than, equal_var=False, alternative="less").pvalue)
    return None if math.isnan(p) else p


@dataclass(kw_only=True)
class RaceConfig(BenchBase):
    """What ``gptspeed bench race`` was asked: arms (``--arms``' recipes, then each ``--arm``:
    :func:`parse_arms`, unless ``arms`` is given), seeds, the preset, data and data order (``sampling``:
    ``gptspeed train --sampling``) every arm shares, the device, the output folder, the target (None:
    the first arm's mean final val loss), the evaluation interval (None: about 15 evaluations over
    the first arm's steps) and tokens (None: the first arm's), ``timeout_s`` (one run's limit) and
    ``force`` (replace an earlier race in ``out``). Its flags: :mod:`gptspeed.bench.cli`.

    Raises:
        GptspeedError: ``seeds`` below 1, or arms :func:`parse_arms` refuses.
    """

    recipes: str | None = _f(
        None, "comma-separated recipes, each an arm: gpt2, modern, speedrun (the first is the baseline)", flag="--arms"
    )
    arm: list[str] | None = _f(
        None,
        "an arm of any gptspeed train flags (repeatable), after --arms' ones",
        kind="append",
        metavar='NAME="FLAGS"',
    )
    seeds: int = _f(3, "runs per arm")
    sampling: str = _f(
        "sequential",
        "every arm's order of the training windows (gptspeed train --sampling); random gives "
        "each step windows from the whole corpus, as FineWeb's shuffled documents do",
        choices=("sequential", "random"),
    )
    target_val_loss: float | None = _f(None, "the val loss to reach (default: the first arm's mean final val loss)")
    eval_every: int | None = _f(None, "steps between evaluations (default: the first arm's steps / 15)")
    eval_tokens: int | None = _f(None, "val tokens per evaluation (default: the preset's)")
    timeout_s: float | None = _f(
        None, "seconds one run may take (default: no limit)", flag="--run-timeout", metavar="SECONDS"
    )
    force: bool = _f(
        False,
        "replace an earlier race in --out (its runs, logs and race.*; never a folder holding anything else)",
        kind="flag",
    )
    arms: list[Arm] = field(default_factory=list)

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.seeds < 1:
            raise GptspeedError(f"--seeds must be at least 1, got {self.seeds}")
        if not self.arms:
            self.arms = parse_arms(self.recipes, self.arm)


class RaceStopped(GptspeedError):
    """A stop signal (Ctrl-C, SIGTERM, SIGHUP) ended the race: the running arm was asked to save and
    stop, and did (or was killed after :data:`STOP_WAIT_S`). ``signum``: the signal; the command
    exits 128 + it."""

    def __init__(self, message: str, signum: int):
        super().__init__(message)
        self.signum = signum


#: seconds the race waits, after a stop signal, for the running ``gptspeed train`` to save and exit
#: before it kills it (the train saves its last finished step on the signal it is sent)
STOP_WAIT_S = 300.0


def run_race(cfg: RaceConfig, *, command: str = "", say: Callable[..., None] = print) -> dict[str, Any]:
    """Run every arm ``cfg.seeds`` times, interleaved, and write race.json / race.md / race.png into
    ``cfg.out``. Returns the race record (see the module docstring).

    Before anything is written: ``cfg.out`` is checked (:func:`gptspeed.bench.report.check_out_dir`,
    :func:`race_entries`) and every arm whole (:func:`check_arms`); then :func:`open_race_folder`
    locks ``cfg.out`` for the whole race (a second race on it is refused). A stop signal is passed
    on to the running ``gptspeed train``, which saves its last finished step; the race waits for it
    (at most :data:`STOP_WAIT_S`) and raises :class:`RaceStopped`.

    Raises:
        GptspeedError: an ``out`` refused, a setting an arm cannot run with, or a run that fails
            (its log is named); :class:`RaceStopped` after a stop signal.
    """
    from gptspeed.bench.report import check_out_dir
    from gptspeed.signals import StopFlag

    out = check_out_dir(cfg.out)  # a file, a run or data folder: refused before any work
    _refuse_earlier_race(out, race_entries(out), cfg.force)  # and what a race did not write
    data = cfg.data
    if data is None:  # the corpus `gptspeed train` would take, prepared once for every arm
        from gptspeed.data.prepare import default_train_data

        data = str(default_train_data(say=say))
    base = ["--preset", cfg.preset, "--device", cfg.device, "--data", data, "--sampling", cfg.sampling]
    configs = check_arms(cfg.arms, base, data)  # every arm checked before anything runs
    cap = 2 * configs[0].train.max_steps
    eval_every = cfg.eval_every or max(1, configs[0].train.max_steps // 15)
    eval_tokens = cfg.eval_tokens if cfg.eval_tokens is not None else configs[0].train.eval_tokens
    race = {
        "command": command,
        "preset": cfg.preset,
        "data": data,
        "sampling": cfg.sampling,
        "seeds": cfg.seeds,
        "eval_every": eval_every,
        "eval_tokens": eval_tokens,
        "steps_cap": cap,
        "target_val_loss": cfg.target_val_loss,
        "complete": False,
        "arms": [],
    }
    race["environment"] = environment_record(cfg.device)
    lock = open_race_folder(out, cfg.force)
    stop = StopFlag(say=say)
    try:
        _write(out, race, cfg)  # the folder is a race's from its first moment
        for seed in range(cfg.seeds):
            for arm, arm_cfg in zip(cfg.arms, configs):
                if stop():
                    raise _stopped(stop.signum, f"before {arm.name} seed {seed} started", out, cfg.arms)
                flags = [
                    *base,
                    "--save-every",
                    "0",
                    *arm.flags,
                    *_run_flags(cfg, seed, eval_every, eval_tokens, arm_cfg),
                ]
                arm.runs.append(_one_run(out, arm, seed, flags, cfg.timeout_s, say, stop, cfg.arms))
                _write(out, race, cfg)
        race["complete"] = True
        _write(out, race, cfg)
    finally:
        stop.restore()
        lock.release()
    return race


def _run_flags(cfg: RaceConfig, seed: int, eval_every: int, eval_tokens: int, arm_cfg) -> list[str]:
    """The flags the race sets on one run of an arm (after the arm's own): its seed, the evaluation,
    the arm's steps and the target to stop at."""
    return [
        "--seed",
        str(1337 + seed),
        "--eval-every",
        str(eval_every),
        "--eval-tokens",
        str(eval_tokens),
        "--max-steps",
        str(arm_cfg.train.max_steps),
        *(["--stop-at-val-loss", str(cfg.target_val_loss)] if cfg.target_val_loss else []),
    ]


def _stopped(signum: int, where: str, out: Path, arms: list[Arm]) -> RaceStopped:
    done = sum(len(a.runs) for a in arms)
    return RaceStopped(
        f"race stopped by {signal.Signals(signum).name} {where}; {out / 'race.json'} holds the "
        f"{done} run(s) finished before (not a complete race)",
        signum,
    )


#: what a race writes into its ``--out`` (and the run lock it holds there)
RACE_NAMES = ("race.json", "race.md", "race.png", "runs", "logs")
_RACE_TEMP = re.compile(r"^\.race\.(json|md)\.[0-9a-f]{8}\.tmp$|^\.race\.png\.tmp\.png$")
_RUN_NAME = re.compile(r"^[A-Za-z0-9_.-]{1,100}-seed\d+$")


def race_entries(out: Path) -> list[str]:
    """The race's own entries in ``out`` (:data:`RACE_NAMES`), sorted; [] for a new or empty folder.
    GptspeedError (one line, naming them) when ``out`` holds anything a race does not write: a
    race's ``runs/`` holds only run folders named ``ARM-seedN`` that hold only gptspeed's files
    (:func:`gptspeed.checkpoint.foreign_entries`), its ``logs/`` only ``ARM-seedN.log`` files, its
    ``race.json`` is a race record."""
    if not out.is_dir():
        return []
    try:
        return _race_entries(out)
    except OSError as e:
        raise GptspeedError(f"cannot read --out {out}: {e.strerror or e}") from None


def _race_entries(out: Path) -> list[str]:
    import os

    from gptspeed.checkpoint import LOCK_NAME, foreign_entries
    from gptspeed.fileio import read_user_json

    fix = "a race writes only into a new or empty folder, or an earlier race's; choose another --out"
    names = [n for n in sorted(os.listdir(out)) if n != LOCK_NAME and not _RACE_TEMP.match(n)]
    foreign = [n for n in names if n not in RACE_NAMES]
    for sub, ok in (
        ("runs", lambda p: _RUN_NAME.match(p.name) and p.is_dir() and not p.is_symlink() and not foreign_entries(p)),
        (
            "logs",
            lambda p: p.name.endswith(".log") and _RUN_NAME.match(p.name[:-4]) and p.is_file() and not p.is_symlink(),
        ),
    ):
        folder = out / sub
        if sub in names:
            if folder.is_symlink() or not folder.is_dir():
                foreign.append(sub)
            else:
                foreign += [f"{sub}/{p.name}" for p in sorted(folder.iterdir()) if not ok(p)]
    record = out / "race.json"
    if "race.json" in names and "race.json" not in foreign:
        try:
            doc = read_user_json(record, "race record", max_bytes=1 << 26)
        except GptspeedError:
            doc = {}
        if not {"steps_cap", "arms", "command"} <= set(doc):
            foreign.append("race.json")
    if foreign:
        shown = ", ".join(foreign[:5]) + (f" and {len(foreign) - 5} more" if len(foreign) > 5 else "")
        raise GptspeedError(f"--out {out} holds what a race did not write ({shown}): {fix}")
    return names


def _refuse_earlier_race(out: Path, names: list[str], force: bool) -> None:
    if names and not force:
        runs = len(list((out / "runs").iterdir())) if "runs" in names else 0
        raise GptspeedError(
            f"--out {out} holds an earlier race ({runs} run folder(s), {', '.join(names)}): pass "
            "--force to replace it, or choose another --out"
        )


def open_race_folder(out: Path, force: bool):
    """Create ``out`` and lock it for one race (:func:`gptspeed.checkpoint.run_lock`, the run
    folder's lock: released by the kernel when the process dies), then make it empty of an earlier
    race: refused without ``force`` (one line), removed with it -- each earlier run's folder only
    after taking its own run lock, so never under a live ``gptspeed train``. Returns the lock
    (``release()`` it). GptspeedError for another race holding ``out``, or anything in it that a
    race did not write (:func:`race_entries`)."""
    import shutil

    from gptspeed.checkpoint import LOCK_NAME, run_lock

    try:
        out.mkdir(parents=True, exist_ok=True)
        lock = run_lock(out).acquire()
    except GptspeedError:
        try:
            holder = (out / LOCK_NAME).read_text(errors="replace")[:200].strip() or "another process"
        except OSError:
            holder = "another process"
        raise GptspeedError(
            f"--out {out} is in use by {holder} (another `gptspeed bench race`): wait for it to "
            "end or stop it, or choose another --out"
        ) from None
    except OSError as e:
        raise GptspeedError(f"cannot create or lock --out {out}: {e.strerror or e}") from None
    try:
        names = race_entries(out)  # again, under the lock
        _refuse_earlier_race(out, names, force)
        try:
            for name in ("race.json", "race.md", "race.png"):  # the record first: a cut clearing leaves a race's
                (out / name).unlink(missing_ok=True)
            for run in sorted((out / "runs").iterdir()) if "runs" in names else []:
                held = run_lock(run).acquire()  # refused, naming it, while a gptspeed train writes it
                try:
                    shutil.rmtree(run)
                finally:
                    held.release()
            for log in sorted((out / "logs").iterdir()) if "logs" in names else []:
                log.unlink()
        except OSError as e:
            raise GptspeedError(
                f"cannot remove the earlier race in --out {out}: {e.strerror or e} "
                f"({getattr(e, 'filename', None) or out})"
            ) from None
    except BaseException:
        lock.release()
        raise
    return lock


def environment_record(device: str) -> dict[str, Any]:
    """The machine, versions and commit a race ran on (:func:`gptspeed.metrics.environment`)."""
    from gptspeed.metrics import environment
    from gptspeed.runtime import resolve_runtime

    return {**environment(resolve_runtime(device, "float32", False).device), "date": time.strftime("%Y-%m-%d %H:%M:%S")}


def train_command(flags: list[str], run_dir: Path) -> list[str]:
    """The ``gptspeed train`` process of one run."""
    return [sys.executable, "-m", "gptspeed", "train", *flags, "--out", str(run_dir)]


def _one_run(
    out: Path,
    arm: Arm,
    seed: int,
    flags: list[str],
    timeout_s: float | None,
    say: Callable[..., None],
    stop=None,
    arms: list[Arm] | None = None,
) -> dict[str, Any]:
    """One ``gptspeed train`` process of ``arm`` at ``seed``; its training curve. Its run folder is
    new: the race's ``out`` was emptied of any earlier race by :func:`open_race_folder`."""
    run_dir = out / "runs" / f"{arm.name}-seed{seed}"
    log = out / "logs" / f"{arm.name}-seed{seed}.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    cmd = train_command(flags, run_dir)
    say(f"race: {arm.name} seed {seed}: {shlex.join(cmd[3:])}", flush=True)
    t0 = time.monotonic()
    with open(log, "w") as f:
        try:
            code = spawn(cmd, f, timeout_s, stop, say)
        except subprocess.TimeoutExpired:
            raise GptspeedError(f"race: {arm.name} seed {seed} ran past {timeout_s:g} s (log: {log})") from None
    if stop is not None and stop():
        raise _stopped(
            stop.signum, f"while {arm.name} seed {seed} ran: {how_it_stopped(code, run_dir, log)}", out, arms or [arm]
        )
    if code != 0:
        raise GptspeedError(f"race: {arm.name} seed {seed} failed (exit {code}): {last_words(log)} (log: {log})")
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    curve = training_curve(records)
    say(
        f"race: {arm.name} seed {seed}: final val {curve[-1]['val_loss']:.4f} after {curve[-1]['train_s']:.1f} s of "
        f"training ({time.monotonic() - t0:.0f} s in all)",
        flush=True,
    )
    return {"seed": seed, "curve": curve, "run_dir": str(run_dir)}


def how_it_stopped(code: int, run_dir: Path, log: Path) -> str:
    """What the running arm did after the race passed a stop signal on, by its exit status ``code``: saved
    and stopped (128 + a stop signal, as ``gptspeed train`` exits), killed after :data:`STOP_WAIT_S`, or
    crashed (any other status: named as a crash, with its last words, :func:`last_words`); then its
    newest checkpoint, or that it had none (its log kept, named)."""
    from gptspeed.checkpoint import list_checkpoints
    from gptspeed.signals import StopFlag

    ckpts = list_checkpoints(run_dir)
    kept = f"its last checkpoint is {ckpts[-1]}" if ckpts else f"it had saved no checkpoint (log: {log})"
    if code == -signal.SIGKILL:
        return f"it did not stop within {STOP_WAIT_S:g} s and was killed, {kept}"
    if code in {128 + s for s in StopFlag.SIGNALS} | {-s for s in StopFlag.SIGNALS}:
        return f"it {'saved and ' if ckpts else ''}stopped (exit {code}), {kept}"
    return f"it crashed as it stopped (exit {code}: {last_words(log)}), {kept}"


def last_words(log: Path) -> str:
    """What a run said last, from its ``log``, for one line: the exception line of its last traceback
    (not the traceback, nor the hint lines a library prints after it), else its last non-empty line;
    at most 200 characters."""
    try:
        lines = [line for line in log.read_text(errors="replace").splitlines() if line.strip()]
    except OSError:
        return "?"
    starts = [i for i, line in enumerate(lines) if line.startswith("Traceback (most recent call last)")]
    if starts:
        said = [line for line in lines[starts[-1] + 1 :] if not line.startswith((" ", "\t"))]
        if said:
            return said[0][:200]
    return lines[-1][:200] if lines else "(it printed nothing)"


def spawn(cmd: list[str], log, timeout_s: float | None, stop=None, say: Callable[..., None] = print) -> int:
    """Run ``cmd`` (a ``gptspeed train``) in a fresh process, its output into the open file ``log``;
    its exit status. ``subprocess.TimeoutExpired`` past ``timeout_s`` (the process killed).

    ``stop`` (a :class:`gptspeed.signals.StopFlag`): once it is set, the process is sent SIGTERM
    -- on which ``gptspeed train`` saves its last finished step and exits -- and waited for at most
    :data:`STOP_WAIT_S` seconds, then killed (status ``-SIGKILL``). A Ctrl-C in a terminal reaches
    the process itself too (one process group): its first signal starts the save and the SIGTERM
    after it is ignored. A second Ctrl-C (KeyboardInterrupt here) kills it at once: checkpoints
    are written atomically, so nothing is corrupted."""
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    try:
        t0, asked = time.monotonic(), None
        while True:
            try:
                return proc.wait(timeout=0.1)
            except subprocess.TimeoutExpired:
                pass
            now = time.monotonic()
            if stop is not None and stop() and asked is None:
                proc.send_signal(signal.SIGTERM)
                asked = now
                say(
                    f"race: asked the running arm (pid {proc.pid}) to save and stop; waiting for it, at most "
                    f"{STOP_WAIT_S:g} s",
                    flush=True,
                )
            if asked is not None and now - asked > STOP_WAIT_S:
                proc.kill()
                return proc.wait()
            if asked is None and timeout_s is not None and now - t0 > timeout_s:
                raise subprocess.TimeoutExpired(cmd, timeout_s)
    finally:
        if proc.poll() is None:  # a second Ctrl-C, a timeout, any failure here: no child is left behind
            proc.kill()
            proc.wait()


def _write(out: Path, race: dict[str, Any], cfg: RaceConfig) -> None:
    """race.json (and, once a first-arm run exists, race.md and race.png), each written atomically."""
    firsts = [r["curve"][-1]["val_loss"] for r in cfg.arms[0].runs if r["curve"]]
    target = cfg.target_val_loss if cfg.target_val_loss is not None else (statistics.fmean(firsts) if firsts else None)
    race["target_val_loss"] = target
    defines = cfg.target_val_loss is None
    race["target_from"] = (
        "--target-val-loss"
        if not defines
        else f"{cfg.arms[0].name}'s mean final val loss; its time is its whole training"
    )
    race["arms"] = summarize(cfg.arms, target, first_defines_target=defines) if target is not None else []
    for arm, row in zip(cfg.arms, race["arms"]):
        for run, curve_run in zip(row["runs"], arm.runs):
            run["curve"] = curve_run["curve"]
    write_text_atomic(out / "race.json", json.dumps(race, indent=2) + "\n")
    if race["arms"]:
        write_text_atomic(out / "race.md", race_markdown(race))
        plot_race(race, out / "race.png")


def _fmt(v: float | None, spec: str) -> str:
    return "—" if v is None else format(v, spec)


def race_markdown(race: dict[str, Any]) -> str:
    """The race as a Markdown table: per arm, runs that reached the target, time / tokens / steps to
    it (mean ± std), the time ratio to the first arm and the p-value."""
    env = race.get("environment", {})
    lines = [
        f"## gptspeed bench race ({'complete' if race['complete'] else 'in progress'})",
        "",
        f"{env.get('device', '?')} · torch {env.get('torch', '?')} · gptspeed {env.get('git_commit', '?')} · "
        f"{env.get('date', '')}",
        "",
        f"Command: `{race.get('command', '')}`",
        "",
        f"Target val loss **{race['target_val_loss']:.4f}** ({race['target_from']}); eval every "
        f"{race['eval_every']} steps; step cap {race['steps_cap']}; {race.get('sampling', 'sequential')} windows.",
        "",
        "| arm | reached | time to target (s) | tokens to target | steps | final val loss | time ratio | p (faster) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for a in race["arms"]:
        t = f"{_fmt(a['time_to_target_s_mean'], '.1f')} ± {_fmt(a['time_to_target_s_std'], '.1f')}"
        lines.append(
            f"| {a['name']} | {a['reached']}/{a['of']} | {t} | {_fmt(a['tokens_to_target_mean'], ',.0f')} | "
            f"{_fmt(a['steps_to_target_mean'], '.0f')} | {_fmt(a['final_val_loss_mean'], '.4f')} | "
            f"{_fmt(a['time_ratio'], '.2f')} | {_fmt(a['p_value'], '.2g')} |"
        )
    lines += [
        "",
        "Training time only: evaluation is not timed, and the first step (compilation, warm-up) counts at "
        "the next steps' speed. A run that never reaches the target is not in the means. p: one-sided Welch "
        "t-test that the arm's time to target is below the first arm's.",
        "",
    ]
    return "\n".join(lines)


def plot_race(race: dict[str, Any], path: Path) -> None:
    """race.png: val loss against training time (minutes), every run, one colour per arm, the target dashed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for i, arm in enumerate(race["arms"]):
        for j, run in enumerate(arm["runs"]):
            xs = [p["train_s"] / 60 for p in run["curve"] if p["step"] > 0]
            ys = [p["val_loss"] for p in run["curve"] if p["step"] > 0]
            ax.plot(xs, ys, color=f"C{i}", alpha=0.8, label=arm["name"] if j == 0 else None)
    ax.axhline(race["target_val_loss"], color="k", linestyle="--", linewidth=1, label="target")
    ax.set_xlabel("training time (min)")
    ax.set_ylabel("val loss")
    ax.legend()
    fig.tight_layout()
    tmp = path.with_name(f".{path.name}.tmp.png")
    fig.savefig(tmp, dpi=110)
    plt.close(fig)
    tmp.replace(path)

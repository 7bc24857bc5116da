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
above their own mean, which would otherwise leave the baseline with no time at all). With
``--target-bpb`` the target is a val bits per byte instead (nanochat's measure, which compares
tokenizers): every run also evaluates it (``train --eval-bpb``, outside the clock, like the loss)
and trains its own ``--max-steps`` -- the trainer stops at a val loss only -- and its time is to
its first evaluation at or below the target.

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

from gptspeed.bench.race_arms import (
    ARM_NAME,
    RACE_SETTINGS,
    Arm,
    arm_config,
    check_arms,
    given_settings,
    parse_arms,
)
from gptspeed.bench.race_data import arm_eval_tokens, check_race_data
from gptspeed.bench.race_folder import RACE_NAMES, _refuse_earlier_race, open_race_folder, race_entries
from gptspeed.bench.race_report import (
    plot_race,
    race_markdown,
    summarize,
    time_to_target,
    training_curve,
    welch_p,
    whole_run,
)
from gptspeed.bench.settings import BenchBase
from gptspeed.config import _f
from gptspeed.errors import GptspeedError
from gptspeed.fileio import write_text_atomic

# The race's parts, by job (arms, --out, figures), are named here as before: ``race.summarize``, ...
__all__ = [
    "ARM_NAME",
    "RACE_NAMES",
    "RACE_SETTINGS",
    "STOP_WAIT_S",
    "Arm",
    "RaceConfig",
    "RaceStopped",
    "arm_config",
    "check_arms",
    "given_settings",
    "open_race_folder",
    "parse_arms",
    "plot_race",
    "race_entries",
    "race_markdown",
    "run_race",
    "spawn",
    "summarize",
    "time_to_target",
    "training_curve",
    "welch_p",
    "whole_run",
]


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
    target_bpb: float | None = _f(
        None,
        "race to this val bits per byte instead of a val loss: every run also evaluates it (train --eval-bpb, "
        "not timed) and trains its --max-steps; its time is to its first evaluation at or below it",
        metavar="BPB",
    )
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
        if self.target_bpb is not None and self.target_val_loss is not None:
            raise GptspeedError("give one target: --target-val-loss (nats per token) or --target-bpb (bits per byte)")
        if self.target_bpb is not None and not (math.isfinite(self.target_bpb) and self.target_bpb > 0):
            raise GptspeedError(
                f"--target-bpb must be a positive finite number of bits per byte, got {self.target_bpb}"
            )
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
    if cfg.target_bpb is not None:  # every evaluation also gives val_bpb (checked with the arms)
        base.append("--eval-bpb")
    configs = check_arms(cfg.arms, base, data)  # every arm checked before anything runs
    datas = [c.train.data for c in configs]  # bench's --data, or an arm's own (a race of tokenizers)
    check_race_data([a.name for a in cfg.arms], datas, cfg.target_bpb, cfg.target_val_loss)
    cap = 2 * configs[0].train.max_steps
    eval_every = cfg.eval_every or max(1, configs[0].train.max_steps // 15)
    eval_tokens = cfg.eval_tokens if cfg.eval_tokens is not None else configs[0].train.eval_tokens
    arm_tokens = arm_eval_tokens(datas, eval_tokens, given=cfg.eval_tokens is not None)
    race = {
        "command": command,
        "preset": cfg.preset,
        "data": data,
        "sampling": cfg.sampling,
        "seeds": cfg.seeds,
        "eval_every": eval_every,
        "eval_tokens": eval_tokens,
        "steps_cap": cap,
        "metric": _metric(cfg),
        "target_val_loss": cfg.target_val_loss,
        "target_val_bpb": cfg.target_bpb,
        "arm_data": {a.name: {"data": d, "eval_tokens": n} for a, d, n in zip(cfg.arms, datas, arm_tokens)},
        "complete": False,
        "arms": [],
    }
    race["environment"] = environment_record(cfg.device)
    lock = open_race_folder(out, cfg.force)
    stop = StopFlag(say=say)
    try:
        _write(out, race, cfg)  # the folder is a race's from its first moment
        for seed in range(cfg.seeds):
            for arm, arm_cfg, arm_eval in zip(cfg.arms, configs, arm_tokens):
                if stop():
                    raise _stopped(stop.signum, f"before {arm.name} seed {seed} started", out, cfg.arms)
                flags = [
                    *base,
                    "--save-every",
                    "0",
                    *arm.flags,
                    *_run_flags(cfg, seed, eval_every, arm_eval, arm_cfg),
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


def _metric(cfg: RaceConfig) -> str:
    """What the race's target is of: ``val_bpb`` with ``--target-bpb``, else ``val_loss``."""
    return "val_bpb" if cfg.target_bpb is not None else "val_loss"


def _write(out: Path, race: dict[str, Any], cfg: RaceConfig) -> None:
    """race.json (and, once a first-arm run exists, race.md and race.png), each written atomically."""
    metric = _metric(cfg)
    given = cfg.target_bpb if metric == "val_bpb" else cfg.target_val_loss
    firsts = [r["curve"][-1]["val_loss"] for r in cfg.arms[0].runs if r["curve"]]
    target = given if given is not None else (statistics.fmean(firsts) if firsts else None)
    race[f"target_{metric}"] = target
    defines = given is None
    race["target_from"] = (
        ("--target-bpb" if metric == "val_bpb" else "--target-val-loss")
        if not defines
        else f"{cfg.arms[0].name}'s mean final val loss; its time is its whole training"
    )
    race["arms"] = (
        summarize(cfg.arms, target, first_defines_target=defines, metric=metric) if target is not None else []
    )
    for arm, row in zip(cfg.arms, race["arms"]):
        row.update(race["arm_data"][arm.name])  # the arm's data and val tokens per evaluation
        for run, curve_run in zip(row["runs"], arm.runs):
            run["curve"] = curve_run["curve"]
    write_text_atomic(out / "race.json", json.dumps(race, indent=2) + "\n")
    if race["arms"]:
        write_text_atomic(out / "race.md", race_markdown(race))
        plot_race(race, out / "race.png")

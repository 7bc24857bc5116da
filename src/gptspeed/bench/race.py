"""``gptspeed bench --race``: wall-clock training time to a target validation loss, arm against arm.

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
it; one that never does (by its own ``--max-steps``, capped at twice the first arm's) counts as
not reached. The target is ``--target-val-loss``, else the first arm's mean final val loss (the
runs then train to their own ``--max-steps`` and the target is applied afterwards): the first arm
then *defines* the target, and its time to it is its whole training time -- the speedrun's
baseline is the quality its full run reaches, in the time that run takes (about half its runs end
above their own mean, which would otherwise leave the baseline with no time at all).

Records are accepted, as the speedrun accepts them, on repeated runs: each arm's mean and
standard deviation of time, tokens and steps to the target, its ratio to the first arm's mean
time, and a one-sided Welch t-test (``scipy.stats.ttest_ind(equal_var=False,
alternative="less")``) that the arm's time to target is shorter than the first arm's. Writes
``race.json`` (after every run, atomically), ``race.md`` and ``race.png`` (val loss against
training time, every run).
"""

from __future__ import annotations

import json
import math
import shlex
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from gptspeed.config import RECIPES
from gptspeed.errors import GptspeedError
from gptspeed.fileio import write_text_atomic


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
            raise GptspeedError(f"--arms: unknown recipe {name!r}: choose from {', '.join(RECIPES)}, or give "
                                f"--arm {name}=\"FLAGS\"")
        arms.append(Arm(name, ["--recipe", name]))
    for spec in specs or []:
        name, eq, flags = spec.partition("=")
        if not eq or not name.strip():
            raise GptspeedError(f"--arm {spec!r}: give NAME=\"FLAGS\" (e.g. --arm muon=\"--optimizer muon\")")
        try:
            arms.append(Arm(name.strip(), shlex.split(flags)))
        except ValueError as e:
            raise GptspeedError(f"--arm {spec!r}: {e}") from None
    if not arms:
        raise GptspeedError("--race needs arms: --arms gpt2,modern and/or --arm NAME=\"FLAGS\"")
    names_seen = [a.name for a in arms]
    if len(set(names_seen)) != len(names_seen):
        raise GptspeedError(f"--race: arm names must differ, got {', '.join(names_seen)}")
    return arms


def arm_config(arm: Arm, base: list[str]):
    """The configuration ``gptspeed train BASE ARM-FLAGS`` would run (validated): the race reads its
    ``max_steps`` and checks every arm before the first run starts."""
    from gptspeed.configure import config_from_flags

    return config_from_flags([*base, *arm.flags], f"arm {arm.name}", shown=arm.flags)


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
    return {"reached": hit is not None, "time_to_target_s": hit["train_s"] if hit else None,
            "tokens_to_target": hit["tokens"] if hit else None, "steps_to_target": hit["step"] if hit else None,
            "final_val_loss": curve[-1]["val_loss"] if curve else None}


def whole_run(curve: list[dict[str, Any]]) -> dict[str, Any]:
    """:func:`time_to_target`'s record for a run that defines the target: reached at its last
    evaluation, in its whole training time, tokens and steps."""
    end = curve[-1]
    return {"reached": True, "time_to_target_s": end["train_s"], "tokens_to_target": end["tokens"],
            "steps_to_target": end["step"], "final_val_loss": end["val_loss"]}


def summarize(arms: list[Arm], target: float, *, first_defines_target: bool = False) -> list[dict[str, Any]]:
    """Each arm's runs against ``target``, with means, standard deviations, the time ratio to the
    first arm and the one-sided Welch t-test's p-value (None with fewer than 2 reached runs a side).
    ``first_defines_target``: ``target`` is the first arm's mean final val loss, and its runs count
    their whole training (:func:`whole_run`)."""
    out, first_times = [], None
    for arm in arms:
        defines = first_defines_target and arm is arms[0]
        runs = [{"seed": r["seed"], **(whole_run(r["curve"]) if defines and r["curve"] else
                                       time_to_target(r["curve"], target))} for r in arm.runs]
        times = [r["time_to_target_s"] for r in runs if r["reached"]]
        row = {"name": arm.name, "flags": arm.flags, "runs": runs, "reached": len(times), "of": len(runs)}
        for key in ("time_to_target_s", "tokens_to_target", "steps_to_target", "final_val_loss"):
            vals = [r[key] for r in runs if r[key] is not None]
            row[f"{key}_mean"] = statistics.fmean(vals) if vals else None
            row[f"{key}_std"] = statistics.stdev(vals) if len(vals) > 1 else None
        if first_times is None:
            first_times = times
        row["time_ratio"] = (row["time_to_target_s_mean"] / statistics.fmean(first_times)
                             if times and first_times else None)
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


@dataclass
class RaceConfig:
    """What ``gptspeed bench --race`` was asked: arms, seeds, the preset and data every arm shares,
    the device, the output folder, the target (None: the first arm's mean final val loss) and the
    evaluation interval (None: about 15 evaluations over the first arm's steps)."""

    arms: list[Arm]
    seeds: int = 3
    preset: str = "nano"
    data: str | None = None
    device: str = "auto"
    out: str = "race"
    target_val_loss: float | None = None
    eval_every: int | None = None
    eval_tokens: int | None = None
    timeout_s: float | None = None


def run_race(cfg: RaceConfig, *, command: str = "", say: Callable[..., None] = print) -> dict[str, Any]:
    """Run every arm ``cfg.seeds`` times, interleaved, and write race.json / race.md / race.png into
    ``cfg.out``. Returns the race record (see the module docstring). GptspeedError for a setting
    no arm can run with, or a run that fails (its log is named)."""
    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    base = ["--preset", cfg.preset, "--device", cfg.device, *(["--data", cfg.data] if cfg.data else [])]
    configs = [arm_config(arm, base) for arm in cfg.arms]  # every arm checked before anything runs
    cap = 2 * configs[0].train.max_steps
    eval_every = cfg.eval_every or max(1, configs[0].train.max_steps // 15)
    race = {"command": command, "preset": cfg.preset, "data": cfg.data, "seeds": cfg.seeds, "eval_every": eval_every,
            "steps_cap": cap, "target_val_loss": cfg.target_val_loss, "complete": False, "arms": []}
    race["environment"] = environment_record(cfg.device)
    for seed in range(cfg.seeds):
        for arm, arm_cfg in zip(cfg.arms, configs):
            steps = min(arm_cfg.train.max_steps, cap)
            flags = [*base, "--seed", str(1337 + seed), "--eval-every", str(eval_every), "--max-steps", str(steps),
                     "--save-every", "0", *(["--eval-tokens", str(cfg.eval_tokens)] if cfg.eval_tokens else []),
                     *(["--stop-at-val-loss", str(cfg.target_val_loss)] if cfg.target_val_loss else []), *arm.flags]
            arm.runs.append(_one_run(out, arm, seed, flags, cfg.timeout_s, say))
            _write(out, race, cfg)
    race["complete"] = True
    _write(out, race, cfg)
    return race


def environment_record(device: str) -> dict[str, Any]:
    """The machine, versions and commit a race ran on (:func:`gptspeed.metrics.environment`)."""
    from gptspeed.metrics import environment
    from gptspeed.runtime import resolve_runtime

    return {**environment(resolve_runtime(device, "float32", False).device), "date": time.strftime("%Y-%m-%d %H:%M:%S")}


def _one_run(out: Path, arm: Arm, seed: int, flags: list[str], timeout_s: float | None,
             say: Callable[..., None]) -> dict[str, Any]:
    """One ``gptspeed train`` process of ``arm`` at ``seed``; its training curve."""
    run_dir = out / "runs" / f"{arm.name}-seed{seed}"
    log = out / "logs" / f"{arm.name}-seed{seed}.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    if run_dir.exists():
        import shutil

        shutil.rmtree(run_dir)
    cmd = [sys.executable, "-m", "gptspeed", "train", *flags, "--out", str(run_dir)]
    say(f"race: {arm.name} seed {seed}: {shlex.join(cmd[3:])}", flush=True)
    t0 = time.monotonic()
    with open(log, "w") as f:
        try:
            code = spawn(cmd, f, timeout_s)
        except subprocess.TimeoutExpired:
            raise GptspeedError(f"race: {arm.name} seed {seed} ran past {timeout_s:g} s (log: {log})") from None
    if code != 0:
        last = [line for line in log.read_text(errors="replace").splitlines() if line.strip()][-1:] or ["?"]
        raise GptspeedError(f"race: {arm.name} seed {seed} failed (exit {code}): {last[0][:200]} (log: {log})")
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    curve = training_curve(records)
    say(f"race: {arm.name} seed {seed}: final val {curve[-1]['val_loss']:.4f} after {curve[-1]['train_s']:.1f} s of "
        f"training ({time.monotonic() - t0:.0f} s in all)", flush=True)
    return {"seed": seed, "curve": curve, "run_dir": str(run_dir)}


def spawn(cmd: list[str], log, timeout_s: float | None) -> int:
    """Run ``cmd`` (a ``gptspeed train``) in a fresh process, its output into the open file ``log``;
    its exit status. ``subprocess.TimeoutExpired`` past ``timeout_s``."""
    return subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, timeout=timeout_s).returncode


def _write(out: Path, race: dict[str, Any], cfg: RaceConfig) -> None:
    """race.json (and, once a first-arm run exists, race.md and race.png), each written atomically."""
    firsts = [r["curve"][-1]["val_loss"] for r in cfg.arms[0].runs if r["curve"]]
    target = cfg.target_val_loss if cfg.target_val_loss is not None else (statistics.fmean(firsts) if firsts else None)
    race["target_val_loss"] = target
    defines = cfg.target_val_loss is None
    race["target_from"] = ("--target-val-loss" if not defines else
                           f"{cfg.arms[0].name}'s mean final val loss; its time is its whole training")
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
    lines = [f"## gptspeed bench --race ({'complete' if race['complete'] else 'in progress'})", "",
             f"{env.get('device', '?')} · torch {env.get('torch', '?')} · gptspeed {env.get('git_commit', '?')} · "
             f"{env.get('date', '')}", "", f"Command: `{race.get('command', '')}`", "",
             f"Target val loss **{race['target_val_loss']:.4f}** ({race['target_from']}); eval every "
             f"{race['eval_every']} steps; step cap {race['steps_cap']}.", "",
             "| arm | reached | time to target (s) | tokens to target | steps | final val loss | time ratio | p (faster) |",
             "|---|---|---|---|---|---|---|---|"]
    for a in race["arms"]:
        t = f"{_fmt(a['time_to_target_s_mean'], '.1f')} ± {_fmt(a['time_to_target_s_std'], '.1f')}"
        lines.append(f"| {a['name']} | {a['reached']}/{a['of']} | {t} | {_fmt(a['tokens_to_target_mean'], ',.0f')} | "
                     f"{_fmt(a['steps_to_target_mean'], '.0f')} | {_fmt(a['final_val_loss_mean'], '.4f')} | "
                     f"{_fmt(a['time_ratio'], '.2f')} | {_fmt(a['p_value'], '.2g')} |")
    lines += ["", "Training time only: evaluation is not timed, and the first step (compilation, warm-up) counts at "
              "the next steps' speed. A run that never reaches the target is not in the means. p: one-sided Welch "
              "t-test that the arm's time to target is below the first arm's.", ""]
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

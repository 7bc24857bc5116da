"""``gptspeed bench race``'s figures: each run's training curve read from its ``metrics.jsonl``, its time to the
target, each arm's means and one-sided Welch t-test against the first arm (:func:`summarize`), and the race as
Markdown (``race.md``) and a plot (``race.png``). See :mod:`gptspeed.bench.race`."""

from __future__ import annotations

import math
import statistics
from pathlib import Path
from typing import Any


def training_curve(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Points ``{step, tokens, train_s, val_loss}`` (and ``val_bpb`` where the record has it: ``train
    --eval-bpb``) at each evaluation of a run's metrics records:
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
            point = {"step": step, "tokens": r.get("tokens", 0), "train_s": t, "val_loss": r["val_loss"]}
            if isinstance(r.get("val_bpb"), (int, float)):
                point["val_bpb"] = r["val_bpb"]
            points.append(point)
    return points


def time_to_target(curve: list[dict[str, Any]], target: float, metric: str = "val_loss") -> dict[str, Any]:
    """The first point of ``curve`` after step 0 whose ``metric`` (``val_loss``, or ``val_bpb``) is at or
    below ``target``: ``reached``, ``time_to_target_s``, ``tokens_to_target``, ``steps_to_target`` (None
    when never reached), ``final_val_loss`` (and, for ``val_bpb``, ``final_val_bpb``: the last one measured)."""
    hit = next((p for p in curve if p["step"] > 0 and p.get(metric) is not None and p[metric] <= target), None)
    out = {
        "reached": hit is not None,
        "time_to_target_s": hit["train_s"] if hit else None,
        "tokens_to_target": hit["tokens"] if hit else None,
        "steps_to_target": hit["step"] if hit else None,
        "final_val_loss": curve[-1]["val_loss"] if curve else None,
    }
    if metric != "val_loss":
        out[f"final_{metric}"] = next((p[metric] for p in reversed(curve) if p.get(metric) is not None), None)
    return out


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


def summarize(
    arms: list, target: float, *, first_defines_target: bool = False, metric: str = "val_loss"
) -> list[dict[str, Any]]:
    """Each arm's runs (``arms``: :class:`~gptspeed.bench.race_arms.Arm`) against ``target``, with means,
    standard deviations, the time ratio to the first arm and the one-sided Welch t-test's p-value (None
    with fewer than 2 reached runs a side).
    ``first_defines_target``: ``target`` is the first arm's mean final val loss, and its runs count
    their whole training (:func:`whole_run`). ``metric``: what ``target`` is of (:func:`time_to_target`)."""
    out, first_times = [], None
    for arm in arms:
        defines = first_defines_target and arm is arms[0]
        runs = [
            {
                "seed": r["seed"],
                **(whole_run(r["curve"]) if defines and r["curve"] else time_to_target(r["curve"], target, metric)),
            }
            for r in arm.runs
        ]
        times = [r["time_to_target_s"] for r in runs if r["reached"]]
        row = {"name": arm.name, "flags": arm.flags, "runs": runs, "reached": len(times), "of": len(runs)}
        finals = ("final_val_loss",) if metric == "val_loss" else ("final_val_loss", f"final_{metric}")
        for key in ("time_to_target_s", "tokens_to_target", "steps_to_target", *finals):
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


_LABELS = {"val_loss": "val loss", "val_bpb": "val bpb"}


def _fmt(v: float | None, spec: str) -> str:
    return "—" if v is None else format(v, spec)


def race_markdown(race: dict[str, Any]) -> str:
    """The race as a Markdown table: per arm, runs that reached the target, time / tokens / steps to
    it (mean ± std), the time ratio to the first arm and the p-value. The target is of ``race["metric"]``
    (``val_loss``; ``val_bpb`` in a race to ``--target-bpb``)."""
    env = race.get("environment", {})
    metric = race.get("metric", "val_loss")
    what = _LABELS[metric]
    lines = [
        f"## gptspeed bench race ({'complete' if race['complete'] else 'in progress'})",
        "",
        f"{env.get('device', '?')} · torch {env.get('torch', '?')} · gptspeed {env.get('git_commit', '?')} · "
        f"{env.get('date', '')}",
        "",
        f"Command: `{race.get('command', '')}`",
        "",
        f"Target {what} **{race[f'target_{metric}']:.4f}** ({race['target_from']}); eval every "
        f"{race['eval_every']} steps; step cap {race['steps_cap']}; {race.get('sampling', 'sequential')} windows.",
        "",
        f"| arm | reached | time to target (s) | tokens to target | steps | final {what} | time ratio | p (faster) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for a in race["arms"]:
        t = f"{_fmt(a['time_to_target_s_mean'], '.1f')} ± {_fmt(a['time_to_target_s_std'], '.1f')}"
        lines.append(
            f"| {a['name']} | {a['reached']}/{a['of']} | {t} | {_fmt(a['tokens_to_target_mean'], ',.0f')} | "
            f"{_fmt(a['steps_to_target_mean'], '.0f')} | {_fmt(a[f'final_{metric}_mean'], '.4f')} | "
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
    """race.png: the val loss (or, in a race to ``--target-bpb``, the val bits per byte) against training time
    (minutes), every run, one colour per arm, the target dashed."""
    metric = race.get("metric", "val_loss")
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for i, arm in enumerate(race["arms"]):
        for j, run in enumerate(arm["runs"]):
            points = [p for p in run["curve"] if p["step"] > 0 and p.get(metric) is not None]
            xs = [p["train_s"] / 60 for p in points]
            ys = [p[metric] for p in points]
            ax.plot(xs, ys, color=f"C{i}", alpha=0.8, label=arm["name"] if j == 0 else None)
    ax.axhline(race[f"target_{metric}"], color="k", linestyle="--", linewidth=1, label="target")
    ax.set_xlabel("training time (min)")
    ax.set_ylabel(_LABELS[metric])
    ax.legend()
    fig.tight_layout()
    tmp = path.with_name(f".{path.name}.tmp.png")
    fig.savefig(tmp, dpi=110)
    plt.close(fig)
    tmp.replace(path)

"""``bench tune``'s report as Markdown (``tune.md``): the environment, your run, one row per
candidate in the order tried, the configuration kept and the command that trains it."""

from __future__ import annotations

from typing import Any

from gptspeed.bench.report import environment_line, fmt_bytes, table_cell

#: every verdict a row can have (:meth:`gptspeed.bench.tune.Tuner.measure`)
VERDICTS = (
    "yours",
    "verified",
    "fails verification",
    "does not fit",
    "not applicable",
    "duplicate",
    "failed",
    "cut by --budget-s",
    "not tried",
    "interrupted",
)


def _loss(r: dict[str, Any]) -> str:
    c = r.get("loss_check")
    if not c:
        return "—"
    return f"{c['max_rel_diff']:.1e} (≤ {c['rtol']:.0e}, {c['steps_compared']} steps)"


def _row(r: dict[str, Any]) -> str:
    ran = r.get("ms_median") is not None
    tps = f"{r['tokens_per_s']:,.0f}" if ran else "—"
    vs = f"{r['vs_yours']:.3f}x" if r.get("vs_yours") else "—"
    ms = f"{r['ms_median']:.1f} ({r['ms_q25']:.1f}–{r['ms_q75']:.1f})" if ran else "—"
    mfu = f"{100 * r['mfu']:.1f}%" if ran and r.get("mfu") is not None else "—"
    mem = fmt_bytes(r.get("peak_mem_bytes")) if ran else "—"
    verdict = f"**{r['verdict']}, kept**" if r.get("kept") and r["verdict"] != "yours" else r.get("verdict", "pending")
    return (
        f"| {table_cell(r['name'])} | {table_cell(r.get('flags') or '—')} | {verdict} | {tps} | {vs} | {ms} | {mfu} | {mem} "
        f"| {_loss(r)} | {table_cell(r.get('reason') or '')} |"
    )


def _resolved(resolved: dict[str, Any]) -> list[str]:
    """The line naming what your run's ``auto`` settings resolved to here (empty before your row ran)."""
    if not resolved:
        return []
    names = {"sdpa_backend": "SDPA kernel (its profile)", "coordinate_descent_tuning": "coordinate-descent tuning"}
    parts = [f"{names.get(k, k)} {v}" for k, v in resolved.items() if v is not None]
    return [f"Your run, resolved here: {', '.join(parts)}.", ""]


def _state(res: dict[str, Any]) -> str:
    """How far the search got, for the report's first paragraph: nothing when complete."""
    if res["complete"]:
        return ""
    return f", interrupted by {res['interrupted']}" if res.get("interrupted") else ", still running or cut short"


def tune_markdown(res: dict[str, Any]) -> str:
    """The report (:func:`gptspeed.bench.tune.Tuner.result`) as Markdown."""
    env, c, rows = res["environment"], res["config"], res["rows"]
    data = "synthetic phrases (learnable random token phrases)" if c["data"] is None else f"`{c['data']}`"
    lines = [
        "## gptspeed bench tune",
        "",
        environment_line(env),
        "",
        f"Your run: preset {c['preset']}, L={c['n_layer']} H={c['n_head']} C={c['n_embd']}, T={c['seq_len']}, "
        f"B={c['batch_size']} x {c['grad_accum']} micro-batches a step. Measured step: {c['measured_sequences']} "
        f"sequences (the same for every row, regrouped into each row's micro-batch); {c['warmup']} warm-up + "
        f"{c['steps']} timed steps a row, each in a fresh process from the same weights on the same batches; "
        f"data: {data}. Budget {c['budget_s']:g} s ({res['elapsed_s']:.0f} s used" + _state(res) + ").",
        "",
        f"Command: `{env['command']}`",
        "",
        *_resolved(c.get("resolved") or {}),
        "| row | change (from the best so far) | verdict | tokens/s | vs yours | ms/step (IQR) | MFU | peak mem "
        "| loss: max rel. diff vs yours | notes |",
        "|---|---|---|--:|--:|--:|--:|--:|---|---|",
        *(_row(r) for r in rows),
        "",
    ]
    kept = [r for r in rows if r.get("kept") and r["verdict"] != "yours"]
    if kept:
        best = kept[-1]
        lines.append(
            f"**Kept: `{res['best_flags']}`: {best['tokens_per_s']:,.0f} tokens/s, "
            f"{best.get('vs_yours', 1):.3f}x your configuration.**"
        )
    elif res["complete"]:
        lines.append(
            "**Nothing beat your configuration by more than the noise: it is the fastest verified one tried here.**"
        )
    untried = [r["name"] for r in rows if r.get("verdict") == "not tried"]
    if untried:
        lines.append(f"Not tried (budget): {', '.join(untried)}.")
    if res.get("tuned_yaml"):
        lines += ["", f"Train it: `{res['train_command']}`"]
    lines += [
        "",
        "How to read it. Each row is your configuration with the kept changes of the rows above and its own change. "
        "*verified*: its losses over every step stay within the tolerance of the least precise format either run "
        "uses (fp32 1e-4, tf32 2e-3, bf16/fp16 1e-2, fp8 2e-2) of your row's, with no graph break, recompile or "
        "host-device sync beyond the step's design. *kept*: verified and faster than the best so far by more than "
        f"{100 * res['config']['min_gain']:.0f}% and more than either row's step-time spread (IQR). *does not fit*: "
        "out of device memory. *not applicable*: a rule of gptspeed's refuses it for your run (the same line "
        "`gptspeed train` would print), or it cannot gain here (said before the row, not run). *duplicate*: "
        "the best configuration already resolves to it here (e.g. `--sdpa-backend auto` ran that kernel): "
        "not run. The knobs are tried by expected gain per second of row: "
        + ", ".join(k["name"] if isinstance(k, dict) else str(k) for k in c.get("knobs", []))
        + " (priors and sources in tune.json's config.knobs). tokens/s from the median timed step; peak mem: "
        + ("peak allocated by PyTorch on the GPU." if env["device_type"] == "cuda" else "the process's peak RSS."),
    ]
    return "\n".join(lines) + "\n"

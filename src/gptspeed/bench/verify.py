"""``gptspeed bench verify``: does every rung train correctly here, and how fast? One command.

For every rung -- the ladder's stages (:data:`gptspeed.bench.stages.STAGES`, with their cumulative
settings) and the verify-only alternatives (:data:`~gptspeed.bench.stages.VERIFY_EXTRAS`: fp16 with
a GradScaler, other torch.compile modes) -- :func:`run_verify` trains the same short trajectory in a
fresh process (:mod:`gptspeed.bench.verify_worker`): same initial weights, same batches, the preset's
micro-batch (or ``--batch-size``), ``--grad-accum`` micro-batches per step (default 2, so the
accumulation path that real training takes is exercised). Then, per rung:

- **loss**: every step's loss against the fp32 reference's (``baseline``: fp32, eager, manual
  attention; ``baseline-muon`` for rungs that train with Muon -- the optimizer changes the
  mathematics, precision and kernels must not), max over steps of the relative difference, within
  :func:`gptspeed.bench.stages.loss_rtol` (fp32 1e-4, tf32 2e-3, bf16 / fp16 1e-2, fp8 2e-2, or the
  optimizer's own when looser: Muon declares bf16's, as its Newton-Schulz runs in bf16);
- **host-device syncs** per steady step (CUDA only) against the step's design (:func:`sync_budget`);
- **graph breaks and recompiles** (compiled rungs): must be 0;
- tokens/s, MFU, peak memory, and which SDPA kernel ran.

A rung that crashes or runs out of memory is recorded as failed with its reason and the others
still run; a rung that cannot run on this device is skipped with the reason; a rung a rule of
gptspeed's refuses before it starts (the CUDA-graph compile modes with gradient accumulation, FP8
at a width where no layer would convert) is *refused*, with the rule's reason -- not a failure, and
not a gap in what was verified. The verdict is VERIFIED when every rung that ran is within its
tolerance (and at least one was compared).

Which rungs: by default the seeds' rungs (:data:`~gptspeed.bench.stages.SEED_STAGES`, fp32 ..
fused AdamW, whose last rung is ``gptspeed train``'s default on CUDA: every switch of the default,
one at a time) -- about 6 minutes on one H100 at GPT-2 124M, an estimate (docs/gpus.md); ``--stages
all`` runs every rung, ``--stages a,b`` the ones named. The rungs of one run share one fresh
TorchInductor / Triton cache (:func:`gptspeed.bench.ladder.run_worker`'s ``cache_dir``): a rung whose
graphs match an earlier rung's (fused AdamW's model is vocab-pad's; Muon's is fused-ce's) loads them
instead of compiling again, and kernels common to several graphs are compiled once.

``verify.md`` and ``verify.json`` (environment: device, driver, CUDA, torch, commit, command) are
written after every rung, each atomically (a temporary file, then a rename), so a run cut short
keeps every finished rung (``complete`` false, the rest ``pending``); the table is printed at the end.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gptspeed.bench import report
from gptspeed.bench.ladder import base_spec, run_worker
from gptspeed.bench.settings import Staged
from gptspeed.bench.stages import (
    ALL_STAGES,
    BASELINE,
    LOSS_RTOL,
    SEED_STAGES,
    STAGE_NAMES,
    STAGES,
    VERIFY_EXTRA_NAMES,
    VERIFY_EXTRAS,
    loss_rtol,
    parse_stage_list,
    plan_ladder,
    record,
    switches,
)
from gptspeed.errors import GptspeedError
from gptspeed.parallelize import cuda_graphs_refusal

REFERENCE = "baseline"
DEFAULT_GRAD_ACCUM = 2
DEFAULT_RUNGS = SEED_STAGES  # without --stages: the seeds' rungs, i.e. train's default switches one at a time
NOT_SELECTED = "not selected (--stages)"
NOT_IN_DEFAULT = (
    f"not in the default rung set (the seeds' rungs, {DEFAULT_RUNGS[0]} .. {DEFAULT_RUNGS[-1]}); "
    f"--stages {ALL_STAGES} runs every rung"
)
REFUSED = "refused: "  # how a refusal's reason starts (the plan's, and a verify worker's GptspeedError)
PENDING = "pending: not run yet (the command was cut before this rung, or is still running)"


@dataclass(kw_only=True)
class VerifyConfig(Staged):
    """What ``gptspeed bench verify`` was asked (its flags: :mod:`gptspeed.bench.settings`); ``stages``
    None: the seeds' rungs (:data:`DEFAULT_RUNGS`), ``grad_accum`` None: :data:`DEFAULT_GRAD_ACCUM`."""


def select_rungs(stages: str | None) -> tuple[list[str] | None, str]:
    """``--stages`` of ``bench verify``: ``(selected names or None for every rung, the reason the
    others are not run)``. None: :data:`DEFAULT_RUNGS`; ``all``: every rung; else the names given.
    GptspeedError for an unknown name."""
    if stages is None:
        return list(DEFAULT_RUNGS), NOT_IN_DEFAULT
    return parse_stage_list(stages, STAGE_NAMES + VERIFY_EXTRA_NAMES), NOT_SELECTED


@dataclass
class Rung:
    """One row of the verify plan. ``settings`` (the run configuration's, by name) is None when it
    does not run (``skip_reason`` says why); ``reference`` names the rung its losses are compared
    with (None: not compared, ``not_compared`` says why, or it is a reference itself)."""

    name: str
    kind: str  # stage | extra | reference
    description: str
    source: str
    settings: dict[str, Any] | None
    skip_reason: str | None = None
    reference: str | None = None
    not_compared: str | None = None
    applies_here: bool = True  # False: the device cannot run it at all (not a gap in what was verified)


def reference_settings(s: dict[str, Any]) -> dict[str, Any]:
    """The fp32 reference a rung is compared with: the baseline, except in the settings that change
    what is computed rather than how precisely or how fast -- the optimizer."""
    return {**BASELINE, **{k: s[k] for k in ("optimizer",) if k in s}}


def _fixed_batch(settings: dict[str, Any] | None) -> dict[str, Any] | None:
    """``settings`` without ``--batch-size auto``: the rung keeps the fixed micro-batch."""
    return None if settings is None else {k: v for k, v in settings.items() if k != "batch_size"}


def plan_verify(
    device,
    selected: list[str] | None = None,
    compile_backend: str = "inductor",
    grad_accum: int = DEFAULT_GRAD_ACCUM,
    unselected: str = NOT_SELECTED,
) -> list[Rung]:
    """Every ladder stage and every :data:`VERIFY_EXTRAS` rung, in order, with the settings it
    runs with on ``device`` (``--batch-size auto`` only on the ``batch-auto`` rung itself: the others
    keep the fixed micro-batch), the references they need inserted after ``baseline``, and a skip
    reason for each rung that does not apply or is not in ``selected`` (``unselected`` says why).

    Every rung that runs is compared with its fp32 reference -- ``batch-auto`` too: it keeps the
    global batch (B x ``grad_accum`` sequences per step) and regroups the same sequences into its
    own micro-batch (:func:`gptspeed.bench.verify_worker.regroup`), so each step sees the same tokens.

    A rung gptspeed would refuse with ``grad_accum`` micro-batches per step -- the CUDA-graph
    compile modes (:func:`gptspeed.parallelize.cuda_graphs_refusal`) -- is planned as "refused: ..."
    before anything runs, on every device (on one without CUDA it does not apply either)."""
    ladder = plan_ladder(device, None, compile_backend)
    by_name = {p.stage.name: p for p in ladder}
    rungs: list[Rung] = []
    for p in ladder:
        st = p.stage
        settings = p.settings if st.name == "batch-auto" else _fixed_batch(p.settings)
        rungs.append(
            Rung(
                st.name, "stage", st.description, st.source, settings, p.skip_reason, applies_here=settings is not None
            )
        )
    for st in VERIFY_EXTRAS:
        base = by_name[st.base].settings
        reason = st.applies(device, compile_backend)
        if reason is None and base is None:
            reason = f"its base rung {st.base} does not run here ({by_name[st.base].skip_reason})"
        settings = None if reason else {**_fixed_batch(base), **st.delta}
        rungs.append(
            Rung(st.name, "extra", st.description, st.source, settings, reason, applies_here=settings is not None)
        )
    stages = {st.name: st for st in (*STAGES, *VERIFY_EXTRAS)}
    for r in rungs:
        refusal = cuda_graphs_refusal(stages[r.name].delta.get("compile_tuning", "default"), grad_accum)
        if refusal:
            where = "" if r.applies_here else f" (and on {device.type} it does not apply: {r.skip_reason})"
            r.settings, r.skip_reason = None, f"{REFUSED}{refusal}{where}"

    for r in rungs:
        if r.settings is not None and selected is not None and r.name not in selected:
            r.skip_reason = unselected
    refs: dict[str, Rung] = {}
    for r in rungs:
        if r.settings is None or r.skip_reason is not None or r.name == REFERENCE:
            continue
        ref = reference_settings(r.settings)
        name = REFERENCE if record(ref) == record(BASELINE) else f"{REFERENCE}-{ref['optimizer']}"
        r.reference = name
        if name != REFERENCE and name not in refs:
            refs[name] = Rung(
                name,
                "reference",
                f"the fp32 reference for rungs that train with {ref['optimizer']}",
                "fp32, eager, manual attention, vocab 50257, plain loss",
                ref,
            )
    base = rungs[0]
    needed = any(r.reference == REFERENCE for r in rungs)
    if base.skip_reason is not None and needed:
        base.skip_reason = None
        base.not_compared = "run as the reference (not selected)"
    return [base, *refs.values(), *rungs[1:]]


def compare_losses(row: dict[str, Any], ref: dict[str, Any], rtol: float) -> dict[str, Any]:
    """Compare a rung's per-step losses with its reference's.

    Steps are compared up to and including the first one that either run did not apply (a
    GradScaler overflow skip, a non-finite step): until then both have applied the same updates
    to the same weights. Returns ``{"max_rel_diff", "at_step", "steps_compared", "rtol", "ok",
    "ref_loss_first", "ref_loss_last", "loss_at_worst", "ref_at_worst", "note"}``; a non-finite
    loss counts as an infinite difference.
    """
    a, b = row["losses"], ref["losses"]
    skip_a, skip_b = row.get("skipped", [False] * len(a)), ref.get("skipped", [False] * len(b))
    n = min(len(a), len(b))
    first_skip = next((i for i in range(n) if skip_a[i] or skip_b[i]), None)
    upto = n if first_skip is None else first_skip + 1
    rel = [
        abs(x - y) / abs(y) if math.isfinite(x) and math.isfinite(y) and y != 0 else math.inf
        for x, y in zip(a[:upto], b[:upto])
    ]
    worst = max(range(upto), key=lambda i: rel[i])
    note = ""
    if first_skip is not None:
        note = f"compared up to step {first_skip}, the first step not applied (of {n})"
    moved = b[0] - min(b[:upto]) if all(math.isfinite(v) for v in b[:upto]) else math.inf
    if moved < 5 * rtol * abs(b[0]):
        note = (note + "; " if note else "") + (
            f"the reference's loss moved only {moved:.3f} over the compared "
            "steps: agreement says little (use --data or more --steps)"
        )
    return {
        "max_rel_diff": rel[worst],
        "at_step": worst,
        "steps_compared": upto,
        "rtol": rtol,
        "ok": rel[worst] <= rtol,
        "loss_at_worst": a[worst],
        "ref_at_worst": b[worst],
        "ref_loss_first": b[0],
        "ref_loss_last": b[upto - 1],
        "note": note,
    }


def rung_problems(row: dict[str, Any]) -> list[str]:
    """Why a rung that ran fails verification (empty: verified). Checks the loss comparison, steps
    not applied (other than a GradScaler's overflow skips), graph breaks, recompiles, and host-device
    syncs above the step's budget."""
    if row["status"] == "failed":
        return [f"failed: {row['reason']}"]
    if row["status"] != "ok":
        return []
    out = []
    check = row.get("loss_check")
    if check is not None and not check["ok"]:
        out.append(
            f"loss {check['loss_at_worst']:.5f} vs {row['reference']}'s {check['ref_at_worst']:.5f} at step "
            f"{check['at_step']}: {check['max_rel_diff']:.1e} relative, tolerance {check['rtol']:.0e}"
        )
    skipped = [i for i, s in enumerate(row.get("skipped", [])) if s]
    if skipped and not row.get("grad_scaler"):
        out.append(f"step(s) {', '.join(map(str, skipped[:5]))} not applied: non-finite loss or gradient")
    c = row.get("compile")
    if c:
        if c["graph_breaks"]:
            out.append(f"{c['graph_breaks']} graph break(s): {'; '.join(c['graph_break_reasons'][:2])}")
        if c["recompiles"]:
            out.append(f"{c['recompiles']} recompile(s): {'; '.join(c['recompile_reasons'][:2])}")
    syncs = row.get("syncs") or {}
    if syncs.get("counted") and syncs["per_step"] > syncs["budget"]:
        where = next(iter(syncs.get("sites") or {}), "a C++ / backward thread")
        out.append(
            f"{syncs['per_step']:g} host-device syncs per step, designed for {syncs['budget']} (e.g. at {where})"
        )
    return out


MIN_STEPS_COMPARED = 2  # one step compares only the initial weights' forward: no update is checked


def rung_verdict(row: dict[str, Any]) -> tuple[str, str]:
    """``(verdict, why)`` of one rung after :func:`rung_problems`: ``failed`` (a problem);
    ``verified`` (ran, its losses agreed with its reference over at least
    :data:`MIN_STEPS_COMPARED` steps, no problem); ``refused`` (a rule of gptspeed's refused it
    before it started -- the CUDA-graph modes with accumulation, FP8 with no layer to convert: not a
    failure, and nothing ran to verify); ``not verified`` -- it ran but what it did was not checked:
    not compared (its reference did not run), or too few steps compared (a GradScaler skip at step
    0) -- with ``why``; ``reference`` (the fp32 rungs the others are compared with); ``skipped``
    (does not apply to this device, or not selected); ``pending`` (not run yet: a run cut short)."""
    if row["problems"]:
        return "failed", "; ".join(row["problems"])
    if row["status"] == "pending":
        return "pending", row["reason"]
    if row["status"] == "skipped":
        reason = row["reason"]
        if reason.startswith(REFUSED):
            return "refused", reason.removeprefix(REFUSED)
        if reason in (NOT_SELECTED, NOT_IN_DEFAULT) or not row.get("applies_here", True):
            return "skipped", reason
        return "not verified", reason
    check = row.get("loss_check")
    if check is None:
        if row.get("kind") == "reference" or row["name"] == REFERENCE:
            return "reference", row.get("not_compared") or "the reference"
        return "not verified", row.get("not_compared") or "not compared"
    if check["steps_compared"] < MIN_STEPS_COMPARED:
        return "not verified", (
            f"only {check['steps_compared']} step(s) compared ({check['note'] or 'too few steps'}): "
            "no update checked; run more --steps or --warmup"
        )
    return "verified", ""


def assess(plan: list[Rung], rows: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Compare every rung that ran with its reference and give each row its ``loss_check``,
    ``problems``, ``verdict`` and ``verdict_reason`` (in place; rows still ``pending`` keep that
    verdict). Returns the run's verdict: ``{"verdict", "ok", "failing", "not_verified", "refused",
    "pending", "problems", "unverified"}``. ``verified`` when no rung failed, every rung that ran was
    verified and at least one was; ``incomplete`` while rungs are pending and nothing failed."""
    for r in plan:
        row = rows[r.name]
        if row["status"] != "ok":
            continue
        ref = rows.get(r.reference) if r.reference else None
        if r.reference is None:
            row["loss_check"] = None
            row["not_compared"] = r.not_compared or "the reference"
        elif ref is None or ref["status"] != "ok":
            row["loss_check"] = None
            row["not_compared"] = f"not compared: the reference {r.reference} did not run ({ref and ref['status']})"
        else:
            row["loss_check"] = compare_losses(row, ref, loss_rtol(r.settings))
    for row in rows.values():
        row["problems"] = rung_problems(row)
        row["verdict"], row["verdict_reason"] = rung_verdict(row)
    named = lambda verdict: [name for name, row in rows.items() if row["verdict"] == verdict]  # noqa: E731
    failing, not_verified, refused, pending = named("failed"), named("not verified"), named("refused"), named("pending")
    if failing:
        verdict = "failed"
    elif pending:
        verdict = "incomplete"
    elif not_verified or not named("verified"):
        verdict = "not verified"
    else:
        verdict = "verified"
    return {
        "verdict": verdict,
        "ok": verdict == "verified",
        "failing": failing,
        "not_verified": not_verified,
        "refused": refused,
        "pending": pending,
        "problems": [f"{name}: {p}" for name in failing for p in rows[name]["problems"]],
        "unverified": [f"{name}: {rows[name]['verdict_reason']}" for name in not_verified],
        "refusals": [f"{name}: {rows[name]['verdict_reason']}" for name in refused],
    }


def _planned_row(r: Rung) -> dict[str, Any]:
    """A rung's row before it runs: ``skipped`` with its reason, or ``pending``."""
    row: dict[str, Any] = {
        "name": r.name,
        "kind": r.kind,
        "description": r.description,
        "source": r.source,
        "settings": record(r.settings) if r.settings else None,
        "switches": switches(record(r.settings)) if r.settings else None,
        "reference": r.reference,
        "applies_here": r.applies_here,
    }
    if r.skip_reason is not None:
        return {**row, "status": "skipped", "reason": r.skip_reason}
    return {**row, "status": "pending", "reason": PENDING}


def run_verify(cfg: VerifyConfig, command: str = "") -> dict[str, Any]:
    """Run every selected rung of :func:`plan_verify` (:func:`select_rungs`: by default the seeds'
    rungs) in its own process, compare, and write ``verify.md`` and ``verify.json`` into
    ``cfg.out`` after every rung (atomically; ``complete`` is False until the last), printing the
    table at the end. The rungs share one fresh compile cache. Returns the report (as in
    verify.json): ``ok`` is False and ``failing`` names the rungs when any rung failed
    verification; ``refused`` names the rungs a rule refused (not failures).

    Raises GptspeedError for bad flags, before anything runs.
    """
    import shutil
    import tempfile

    import torch

    accum = DEFAULT_GRAD_ACCUM if cfg.grad_accum is None else cfg.grad_accum
    spec0 = dataclasses.replace(base_spec(cfg), mode="verify", grad_accum=accum, synthetic="phrases")
    selected, unselected = select_rungs(cfg.stages)
    device = torch.device(spec0.device)
    plan = plan_verify(device, selected, cfg.compile_backend, accum, unselected)
    to_run = [r for r in plan if r.skip_reason is None]
    if selected is not None and not any(r.name in selected for r in to_run):
        reasons = "; ".join(f"{r.name}: {r.skip_reason}" for r in plan if r.name in selected)
        raise GptspeedError(f"none of the selected rungs runs on {device.type} ({reasons})")
    out = report.make_out_dir(cfg.out)

    env = report.environment(device, command)
    rows = {r.name: _planned_row(r) for r in plan}
    config = _verify_config(cfg, spec0)

    def save(complete: bool) -> tuple[dict[str, Any], str]:
        res = {
            "format": "gptspeed-verify",
            "format_version": 2,
            "environment": env,
            "config": config,
            "tolerances": LOSS_RTOL,
            "complete": complete,
            "rungs": list(rows.values()),
            **assess(plan, rows),
        }
        table = verify_markdown(res)
        report.write_text_atomic(out / "verify.md", table)
        report.write_text_atomic(out / "verify.json", json.dumps(res, indent=2) + "\n")
        return res, table

    cache = Path(tempfile.mkdtemp(prefix="gptspeed-verify-cache-"))
    try:
        save(False)
        for i, r in enumerate(to_run, 1):
            _run_rung(r, f"[{i}/{len(to_run)}]", rows[r.name], spec0, out, cfg.stage_timeout, cache)
            save(False)
    finally:
        shutil.rmtree(cache, ignore_errors=True)
    final, table = save(True)
    print(table, end="")
    return final


def _verify_config(cfg: VerifyConfig, spec0) -> dict[str, Any]:
    """verify.json's ``config``: the flags, and what the rungs ran with (the preset's shape filled in)."""
    return {
        **dataclasses.asdict(cfg),
        **{
            k: getattr(spec0, k)
            for k in ("n_layer", "n_head", "n_embd", "seq_len", "batch_size", "lr", "data", "warmup", "steps")
        },
        "grad_accum": spec0.grad_accum,
        "device": spec0.device,
        "rungs": "the default set (the seeds' rungs)" if cfg.stages is None else cfg.stages,
        "compile_cache": "one fresh TorchInductor/Triton cache shared by this run's rungs",
    }


def _run_rung(r: Rung, counter: str, row: dict[str, Any], spec0, out: Path, timeout: float | None, cache: Path) -> None:
    """Run rung ``r`` in its own process (:func:`run_worker`, sharing the compile ``cache``) and record its
    result in ``row``, saying its progress."""
    report.say(f"{counter} {r.name}: {switches(record(r.settings))}")
    spec = dataclasses.replace(spec0, name=r.name, settings=r.settings)
    row.update(reason=None)
    row.update(run_worker(spec, out / "logs" / f"{r.name}.log", timeout, cache_dir=cache))
    if row["reason"] is None:
        del row["reason"]
    report.say("    " + _progress(row))


# ------------------------------------------------------------------------------------ bench verify
def _verdict(r: dict[str, Any]) -> str:
    return {"failed": "**FAILED**", "not verified": "*not verified*", "pending": "*pending*"}.get(
        r["verdict"], r["verdict"]
    )


def _loss_cell(r: dict[str, Any]) -> str:
    if r["status"] != "ok":
        return "—"
    check = r.get("loss_check")
    if check is None:
        return r.get("not_compared") or "—"
    return (
        f"{check['max_rel_diff']:.1e} at step {check['at_step']} vs {r['reference']} "
        f"(≤ {check['rtol']:.0e}; {check['steps_compared']} steps)"
    )


def _sync_cell(r: dict[str, Any]) -> str:
    s = r.get("syncs")
    if r["status"] != "ok" or not s:
        return "—"
    if not s["counted"]:
        return f"not counted (GPU only; budget {s['budget']})"
    return f"{s['per_step']:g} (budget {s['budget']})"


def _compile_cell(r: dict[str, Any]) -> str:
    c = r.get("compile")
    if r["status"] != "ok":
        return "—"
    if c is None:
        return "eager"
    return f"{c['graph_breaks']} / {c['recompiles']}"


def _sdpa_cell(r: dict[str, Any]) -> str:
    if r["status"] != "ok":
        return "—"
    if (r.get("settings") or {}).get("attention") != "sdpa":
        return "manual attention"
    sdpa = r.get("sdpa") or {}
    return sdpa.get("backend") or "no SDPA op in the profile"


def _verify_notes(r: dict[str, Any]) -> str:
    if r["verdict"] in ("refused", "pending"):
        return report.table_cell(r["verdict_reason"])
    if r["status"] != "ok":
        return report.table_cell(f"{r['status']}: {r['reason']}")
    notes = list(r["problems"])
    if r["verdict"] == "not verified" and r["verdict_reason"] != r.get("not_compared"):
        notes.append(r["verdict_reason"])
    check = r.get("loss_check") or {}
    if check.get("note"):
        notes.append(check["note"])
    if r.get("grad_scaler") and any(r.get("skipped", [])):
        notes.append(f"GradScaler skipped {sum(r['skipped'])} step(s) (float16 overflow, by design)")
    if r.get("batch_size") is not None and (r.get("settings") or {}).get("batch_auto"):
        notes.append(
            f"--batch-size auto chose B={r['batch_size']} ({r.get('grad_accum')} micro-batch(es) per step, "
            "the same sequences per step as its reference)"
        )
    return report.table_cell("; ".join(notes))


def _summary_line(result: dict[str, Any]) -> str:
    """The verdict and the count of each kind of rung, in bold, naming the failing, unverified and refused ones."""
    count = {v: sum(1 for r in result["rungs"] if r["verdict"] == v) for v in ("verified", "not verified", "skipped")}
    return (
        f"**{result['verdict'].upper()}: {count['verified']} verified, {count['not verified']} not verified, "
        f"{len(result['failing'])} failing, {len(result['refused'])} refused by a rule before they started, "
        f"{count['skipped']} skipped (do not apply here or not selected)"
        + (f", {len(result['pending'])} pending (not run yet)" if result["pending"] else "")
        + ".**"
        + (f" Failing: {', '.join(result['failing'])}." if result["failing"] else "")
        + (f" Not verified: {', '.join(result['not_verified'])}." if result["not_verified"] else "")
        + (f" Refused: {', '.join(result['refused'])}." if result["refused"] else "")
    )


def verify_markdown(result: dict[str, Any]) -> str:
    """``bench verify``'s report as Markdown: environment and command, one row per rung (verdict,
    switches, loss agreement with the fp32 reference, syncs per step, graph breaks / recompiles,
    SDPA kernel, tokens/s, MFU, peak memory), the failing rungs, and how to read it."""
    env, c, rungs = result["environment"], result["config"], result["rungs"]
    data = "synthetic phrases (learnable random token phrases)" if c["data"] is None else f"`{c['data']}`"
    tol = result["tolerances"]
    lines = [
        "## gptspeed bench verify",
        "",
        report.environment_line(env),
        "",
        f"Model: preset {c['preset']}, L={c['n_layer']} H={c['n_head']} C={c['n_embd']}; B={c['batch_size']}, "
        f"T={c['seq_len']}, {c['grad_accum']} micro-batches per step; data: {data}; {c['warmup']} warm-up + "
        f"{c['steps']} steady steps per rung, each rung in a fresh process from the same weights on the same batches.",
        "",
        f"Command: `{env['command']}`",
        "",
        "| rung | switches | verdict | loss: max rel. diff vs fp32 reference | syncs/step | graph breaks / recompiles "
        "| SDPA kernel | tokens/s | MFU | peak mem | notes |",
        "|---|---|---|---|--:|--:|---|--:|--:|--:|---|",
    ]
    for r in rungs:
        ok = r["status"] == "ok"
        mfu = "—" if not ok or r.get("mfu") is None else f"{100 * r['mfu']:.1f}%"
        tps = f"{r['tokens_per_s']:,.0f}" if ok else "—"
        lines.append(
            f"| {r['name']} | {r.get('switches') or '—'} | {_verdict(r)} | {report.table_cell(_loss_cell(r))} "
            f"| {_sync_cell(r)} "
            f"| {_compile_cell(r)} | {_sdpa_cell(r)} | {tps} | {mfu} "
            f"| {report.fmt_bytes(r.get('peak_mem_bytes')) if ok else '—'} | {_verify_notes(r)} |"
        )
    lines += ["", _summary_line(result)]
    mfu_note = next((r["peak_flops_source"] for r in rungs if r["status"] == "ok" and r.get("mfu") is None), None)
    lines += [
        "",
        "How to read it. *loss*: the largest relative difference between this rung's per-step loss and its fp32 "
        "reference's (`baseline`; `baseline-muon` for Muon rungs) over the same steps, against the tolerance of "
        f"the rung's least precise format (fp32 {tol['float32']:.0e}, tf32 {tol['tf32']:.0e}, bf16 "
        f"{tol['bfloat16']:.0e}, fp16 {tol['float16']:.0e}, fp8 {tol['fp8']:.0e}; or the optimizer's own when looser: "
        "Muon's is bf16's, its Newton-Schulz runs in bf16). *syncs/step*: synchronising "
        'CUDA calls per steady step under `torch.cuda.set_sync_debug_mode("warn")`; the budget is the step\'s '
        "design (0 with fused AdamW, 1 otherwise); a CPU runs synchronously, so there it is not counted. *graph "
        "breaks / recompiles*: TorchDynamo's own counters over the whole run, both must be 0. *SDPA kernel*: the "
        "attention operator a profiled step ran. tokens/s from the median steady step; peak mem: "
        + ("peak allocated by PyTorch on the GPU." if env["device_type"] == "cuda" else "the process's peak RSS.")
        + (f" MFU: {mfu_note}." if mfu_note else ""),
    ]
    if result["problems"]:
        lines += ["", "**Problems:**", ""] + [f"- {p}" for p in result["problems"]]
    if result["unverified"]:
        lines += ["", "**Not verified:**", ""] + [f"- {p}" for p in result["unverified"]]
    if result["refusals"]:
        lines += [
            "",
            "**Refused** (a rule of gptspeed's, before the rung started; `gptspeed train` refuses the same "
            "settings in one line):",
            "",
        ] + [f"- {p}" for p in result["refusals"]]
    return "\n".join(lines) + "\n"


def _progress(row: dict[str, Any]) -> str:
    if row["status"] != "ok":
        return f"{row['status']}: {row['reason']}"
    return (
        f"{row['ms_median']:.1f} ms/step, {row['tokens_per_s']:,.0f} tokens/s, loss {row['losses'][0]:.4f} -> "
        f"{row['losses'][-1]:.4f}"
    )

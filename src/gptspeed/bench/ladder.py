"""``gptspeed bench``: run the ladder (or profile one row), each row in a fresh process.

:func:`run_ladder` plans the rows (:func:`gptspeed.bench.stages.plan_ladder`), runs every selected,
applicable one with :mod:`gptspeed.bench.worker` in a new Python process with an empty compile
cache, then the peer row (transformers' GPT-2 with the last row's settings), checks that all
step-0 losses agree, and writes ``ladder.md``, ``ladder.json`` and ``ladder.png``
(:mod:`gptspeed.bench.report`). :func:`profile_stage` traces one row with torch.profiler.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gptspeed
from gptspeed.bench import report
from gptspeed.bench.settings import COMPILE_BACKENDS, Rows, Staged
from gptspeed.bench.stages import (
    BASELINE,
    STAGE_NAMES,
    differences,
    loss_rtol,
    parse_stage_list,
    plan_ladder,
    record,
    stage_settings,
    switches,
)
from gptspeed.bench.worker import PEER_KIND, StageSpec
from gptspeed.config import _f, preset
from gptspeed.errors import GptspeedError
from gptspeed.model import GPTConfig

PEER_NAME = "hf-gpt2"
PEER_DESCRIPTION = "transformers GPT2LMHeadModel, attn_implementation='sdpa', vocab 50257, its own loss"
PEER_SOURCE = "the baseline's optimizer (AdamW) and model; dtype, compile and fused AdamW as"


def peer_settings(last: dict[str, Any]) -> dict[str, Any]:
    """The peer row's settings: the baseline's (its optimizer, eager per-model compile, no FP8, the
    given micro-batch, vocabulary 50257 and the plain loss, as transformers' GPT-2 has them) with the
    dtype, compile and fused-AdamW settings of ``last`` (the last row that runs) and SDPA attention
    (transformers' ``attn_implementation="sdpa"``). Only switches that apply to any model carry over:
    Muon's parameter groups, FP8's layer filter and per-block compile are written for gptspeed's
    module names."""
    return {**BASELINE, **{k: last[k] for k in ("dtype", "compile", "fused_adamw")}, "attention": "sdpa"}


@dataclass(kw_only=True)
class BenchConfig(Staged):
    """What ``gptspeed bench ladder`` was asked (its flags: :mod:`gptspeed.bench.settings`). Shape fields
    left None come from the preset; ``stages`` None: every rung."""

    peers: bool = _f(True, "leave out the transformers GPT-2 row", flag="--no-peers", kind="off")


@dataclass(kw_only=True)
class ProfileConfig(Rows):
    """What ``gptspeed bench profile STAGE`` was asked: the row to trace and its traced steps."""

    stage: str = _f(dataclasses.MISSING, f"the row to trace: a stage or {PEER_NAME}", positional=True, metavar="STAGE")
    steps: int = _f(3, "traced steps, after the warm-up")


def base_spec(cfg: Rows) -> StageSpec:
    """Validate the flags (GptspeedError, one line) and return the spec every row starts from."""
    from gptspeed.runtime import resolve_device

    p = preset(cfg.preset)
    pick = lambda v, d: d if v is None else v  # noqa: E731
    shape = GPTConfig(
        n_layer=pick(cfg.n_layer, p.model.n_layer),
        n_head=pick(cfg.n_head, p.model.n_head),
        n_embd=pick(cfg.n_embd, p.model.n_embd),
        block_size=pick(cfg.seq_len, p.model.block_size),
    )
    shape.validate()
    batch = pick(cfg.batch_size, p.train.batch_size)
    if batch < 1:
        raise GptspeedError(f"--batch-size must be at least 1, got {batch}")
    if cfg.steps < 1:
        raise GptspeedError(f"--steps must be at least 1, got {cfg.steps}")
    if cfg.warmup < 1:
        raise GptspeedError(f"--warmup must be at least 1 (the first step compiles and allocates), got {cfg.warmup}")
    if cfg.grad_accum is not None and cfg.grad_accum < 1:
        raise GptspeedError(f"--grad-accum must be at least 1, got {cfg.grad_accum}")
    if cfg.peak_tflops is not None and not cfg.peak_tflops > 0:
        raise GptspeedError(f"--peak-tflops must be positive, got {cfg.peak_tflops}")
    if cfg.stage_timeout is not None and not cfg.stage_timeout > 0:
        raise GptspeedError(f"--stage-timeout must be positive, got {cfg.stage_timeout}")
    if cfg.compile_backend not in COMPILE_BACKENDS:
        raise GptspeedError(
            f"--compile-backend must be one of {', '.join(COMPILE_BACKENDS)}, got {cfg.compile_backend!r}"
        )
    if cfg.synthetic == (cfg.data is not None):
        raise GptspeedError(
            "give either --data DIR (a folder from `gptspeed prepare`) or --synthetic (random tokens), "
            "not both or neither"
        )
    data = None
    if cfg.data is not None:
        from gptspeed.data import find_shards
        from gptspeed.data.loader import TokenLoader

        TokenLoader(find_shards(cfg.data, "train"), batch, shape.block_size)  # GptspeedError if too small
        data = str(Path(cfg.data).resolve())
    device = resolve_device(cfg.device)
    return StageSpec(
        name="",
        settings=dict(BASELINE),
        n_layer=shape.n_layer,
        n_head=shape.n_head,
        n_embd=shape.n_embd,
        seq_len=shape.block_size,
        batch_size=batch,
        steps=cfg.steps,
        warmup=cfg.warmup,
        device=device.type,
        seed=cfg.seed,
        lr=p.optim.lr,
        data=data,
        compile_backend=cfg.compile_backend,
        peak_tflops=cfg.peak_tflops,
        grad_accum=cfg.grad_accum or 1,
    )


def _worker_env(cache_dir: Path) -> dict[str, str]:
    """The worker's environment: this checkout's ``src`` first on PYTHONPATH, and TorchInductor's
    and Triton's caches under ``cache_dir`` (the FX-graph cache on, as
    :func:`gptspeed.parallelize.use_compile_cache` turns it on for ``train``)."""
    env = dict(os.environ)
    src = str(Path(gptspeed.__file__).resolve().parent.parent)
    env["PYTHONPATH"] = src + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env["TORCHINDUCTOR_CACHE_DIR"] = str(cache_dir / "inductor")
    env["TRITON_CACHE_DIR"] = str(cache_dir / "triton")
    env["TORCHINDUCTOR_FX_GRAPH_CACHE"] = "1"
    return env


def _last_line(text: str) -> str:
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    line = lines[-1] if lines else "no output"
    return line if len(line) <= 300 else line[:297] + "..."


def run_worker(
    spec: StageSpec,
    log_path: Path,
    timeout: float | None = None,
    cache_dir: Path | None = None,
    stop: Callable[[], bool] | None = None,
) -> dict[str, Any]:
    """Run one row in a fresh ``python -m gptspeed.bench`` process; its output goes to
    ``log_path``. Returns the worker's result (``status`` ok or skipped) or ``{"status":
    "failed", "reason": ...}`` with the last line it printed.

    ``cache_dir`` None: a fresh, empty compile cache for this row alone (the ladder: no kernel
    compiled by an earlier row is reused, so its warm-up seconds are its own compile's); a folder:
    that cache, shared with the other rows given it (``bench verify``: a graph an earlier rung
    compiled is loaded, not compiled again)."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix="gptspeed-bench-"))
    try:
        spec_path, result_path = tmp / "spec.json", tmp / "result.json"
        spec_path.write_text(json.dumps(spec.to_dict()))
        with open(log_path, "w") as log:
            proc = subprocess.Popen(
                [sys.executable, "-m", "gptspeed.bench", str(spec_path), str(result_path)],
                stdout=log,
                stderr=subprocess.STDOUT,
                env=_worker_env(cache_dir or tmp),
            )
            try:
                _wait_or_stop(proc, timeout, stop)
            except subprocess.TimeoutExpired:
                return {
                    "status": "failed",
                    "reason": f"timed out after {timeout:g} s (--stage-timeout); log {log_path}",
                }
            finally:
                if proc.poll() is None:  # a second Ctrl-C, any failure here: no worker outlives its row
                    proc.kill()
                    proc.wait()
        if stop is not None and stop():
            return {"status": "stopped", "reason": "stopped by a signal before it finished"}
        if proc.returncode != 0 or not result_path.exists():
            line = _last_line(log_path.read_text(errors="replace")).removeprefix("gptspeed bench: error: ")
            return {"status": "failed", "reason": f"{line} (exit {proc.returncode}; log {log_path})"}
        return json.loads(result_path.read_text())
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _wait_or_stop(proc: subprocess.Popen, timeout: float | None, stop: Callable[[], bool] | None) -> None:
    """Wait for ``proc``; ``subprocess.TimeoutExpired`` past ``timeout`` s. Once ``stop()`` says True (a stop
    signal: ``bench tune``'s Ctrl-C), the row is ended: SIGTERM, then SIGKILL after 5 s (a row has nothing
    to save)."""
    t0 = time.monotonic()
    while True:
        try:
            proc.wait(timeout=0.1)
            return
        except subprocess.TimeoutExpired:
            pass
        if stop is not None and stop():
            proc.terminate()
            try:
                proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            return
        if timeout is not None and time.monotonic() - t0 > timeout:
            raise subprocess.TimeoutExpired(proc.args, timeout)


def spread_ms(row: dict[str, Any]) -> float:
    """A row's spread of step times, ms: the interquartile range of its timed steps (``ms_q75 -
    ms_q25``; min–max if the quartiles are missing). The IQR, not min–max, because one step
    descheduled on a busy machine stretches min–max without saying anything about the typical step."""
    if row.get("ms_q25") is not None and row.get("ms_q75") is not None:
        return row["ms_q75"] - row["ms_q25"]
    return row.get("ms_max", row["ms_median"]) - row.get("ms_min", row["ms_median"])


def check_rows(rows: list[dict[str, Any]]) -> None:
    """Add switches, speed-ups, noise flags and the step-0 loss check to the rows that ran, in place.

    ``switches``: every switch the row ran with (:func:`gptspeed.bench.stages.switches` of its
    recorded ``settings``).
    ``speedup_prev``: ms/step of the previous row that ran / this row's -- only when the two rows
    differ by exactly one switch (``credited_to`` names it); otherwise None and ``speedup_prev_na``
    says by what they differ (rows are cumulative: with stages deselected or skipped, or for the peer
    row, the previous row is not this one minus one technique). ``noise``: when the spread of either
    row (:func:`spread_ms`) is wider than the gap between their medians, ``{"gap_ms", "spread_ms"}``
    -- the speed-up is then within noise -- else None. ``speedup_baseline``: the first row that ran
    (baseline unless deselected) / this row's, i.e. every switch of this row together.
    ``loss_check``: this row's step-0 loss against the first row's, relative, within the looser
    tolerance of the two rows (:func:`gptspeed.bench.stages.loss_rtol`; step 0 comes before any
    optimizer step, so the optimizer's own tolerance plays no part).
    """
    ran = [r for r in rows if r["status"] == "ok"]
    if not ran:
        return
    ref, prev = ran[0], None
    for r in ran:
        settings = r.get("settings") or {}
        r["switches"] = switches(settings) if settings else None
        r.update(speedup_prev=None, speedup_prev_na=None, credited_to=None, noise=None)
        if prev is not None:
            diff = differences(prev.get("settings") or {}, settings)
            if r.get("kind") != prev.get("kind"):
                diff = ["implementation (peer)", *diff]
            if len(diff) == 1:
                r["speedup_prev"], r["credited_to"] = prev["ms_median"] / r["ms_median"], diff[0]
                gap, spread = abs(prev["ms_median"] - r["ms_median"]), max(spread_ms(prev), spread_ms(r))
                if spread > gap:
                    r["noise"] = {"gap_ms": gap, "spread_ms": spread}
            else:
                r["speedup_prev_na"] = f"n/a (differs from the previous row by: {', '.join(diff) or 'nothing'})"
        r["speedup_baseline"] = ref["ms_median"] / r["ms_median"]
        rtol = max(
            loss_rtol(row.get("settings") or {"dtype": row.get("dtype", "float32")}, updates=False) for row in (r, ref)
        )
        l0, l_ref = r["loss_step0"], ref["loss_step0"]
        rel = abs(l0 - l_ref) / abs(l_ref) if math.isfinite(l0) and math.isfinite(l_ref) else math.inf
        r["loss_check"] = {"reference": ref["name"], "rel_diff": rel, "rtol": rtol, "ok": rel <= rtol}
        prev = r


def _planned_rows(plan, spec0: StageSpec, peers: bool) -> tuple[list[dict[str, Any]], list[tuple[dict, StageSpec]]]:
    """The ladder's rows before they run (``skipped`` with the reason, or ``pending``), and the
    ``(row, spec)`` of each one to run, the peer row last when ``peers``."""
    rows: list[dict[str, Any]] = []
    jobs: list[tuple[dict[str, Any], StageSpec]] = []
    for p in plan:
        row: dict[str, Any] = {
            "name": p.stage.name,
            "kind": "stage",
            "description": p.stage.description,
            "source": p.stage.source,
            "settings": record(p.settings) if p.settings else None,
        }
        if p.skip_reason is not None:
            rows.append({**row, "status": "skipped", "reason": p.skip_reason})
            continue
        rows.append({**row, "status": "pending", "reason": "not run yet"})
        jobs.append((rows[-1], dataclasses.replace(spec0, name=p.stage.name, settings=p.settings)))
    if peers:
        last = [p for p in plan if p.skip_reason is None][-1]
        settings = peer_settings(last.settings)
        row = {
            "name": PEER_NAME,
            "kind": "peer",
            "description": PEER_DESCRIPTION,
            "source": f"{PEER_SOURCE} {last.stage.name}",
            "settings": record(settings),
            "status": "pending",
            "reason": "not run yet",
        }
        rows.append(row)
        jobs.append((row, dataclasses.replace(spec0, name=PEER_NAME, kind=PEER_KIND, settings=settings)))
    return rows, jobs


def run_ladder(cfg: BenchConfig, command: str = "") -> dict[str, Any]:
    """Run the ladder and write ``ladder.md``, ``ladder.json`` and ``ladder.png`` into ``cfg.out``;
    print the Markdown table on stdout (progress on stderr). ``ladder.md`` and ``ladder.json`` are
    written after every row too (atomically; ``complete`` False and the rows to come ``pending``
    until the last), so a command cut at its limit keeps every finished row. Returns the report (as
    in ladder.json); ``report["ok"]`` is False when a row failed or its step-0 loss disagrees.

    Raises GptspeedError for bad flags (before anything runs).
    """
    import torch

    spec0 = base_spec(cfg)
    selected = parse_stage_list(cfg.stages)
    device = torch.device(spec0.device)
    plan = plan_ladder(device, selected, cfg.compile_backend)
    to_run = [p for p in plan if p.skip_reason is None]
    if not to_run:
        reasons = "; ".join(f"{p.stage.name}: {p.skip_reason}" for p in plan if p.stage.name in (selected or ()))
        raise GptspeedError(f"none of the selected stages runs on {device.type} ({reasons})")
    out = report.make_out_dir(cfg.out)

    env = report.environment(device, command)  # before the rows run: the date is the start
    n_runs = len(to_run) + int(cfg.peers)
    rows, jobs = _planned_rows(plan, spec0, cfg.peers)

    def result(complete: bool) -> dict[str, Any]:
        done = [dict(r) for r in rows]
        check_rows(done)
        problems = [f"{r['name']}: failed: {r['reason']}" for r in done if r["status"] == "failed"]
        problems += [
            f"{r['name']}: step-0 loss {r['loss_step0']:.6f} differs from {r['loss_check']['reference']}'s by "
            f"{r['loss_check']['rel_diff']:.2e} relative (tolerance {r['loss_check']['rtol']:.0e})"
            for r in done
            if r["status"] == "ok" and not r["loss_check"]["ok"]
        ]
        return {
            "format": "gptspeed-ladder",
            "format_version": 1,
            "environment": env,
            "config": {
                **dataclasses.asdict(cfg),
                **{
                    k: getattr(spec0, k) for k in ("n_layer", "n_head", "n_embd", "seq_len", "batch_size", "lr", "data")
                },
                "device": spec0.device,
                "stage_order": list(STAGE_NAMES),
            },
            "complete": complete,
            "rows": done,
            "ok": complete and not problems,
            "problems": problems,
        }

    report.write_partial(result(False), out)
    for i, (row, spec) in enumerate(jobs, 1):
        report.say(f"[{i}/{n_runs}] {row['name']}: {row['description']}")
        del row["reason"]
        row.update(run_worker(spec, out / "logs" / f"{row['name']}.log", cfg.stage_timeout))
        report.say("    " + report.progress_line(row))
        report.write_partial(result(False), out)
    final = result(True)
    report.write_outputs(final, out)
    return final


def profile_stage(cfg: ProfileConfig) -> dict[str, Any]:
    """Trace ``cfg.steps`` steps of one row (after the warm-up) with torch.profiler, in a fresh
    process: writes ``trace-NAME.json`` (Chrome trace), ``profile-NAME.txt`` (top ops by self
    time) and ``profile-NAME-breakdown.json`` / ``.md`` (the step's time by category:
    :mod:`gptspeed.bench.breakdown`) into ``cfg.out`` and prints the tables. ``cfg.stage`` is a stage or
    ``hf-gpt2``.

    Raises GptspeedError for bad flags, an unknown stage, one that does not apply, or a failed run.
    """
    import torch

    spec0, name = base_spec(cfg), cfg.stage
    device = torch.device(spec0.device)
    if name == PEER_NAME:
        last = [r.settings for r in plan_ladder(device, None, cfg.compile_backend) if r.settings is not None][-1]
        settings, kind = peer_settings(last), PEER_KIND
    elif name in STAGE_NAMES:
        settings, kind = stage_settings(name, device, cfg.compile_backend), "gptspeed"
    else:
        raise GptspeedError(f"unknown stage to profile {name!r}: choose from {', '.join(STAGE_NAMES + (PEER_NAME,))}")
    out = report.make_out_dir(cfg.out)
    spec = dataclasses.replace(spec0, name=name, kind=kind, settings=settings, profile_dir=str(out.resolve()))
    report.say(f"profiling {name} ({spec.warmup} warm-up + {spec.steps} traced steps) on {device.type}")
    result = run_worker(spec, out / "logs" / f"profile-{name}.log", cfg.stage_timeout)
    if result["status"] != "ok":
        raise GptspeedError(f"profiling {name} {result['status']}: {result['reason']}")
    print(result["profile_table"])
    print(f"Chrome trace: {result['trace']} (open in ui.perfetto.dev or chrome://tracing)")
    print(result["breakdown_table"] + f"(also in {result['breakdown']} and {result['breakdown_md']})")
    return result

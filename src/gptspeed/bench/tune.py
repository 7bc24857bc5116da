"""``gptspeed bench tune``: the fastest configuration of *your* run that trains the same, found on
this device, and written as a ``--config`` file.

Your run is what ``gptspeed train`` would run: a preset, a ``--config`` file and flags. Every
candidate is that configuration with a delta (:mod:`gptspeed.bench.knobs`), trained in a fresh
process by ``bench verify``'s worker (:mod:`gptspeed.bench.verify_worker`): from the same initial
weights, on the same batches, an untimed warm-up (compilation included), then timed steps; its
losses over every step are compared with your configuration's own row as ``--verify`` compares a
rung with its reference (:func:`gptspeed.bench.verify.compare_losses`, the tolerance of the least
precise format either runs in; graph breaks, recompiles and host-device syncs above the step's
design count as failures too).

The measured step holds ``sequences`` sequences (your micro-batch times a divisor of your gradient
accumulation: up to 8 micro-batches on CUDA, 2 elsewhere), so every candidate micro-batch reads the
same sequences, regrouped (:func:`gptspeed.bench.verify_worker.regroup`); tokens/s are per measured
step, the same tokens for every row. The search is greedy (the seeds' habit: one change at a time,
kept when it is faster, the batch raised again after a saving): each knob's values are tried from
the best configuration so far, in the order of :func:`gptspeed.bench.knobs.knobs_for` (by expected
gain per second of row), and the fastest verified one is kept when it beats the best by more than
:data:`MIN_GAIN` and more than the two rows' step-time spread; every micro-batch that fits is
compared, not only the first that gains. A candidate that runs out of memory is a row "does not
fit"; one a rule of gptspeed's refuses (checked on your whole run: its global batch, device,
toolchain) is "not applicable"; a crash is "failed" -- the search goes on. A candidate that changes
nothing as the best configuration resolves here is a "duplicate", reported and never run: ``auto``
settings are resolved first, ``--sdpa-backend auto`` to the kernel your row's profile saw run
(:func:`gptspeed.bench.checks.sdpa_backend`), before any SDPA candidate is tried.

Every row compiles into one shared compile cache (``TORCHINDUCTOR_CACHE_DIR``, the FX-graph cache on:
:func:`gptspeed.bench.ladder.run_worker`), so a row whose graphs agree with an earlier row's (the same
graph, shapes and inductor options: e.g. a ``--threads`` row on a CPU) loads them instead of compiling
again; the cache is removed at the end.

``--budget-s`` bounds the whole search: a candidate starts only while the budget holds at least
half the time your row took, and runs with what is left as its timeout; the rest are listed as
"not tried". ``tune.json`` and ``tune.md`` are written after every row, atomically; ``tuned.yaml``
(your configuration with the kept deltas, as ``--print-config`` writes it, on the data and device the
tune measured) at the end, with the command that trains it.

Nothing of yours is written over: ``--out`` is locked for the search (one tune at a time), an earlier
tune's files are replaced only with ``--force`` and a file of those names no tune wrote never
(:func:`open_tune_folder`). A stop signal ends the running row and keeps the rows so far, marked
interrupted (:class:`TuneStopped`: the command exits 128 + the signal).
"""

from __future__ import annotations

import dataclasses
import json
import math
import shutil
import signal
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from time import monotonic
from typing import Any, ClassVar

from gptspeed.bench import report
from gptspeed.bench.knobs import Delta, Knob, TuneState, knobs_for
from gptspeed.bench.ladder import run_worker, spread_ms
from gptspeed.bench.settings import Workload
from gptspeed.bench.stages import loss_rtol
from gptspeed.bench.verify import compare_losses, rung_problems
from gptspeed.bench.worker import StageSpec
from gptspeed.config import GROUPS, RunConfig, _f, config_to_yaml, setting_flag
from gptspeed.errors import GptspeedError

MIN_GAIN = 0.01  # a candidate is kept only when at least 1% faster (and faster than the rows' spread)
STEP_FACTOR = {"cuda": 8}  # micro-batches of your size in the measured step at most: 8 on CUDA, else 2
# Settings the tune's rows do not take from your configuration: the worker sets them (device, seed, peak,
# the batch) or they have no meaning in one process (parallelism)
NOT_PASSED = frozenset(
    {"device", "seed", "peak_tflops", "parallel", "dist_timeout_s", "batch_size", "total_batch_tokens"}
)
YOURS = "yours"
#: :func:`gptspeed.bench.checks.sdpa_backend`'s names -> ``--sdpa-backend``'s
SDPA_KERNELS = {"cudnn": "cudnn", "flash": "flash", "mem-efficient": "efficient", "math": "math"}
#: the settings a row's report resolves for your run (``auto`` and unset: what ran here)
RESOLVED = ("dtype", "compile", "loss", "sdpa_backend", "coordinate_descent_tuning")


@dataclass(kw_only=True)
class TuneConfig(Workload):
    """What ``gptspeed bench tune`` was asked: ``run`` is your configuration (validated; the CLI makes it
    of ``--preset``, ``--config``, the shape flags and ``--flags``, as ``gptspeed train`` would:
    :mod:`gptspeed.bench.cli`), ``data`` a prepared folder (None: learnable synthetic phrases),
    ``budget_s`` the search's wall-clock bound. The shape, preset and file fields are the flags
    ``run`` was made of; the search reads ``run``."""

    PRESET_WHEN_UNSET: ClassVar[str | None] = None  # your --config file's preset:, else gpt2 (train's rule)

    run: RunConfig = field(metadata={"cli": False})
    config_file: str | None = _f(None, "your run's gptspeed train --config file (YAML or JSON)", flag="--config")
    flags: str = _f(
        "",
        'your run\'s other gptspeed train flags, quoted: --flags "--dtype bfloat16 --loss fused" '
        "(one flag alone: --flags=--no-compile)",
        metavar='"FLAGS"',
    )
    budget_s: float = _f(
        300.0,
        "seconds the whole search may take; the candidates left are listed as not tried",
        min=0,
        min_open=True,
        finite=True,
        text="a positive finite number of seconds",
    )
    steps: int = _f(8, "timed steps per candidate")
    force: bool = _f(
        False,
        "replace an earlier tune's tune.md, tune.json and tuned.yaml in --out (never files of those names it did "
        "not write)",
        kind="flag",
    )


def run_settings(cfg: RunConfig) -> dict[str, Any]:
    """Your configuration's settings a row trains with: every model, optimizer and runtime setting
    (flat, by name) but those the worker sets itself (:data:`NOT_PASSED`); ``--parallel fsdp`` is kept,
    as FSDP2 runs in the worker's one process."""
    out = {}
    for group in ("model", "optim", "runtime"):
        for f in dataclasses.fields(GROUPS[group]):
            if f.name not in NOT_PASSED and f.metadata.get("cli", True):
                out[f.name] = getattr(cfg.groups()[group], f.name)
    if cfg.runtime.parallel == "fsdp":  # FSDP2 runs in one process too (--cast-weights-once needs it)
        out["parallel"] = "fsdp"
    return out


def measured_sequences(cfg: RunConfig, device_type: str) -> int:
    """Sequences of the measured step: your micro-batch times the largest divisor of your gradient
    accumulation that is at most :data:`STEP_FACTOR` (so it divides your global batch)."""
    accum = cfg.grad_accum_steps(1)
    factor = max(d for d in range(1, STEP_FACTOR.get(device_type, 2) + 1) if accum % d == 0)
    return cfg.train.batch_size * factor


def applied(user: RunConfig, best: dict[str, Any], delta: Delta) -> RunConfig:
    """Your configuration with ``best`` and ``delta`` applied, validated as ``train`` validates it:
    the whole run's rules (its global batch, FP8's shapes, ...). GptspeedError when it refuses."""
    cfg = user.override({**best, **delta})
    cfg.validate(world_size=1)
    return cfg


def rule_refusal(user: RunConfig, best: dict[str, Any], delta: Delta) -> str | None:
    """Why gptspeed would refuse your run with ``delta`` before it starts (one line), or None: the
    configuration's own rules, and CUDA graphs with your run's gradient accumulation (the measured
    step may have fewer micro-steps than your run; your run's count decides)."""
    from gptspeed.parallelize import cuda_graphs_refusal

    try:
        cfg = applied(user, best, delta)
        accum = cfg.grad_accum_steps(1)
    except GptspeedError as e:
        return str(e)
    return cuda_graphs_refusal(cfg.runtime.compile_tuning, accum, cfg.tokens_per_micro_batch)


def auto_settings(cfg: RunConfig, device) -> dict[str, Any]:
    """What ``--dtype`` and ``--compile`` of ``cfg`` resolve to on ``device`` (``gptspeed train``'s
    rule, :func:`gptspeed.runtime.resolve_runtime`): the knobs read the value a run really has."""
    from gptspeed.runtime import resolve_runtime

    r = cfg.runtime
    rt = resolve_runtime(device.type, r.dtype, r.compile, planned_steps=cfg.train.max_steps)
    return {"dtype": rt.dtype, "compile": rt.compile}


def describe(delta: Delta) -> str:
    """A delta as the flags that set it: ``--batch-size 32 --loss fused``."""
    parts = []
    for k, v in delta.items():
        flag = setting_flag(k)
        parts.append(flag if v is True else f"--no-{flag[2:]}" if v is False else f"{flag} {v}")
    return " ".join(parts) or "(your configuration)"


class Tuner:
    """One ``--tune`` search: the rows, the best settings so far, the budget, and the report."""

    def __init__(self, cfg: TuneConfig, command: str):
        import torch

        from gptspeed.runtime import resolve_device

        self.cfg, self.t0 = cfg, monotonic()
        self.device: torch.device = resolve_device(cfg.device)
        user = cfg.run
        self.state = TuneState(
            self.device, user, {}, measured_sequences(user, self.device.type), auto_settings(user, self.device)
        )
        self.out = report.make_out_dir(cfg.out)
        self.lock = open_tune_folder(self.out, cfg.force)
        self.files: dict[str, str] = {}  # what this tune wrote, name -> sha256 (tune.json's record: --force's marker)
        self.env = report.environment(self.device, command)
        self.rows: list[dict[str, Any]] = []
        self.ref: dict[str, Any] | None = None  # your row's result
        self.resolved: dict[str, Any] = {}  # your run's auto settings as they ran here (after your row)
        self.best_row: dict[str, Any] | None = None
        self.tuned: dict[str, str] = {}  # tuned.yaml's path and the command that trains it, once written
        self.stop, self.interrupted = (lambda: False), None  # the stop signals' flag while searching; its name
        b = user.train.batch_size
        self.spec0 = StageSpec(
            name=YOURS,
            settings=run_settings(user),
            n_layer=user.model.n_layer,
            n_head=user.model.n_head,
            n_embd=user.model.n_embd,
            seq_len=user.model.block_size,
            batch_size=b,
            steps=cfg.steps,
            warmup=cfg.warmup,
            device=self.device.type,
            seed=user.runtime.seed,
            lr=user.optim.lr,
            data=cfg.data,
            compile_backend=cfg.compile_backend,
            peak_tflops=cfg.peak_tflops or user.runtime.peak_tflops,
            mode="verify",
            grad_accum=self.state.sequences // b,
            synthetic="phrases",
            extra={"read_micro_batch": b},
        )

    def left(self) -> float:
        return self.cfg.budget_s - (monotonic() - self.t0)

    # ------------------------------------------------------------------ running and judging one row
    def measure(self, name: str, knob: str, delta: Delta, cache: Path) -> dict[str, Any]:
        """Run one candidate (or your row, ``delta`` empty) and add its row; returns the row."""
        row = {
            "name": name,
            "knob": knob,
            "delta": delta,
            "flags": describe(delta),
            "from": describe(self.state.best),
            "kept": False,
        }
        self.rows.append(row)
        if self.stop():
            self.rows.pop()
            raise TuneStopped(self.stop.signum or signal.SIGINT)
        refusal = rule_refusal(self.cfg.run, self.state.best, delta) if delta else None
        if refusal:
            return self._verdict(row, "not applicable", refusal)
        need = 0.5 * (self.ref or {}).get("wall_s", 0)
        if self.left() < max(need, 5.0):
            return self._verdict(
                row, "not tried", f"--budget-s: {max(0, self.left()):.0f} s left, a row takes ~{need:.0f} s"
            )
        settings = {**self.spec0.settings, **self.state.best, **delta}
        b = settings.pop("batch_size", self.spec0.batch_size)
        spec = dataclasses.replace(
            self.spec0, name=name, settings=settings, batch_size=b, grad_accum=self.state.sequences // b
        )
        report.say(
            f"[{len(self.rows)}] {name}: {row['flags']} (from {row['from']}; {self.left():.0f} s of budget left)"
        )
        t = monotonic()
        timeout = self.left()
        result = run_worker(spec, self.out / "logs" / f"{name}.log", timeout, cache_dir=cache, stop=self.stop)
        row["wall_s"] = monotonic() - t
        if result["status"] == "stopped" or self.stop():
            self._verdict(row, "interrupted", f"stopped by {self.stop.name()} before it finished")
            raise TuneStopped(self.stop.signum or signal.SIGINT)
        self._judge(row, result, cut=row["wall_s"] >= timeout - 1)
        report.say("    " + self._progress(row))
        self.save(complete=False)
        return row

    def _verdict(self, row: dict[str, Any], verdict: str, reason: str = "") -> dict[str, Any]:
        row.update(verdict=verdict, reason=reason)
        self.save(complete=False)
        return row

    def duplicate_row(self, name: str, knob: str, delta: Delta, reason: str) -> dict[str, Any]:
        """A candidate that changes nothing from the best so far (:meth:`TuneState.duplicate`): a row, not run."""
        row = {"name": name, "knob": knob, "delta": delta, "flags": describe(delta), "from": describe(self.state.best)}
        self.rows.append({**row, "kept": False})
        return self._verdict(self.rows[-1], "duplicate", reason)

    def _ran(self, row: dict[str, Any]) -> None:
        """What a row of the best configuration was seen running: the SDPA kernel of ``--sdpa-backend auto``."""
        kernel = SDPA_KERNELS.get(((row.get("sdpa") or {}).get("backend")) or "")
        if kernel and self.state.value("sdpa_backend") == "auto":
            self.state.ran["sdpa_backend"] = kernel

    def _judge(self, row: dict[str, Any], result: dict[str, Any], cut: bool) -> None:
        keep = (
            "ms_median",
            "ms_q25",
            "ms_q75",
            "ms_steps",
            "tokens_per_s",
            "mfu",
            "peak_mem_bytes",
            "mem_total_bytes",
            "first_step_s",
            "batch_size",
            "grad_accum",
            "tokens_per_step",
            "dtype",
            "compile",
            "sdpa",
            "syncs",
            "threads",
            "losses",
            "skipped",
            "grad_scaler",
            "fused_adamw",
            "params",
            "peak_flops_source",
        )
        row.update({k: result[k] for k in keep if k in result}, status=result["status"])
        if result["status"] == "skipped":
            reason = result["reason"].removeprefix("refused: ")
            return self._set(row, "not applicable", reason)
        if result["status"] != "ok":
            if result.get("oom"):
                return self._set(row, "does not fit", result["reason"])
            return self._set(row, "cut by --budget-s" if cut else "failed", result["reason"])
        if self.ref is None:  # your own row: the reference every other row is compared with
            problems = [p for p in rung_problems({**result, "loss_check": None}) if not p.startswith("failed")]
            return self._set(row, YOURS, "; ".join(problems))
        settings = {**self.spec0.settings, **self.state.best, **row["delta"]}
        rtol = max(loss_rtol(settings), loss_rtol(self.spec0.settings))
        row["loss_check"] = compare_losses(result, self.ref, rtol)
        problems = rung_problems({**row, "status": "ok", "reference": YOURS})
        row["problems"] = problems
        self._set(row, "fails verification" if problems else "verified", "; ".join(problems))

    @staticmethod
    def _set(row: dict[str, Any], verdict: str, reason: str) -> None:
        row.update(verdict=verdict, reason=reason)

    def faster(self, row: dict[str, Any]) -> float | None:
        """``row``'s gain in tokens/s over the best row so far when it counts (verified, more than
        :data:`MIN_GAIN` and more than the larger relative spread of the two), else None."""
        best = self.best_row
        if row.get("verdict") != "verified" or best is None:
            return None
        gain = best["ms_median"] / row["ms_median"] - 1
        noise = max(spread_ms(row) / row["ms_median"], spread_ms(best) / best["ms_median"])
        return gain if gain > max(MIN_GAIN, noise) else None

    # ------------------------------------------------------------------ the search
    def run(self) -> dict[str, Any]:
        cache = Path(tempfile.mkdtemp(prefix="gptspeed-tune-cache-"))
        self.stop = tune_stop_flag()
        try:
            mine = self.measure(YOURS, "", {}, cache)
            if mine["verdict"] != YOURS:
                self.save(complete=True)
                raise GptspeedError(
                    f"--tune: your configuration did not run here ({mine['verdict']}: "
                    f"{mine['reason']}); see {self.out}/tune.md"
                )
            self.ref = self.best_row = mine
            mine["kept"] = True
            self._ran(mine)  # auto resolved to what ran, before any knob
            self.resolved = {k: self.state.resolved(k) for k in RESOLVED}
            self.search(cache)
            return self.finish()
        except TuneStopped as e:  # the rows so far kept, marked interrupted; no tuned.yaml (the search did not end)
            self.interrupted = signal.Signals(e.signum).name
            self.save(complete=False)
            raise TuneStopped(
                e.signum, f"{self.out}/tune.json and tune.md hold the {len(self.rows)} rows so far"
            ) from None
        finally:
            self.stop.restore()
            shutil.rmtree(cache, ignore_errors=True)
            self.lock.release()  # the report is written: another tune may take the folder

    def search(self, cache: Path) -> None:
        """Every knob of the device in order, then the micro-batch once more after a later saving."""
        knobs = knobs_for(self.device)
        batch_stopped = False
        won_since = False
        for knob in knobs:
            stopped = self.turn(knob, cache)
            if knob.sizes:
                batch_stopped, won_since = stopped, False
            elif self.rows and any(r["kept"] and r["knob"] == knob.name for r in self.rows):
                won_since = True
        if batch_stopped and won_since:  # a saving since (memory or time): try the next larger micro-batch again
            self.turn(next(k for k in knobs if k.sizes), cache, once=True)

    def turn(self, knob: Knob, cache: Path, once: bool = False) -> bool:
        """Try ``knob``'s values from the best so far (a duplicate is a row, not run); keep the fastest
        verified one that counts (:meth:`faster`). A ``sizes`` knob compares every value until the first
        that does not fit; it returns True when it stopped there."""
        values = knob.values(self.state)
        if isinstance(values, str):
            row = {"name": knob.name, "knob": knob.name, "delta": {}, "flags": "", "kept": False}
            self.rows.append({**row, "from": describe(self.state.best)})
            self._verdict(self.rows[-1], "not applicable", values)
            return False
        winner, gain_best, stopped = None, 0.0, False
        for delta in values[:1] if once else values:
            name = f"{knob.name}={'+'.join(str(v) for v in delta.values())}"
            if (why := self.state.duplicate(delta)) is not None:
                self.duplicate_row(name, knob.name, delta, why)
                continue
            row = self.measure(name, knob.name, delta, cache)
            if knob.sizes and row["verdict"] == "does not fit":  # a larger one would not fit either
                stopped = True
                break
            gain = self.faster(row)
            if gain is not None and gain > gain_best:
                winner, gain_best = row, gain
        if winner is not None:
            self._keep(winner)
        return stopped

    def _keep(self, row: dict[str, Any]) -> None:
        row["kept"] = True
        self.state.best = {**self.state.best, **row["delta"]}
        self.best_row = row
        self._ran(row)

    # ------------------------------------------------------------------ the report
    def result(self, complete: bool) -> dict[str, Any]:
        ref = self.ref
        for r in self.rows:
            if ref and r.get("ms_median"):
                r["vs_yours"] = ref["ms_median"] / r["ms_median"]
        config = config_record(self)
        return {
            "format": "gptspeed-tune",
            "format_version": 1,
            "environment": self.env,
            "config": config,
            "complete": complete,
            "elapsed_s": monotonic() - self.t0,
            "best": self.state.best,
            "best_flags": describe(self.state.best),
            "rows": self.rows,
            "interrupted": self.interrupted,
            **self.tuned,
        }

    def save(self, complete: bool) -> dict[str, Any]:
        res = self.result(complete)
        from gptspeed.bench.tune_report import tune_markdown

        md = tune_markdown(res)
        report.write_text_atomic(self.out / "tune.md", md)
        self.files["tune.md"] = _sha256(md)
        res["files"] = dict(self.files)
        report.write_text_atomic(self.out / "tune.json", json.dumps(res, indent=2, default=_json_value) + "\n")
        return res

    def finish(self) -> dict[str, Any]:
        """Write ``tuned.yaml`` -- your configuration with the kept deltas, on the device and data the tune
        measured (synthetic phrases: your run's data is left as it was, and the command names ``--data``) --
        and the final report."""
        path = self.out / "tuned.yaml"
        measured = {"device": self.device.type}
        if self.cfg.data is not None:
            measured["data"] = str(Path(self.cfg.data).expanduser().absolute())
        text = config_to_yaml(applied(self.cfg.run, self.state.best, {}).override(measured))
        report.write_text_atomic(path, text)
        self.files["tuned.yaml"] = _sha256(text)
        data = "" if self.cfg.data is not None or self.cfg.run.train.data else " --data DATA_DIR"
        self.tuned = {"tuned_yaml": str(path), "train_command": f"gptspeed train --config {path}{data} --out RUN_DIR"}
        return self.save(complete=True)

    def _progress(self, row: dict[str, Any]) -> str:
        if row.get("ms_median") is None:
            return f"{row['verdict']}: {row['reason']}"
        vs = f", {self.ref['ms_median'] / row['ms_median']:.3f}x yours" if self.ref else ""
        return f"{row['verdict']}: {row['tokens_per_s']:,.0f} tokens/s{vs}" + (
            f" ({row['reason']})" if row["reason"] else ""
        )


def config_record(tuner: Tuner) -> dict[str, Any]:
    """tune.json's ``config``: your run's shape and batch, the measured step, the search's settings, the knobs
    tried on this device (priors and sources), and what your run's ``auto`` settings resolved to here."""
    u = tuner.cfg.run
    return {
        "preset": u.preset,
        "n_layer": u.model.n_layer,
        "n_head": u.model.n_head,
        "n_embd": u.model.n_embd,
        "seq_len": u.model.block_size,
        "batch_size": u.train.batch_size,
        "grad_accum": u.grad_accum_steps(1),
        "measured_sequences": tuner.state.sequences,
        "steps": tuner.cfg.steps,
        "warmup": tuner.cfg.warmup,
        "data": tuner.cfg.data,
        "budget_s": tuner.cfg.budget_s,
        "min_gain": MIN_GAIN,
        "knobs": [
            {"name": k.name, "gain": list(k.gain), "cost": k.cost, "source": k.source} for k in knobs_for(tuner.device)
        ],
        "resolved": tuner.resolved,
    }


class TuneStopped(GptspeedError):
    """A stop signal (Ctrl-C, SIGTERM, SIGHUP) ended ``bench tune``: the running row's worker was ended and the
    rows finished so far written, marked interrupted. ``signum``: the signal; the command exits 128 + it."""

    def __init__(self, signum: int, kept: str = ""):
        name = signal.Signals(signum).name
        super().__init__(
            f"tune stopped by {name}" + (f"; {kept} (no tuned.yaml: the search did not end)" if kept else "")
        )
        self.signum = signum


def tune_stop_flag():
    """The stop signals' flag of a search (:class:`gptspeed.signals.StopFlag`, its notice in the tune's words),
    with ``name()``: the signal's name."""
    from gptspeed.signals import StopFlag

    flag = StopFlag(
        say=lambda msg, **_: report.say(msg.strip()), doing="ending the running row and writing the rows so far"
    )
    flag.name = lambda: signal.Signals(flag.signum).name if flag.signum else "a signal"
    return flag


def _sha256(text: str) -> str:
    import hashlib

    return hashlib.sha256(text.encode()).hexdigest()


#: what a tune writes into its --out, beside its row logs (logs/ROW.log)
TUNE_FILES = ("tune.md", "tuned.yaml", "tune.json")


def earlier_tune(out: Path) -> list[str]:
    """The files of :data:`TUNE_FILES` in ``out`` that an earlier tune wrote, recognised by its marker:
    ``tune.json`` a tune's record (``"format": "gptspeed-tune"``), the others the very files it recorded
    (their sha256 in its ``files``). GptspeedError (one line, naming it) for a file of those names that no
    tune wrote -- yours, or an earlier tune's edited since -- which is never written over, even with ``--force``."""
    from gptspeed.fileio import read_user_json

    record: dict[str, Any] = {}
    if (out / "tune.json").exists():
        try:
            record = read_user_json(out / "tune.json", "tune record", max_bytes=1 << 26)
        except GptspeedError:
            record = {}
    ours = record.get("format") == "gptspeed-tune" if isinstance(record, dict) else False
    recorded = (record.get("files") if ours else None) or {}
    found = []
    for name in TUNE_FILES:
        path = out / name
        if not (path.exists() or path.is_symlink()):
            continue
        if name == "tune.json":
            mine = ours and path.is_file() and not path.is_symlink()
        else:
            mine = path.is_file() and not path.is_symlink() and recorded.get(name) == _file_sha256(path)
        if not mine:
            raise GptspeedError(
                f"--out {out} holds {name}, which no earlier tune wrote (or it was changed since): a tune never "
                "writes over it, even with --force; move it away or choose another --out"
            )
        found.append(name)
    return found


def _file_sha256(path: Path) -> str | None:
    try:
        return _sha256(path.read_text())
    except (OSError, UnicodeDecodeError):
        return None


def open_tune_folder(out: Path, force: bool):
    """Lock ``out`` for one tune (a :class:`gptspeed.locks.FolderLock` on its ``.gptspeed.lock``, the run
    folder's lock: a second tune, or a train, on it is refused naming the holder), then clear an earlier
    tune's files (:func:`earlier_tune`): refused without ``force``, removed with it (tune.json last).
    Returns the lock (``release()`` it). GptspeedError, one line, for each refusal."""
    from gptspeed.checkpoint import LOCK_NAME
    from gptspeed.locks import FolderLock

    lock = FolderLock(
        out,
        file=LOCK_NAME,
        busy=lambda holder: (
            f"--out {out} is in use by {holder} (another `gptspeed bench tune`): wait for it to end or stop "
            "it, or choose another --out"
        ),
    ).acquire()
    try:
        found = earlier_tune(out)  # under the lock
        if found and not force:
            raise GptspeedError(
                f"--out {out} holds an earlier tune ({', '.join(found)}): pass --force to replace it, or choose "
                "another --out"
            )
        for name in found:
            (out / name).unlink()
    except BaseException:
        lock.release()
        raise
    return lock


def _json_value(v: Any) -> Any:
    return None if isinstance(v, float) and not math.isfinite(v) else str(v)


#: ``gptspeed train`` flags that are no setting of the run a tune measures (tuned.yaml is trained with its own
#: ``--out``): refused in ``--flags`` or your ``--config``, never written into tuned.yaml
NOT_RUN_SETTINGS = {
    "print_config": "it prints a configuration instead of training",
    "resume": "tuned.yaml starts a new run",
    "force_resume": "tuned.yaml starts a new run",
    "out": "the run folder is given when tuned.yaml is trained (--out RUN_DIR)",
}


def your_run(values: dict[str, Any]) -> tuple[RunConfig, str | None, str]:
    """Your run of ``bench tune``'s parsed flags ``values`` (``--preset``, ``--config``, the shape flags and
    ``--flags``, parsed as ``gptspeed train`` parses them), the data the tune measures (None: synthetic
    phrases) and its device: bench's ``--data`` / ``--device``, else your run's. GptspeedError, one line, for
    ``--flags`` that do not split (an unbalanced quote), a flag that is no setting of the run
    (:data:`NOT_RUN_SETTINGS`), your run's data or device differing from bench's, or ``--synthetic`` with
    your run's data: tuned.yaml describes the run the tune measured."""
    import shlex

    from gptspeed.bench.race import Arm, given_settings
    from gptspeed.configure import config_from_flags

    try:
        flags = shlex.split(values["flags"])
    except ValueError as e:
        raise GptspeedError(
            f"--flags: {e} in {values['flags']!r}: give your run's flags as one quoted argument"
        ) from None
    shape = {"n_layer": "--n-layer", "n_head": "--n-head", "n_embd": "--n-embd", "seq_len": "--seq-len"}
    shape.update(batch_size="--batch-size", preset="--preset", config_file="--config")
    base = [x for name, flag in shape.items() if values.get(name) is not None for x in (flag, str(values[name]))]
    run = config_from_flags([*base, *flags], "bench tune", shown=flags)
    for name, how in given_settings(Arm("run", [*base, *flags])).items():
        if name in NOT_RUN_SETTINGS and (name == "print_config" or getattr(run.train, name)):  # a file's default: fine
            raise GptspeedError(
                f"--flags: {how} is not a setting of the run a tune measures ({NOT_RUN_SETTINGS[name]}): drop it"
            )
    device, mine = values.get("device", "auto"), run.runtime.device
    if mine != "auto" and device not in ("auto", mine):
        raise GptspeedError(
            f"--flags: --device {mine} differs from bench's --device {device}, the device tuned on: give one"
        )
    data, own = values.get("data"), run.train.data or None
    if own and values.get("synthetic"):
        raise GptspeedError(f"--synthetic measures random phrases, but your run trains on --data {own}: drop one")
    if own and data is not None and Path(own).expanduser().resolve() != Path(data).expanduser().resolve():
        raise GptspeedError(f"--flags: --data {own} differs from bench's --data {data}, the data measured: give one")
    if data is None and not values.get("synthetic"):
        if own is None:
            raise GptspeedError(
                "bench tune needs --data DIR (a folder from `gptspeed prepare`, or your run's) or --synthetic"
            )
        data = own
    return run, data, mine if device == "auto" else device


def check_declared(cfg: TuneConfig) -> None:
    """The ranges ``TuneConfig``'s numeric fields declare (:func:`gptspeed.config._f`: ``--budget-s`` positive
    and finite, so ``inf`` or ``nan`` is no budget), checked as ``train``'s settings are. GptspeedError, one line."""
    from gptspeed.config import _check_range

    for f in dataclasses.fields(cfg):
        value = getattr(cfg, f.name)
        if "min" in f.metadata and isinstance(value, (int, float)) and not isinstance(value, bool):
            _check_range(f.metadata.get("flag") or "--" + f.name.replace("_", "-"), value, f.metadata)


def run_tune(cfg: TuneConfig, command: str = "") -> dict[str, Any]:
    """Run ``bench tune`` (module docstring) and return the report as in tune.json, plus
    ``tuned_yaml`` and ``train_command``. GptspeedError (one line) for bad flags, an ``--out`` that
    is a run or data folder or a file (:func:`gptspeed.bench.report.check_out_dir`), or your own
    configuration failing to run here."""
    check_declared(cfg)
    if cfg.steps < 2 or cfg.warmup < 1:
        raise GptspeedError(f"--tune needs --steps 2 or more and --warmup 1 or more (got {cfg.steps}, {cfg.warmup})")
    report.check_out_dir(cfg.out)  # a run folder, a data folder, a file: refused before any work
    return Tuner(cfg, command).run()

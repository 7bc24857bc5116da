"""``bench tune``'s search over a fake worker: knobs, a tune run and its rows, without a process or a model."""

from __future__ import annotations

from gptspeed.bench import tune as tune_mod
from gptspeed.bench.knobs import Knob
from gptspeed.bench.tune import TuneConfig, run_tune


class FakeWorker:
    """``run_worker`` without a process: ms per step 100, times ``factor`` for each (setting, value) the
    candidate has; out of memory from micro-batch ``oom_at``; losses 10 - 0.1 * step, scaled by 1.1 for
    the settings in ``off`` (a candidate that trains differently) and by ``1 + sum`` of the relative
    ``offsets`` of the (setting, value) pairs it has (a candidate whose losses sit near a tolerance); each
    call advances ``clock`` by ``cost`` s. ``sdpa``: the SDPA kernel its profile reports (``sdpa_backend``
    of ``gptspeed.bench.checks``' names) when the row's ``--sdpa-backend`` is ``auto``; ``calls`` and
    ``caches``: each row's spec and compile cache folder, in order."""

    def __init__(self, factors=None, oom_at=None, off=(), refuse=(), cost=1.0, offsets=None, sdpa="flash"):
        self.factors, self.oom_at, self.off, self.refuse, self.cost = factors or {}, oom_at, off, refuse, cost
        self.offsets, self.sdpa = offsets or {}, sdpa
        self.calls, self.caches, self.now = [], [], 0.0

    def clock(self) -> float:
        return self.now

    def __call__(self, spec, log_path, timeout=None, cache_dir=None, stop=None):
        self.calls.append(spec)
        self.caches.append(cache_dir)
        self.now += min(self.cost, timeout) if timeout is not None else self.cost
        s = {**spec.settings, "batch_size": spec.batch_size}
        if timeout is not None and self.cost >= timeout:
            return {"status": "failed", "reason": f"timed out after {timeout:g} s (--stage-timeout)"}
        if self.oom_at and spec.batch_size >= self.oom_at:
            return {"status": "failed", "reason": f"out of memory at B={spec.batch_size}", "oom": True}
        if any(s.get(k) == v for k, v in self.refuse):
            return {"status": "skipped", "reason": "refused: a device rule"}
        ms = 100.0
        for (k, v), f in self.factors.items():
            ms *= f if s.get(k) == v else 1
        n = spec.warmup + spec.steps
        scale = 1.1 if any(s.get(k) == v for k, v in self.off) else 1.0
        scale *= 1 + sum(rel for (k, v), rel in self.offsets.items() if s.get(k) == v)
        kernel = self.sdpa if s.get("sdpa_backend", "auto") == "auto" else s["sdpa_backend"]
        tokens = spec.batch_size * spec.grad_accum * spec.seq_len
        return {
            "status": "ok",
            "losses": [scale * (10 - 0.1 * i) for i in range(n)],
            "skipped": [False] * n,
            "ms_median": ms,
            "ms_q25": ms * 0.998,
            "ms_q75": ms * 1.002,
            "ms_steps": [ms] * spec.steps,
            "tokens_per_s": tokens / ms * 1000,
            "mfu": None,
            "peak_mem_bytes": spec.batch_size << 20,
            "batch_size": spec.batch_size,
            "grad_accum": spec.grad_accum,
            "tokens_per_step": tokens,
            "compile": None,
            "sdpa": {"backend": kernel, "evidence": []},
            "syncs": {"counted": False, "budget": 0},
        }


def knob(name, values, sizes=False):
    return Knob(name, name, "test", values if callable(values) else (lambda state: values), sizes)


def tune(tmp_path, monkeypatch, worker, knobs, flags="", budget_s=1000.0, preset_name="pico"):
    from gptspeed.configure import config_from_flags

    monkeypatch.setattr(tune_mod, "run_worker", worker)
    monkeypatch.setattr(tune_mod, "monotonic", worker.clock)
    monkeypatch.setattr(tune_mod, "knobs_for", lambda device: knobs)
    run = config_from_flags(["--preset", preset_name, *flags.split()], "test")
    return run_tune(TuneConfig(out=str(tmp_path / "tune"), run=run, device="cpu", budget_s=budget_s, steps=3, warmup=1))


def rows(res):
    return {r["name"]: r for r in res["rows"]}

"""``bench --tune``'s search over a fake worker: knobs, a tune run and its rows, without a process or a model."""

from __future__ import annotations

from gptspeed.bench import tune as tune_mod
from gptspeed.bench.knobs import Knob
from gptspeed.bench.tune import TuneConfig, run_tune


def knob(name, values, until_no_gain=False):
    return Knob(name, name, "test", values if callable(values) else (lambda state: values), until_no_gain)


def tune(tmp_path, monkeypatch, worker, knobs, flags="", budget_s=1000.0, preset_name="pico"):
    from gptspeed.configure import config_from_flags

    monkeypatch.setattr(tune_mod, "run_worker", worker)
    monkeypatch.setattr(tune_mod, "monotonic", worker.clock)
    monkeypatch.setattr(tune_mod, "knobs_for", lambda device: knobs)
    run = config_from_flags(["--preset", preset_name, *flags.split()], "test")
    return run_tune(TuneConfig(out=str(tmp_path / "tune"), run=run, device="cpu", budget_s=budget_s, steps=3, warmup=1))


def rows(res):
    return {r["name"]: r for r in res["rows"]}

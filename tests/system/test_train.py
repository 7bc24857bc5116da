"""Training on real text end to end (CPU, tiny models): the val loss falls, and eval and sample read the run."""

from __future__ import annotations

import json
import math

import pytest

from gptspeed.trainer import build_train_config, fit

from support.cli import run_cli, run_main
from support.shapes import TEXT_RUN
from support.training import records

pytestmark = pytest.mark.usefixtures("one_thread")


def test_val_loss_falls_well_below_its_start(shakespeare_data, tmp_path):
    cfg = build_train_config(
        "pico",
        dict(
            TEXT_RUN,
            data=str(shakespeare_data),
            out=str(tmp_path / "run"),
            lr=1.5e-2,
            max_steps=24,
            eval_every=24,
            log_every=8,
        ),
    )
    summary = fit(cfg, echo=False)
    recs = records(tmp_path / "run")
    start = recs[0]["val_loss"]
    assert recs[0]["step"] == 0 and start == pytest.approx(math.log(50257), abs=0.3)
    assert summary["last_val_loss"] < start - 2.5, (start, summary["last_val_loss"])
    assert recs[-1]["step"] == 24 and recs[-1]["val_loss"] == summary["last_val_loss"]


def test_eval_and_sample_commands(shakespeare_data, tmp_path):
    run = tmp_path / "run"
    fit(build_train_config("pico", dict(TEXT_RUN, data=str(shakespeare_data), out=str(run), max_steps=3)), echo=False)
    res = run_main("eval", "--run", str(run), "--data", str(shakespeare_data), "--max-tokens", "2048")
    assert res.returncode == 0, res.stderr
    out = json.loads(res.stdout)
    assert out["step"] == 3 and out["tokens"] == 2048
    assert out["perplexity"] == pytest.approx(math.exp(out["val_loss"]))
    a = run_cli("sample", "--run", str(run), "--prompt", "ROMEO:", "--max-new-tokens", "20", "--seed", "7")
    b = run_main("sample", "--run", str(run), "--prompt", "ROMEO:", "--max-new-tokens", "20", "--seed", "7")
    assert a.returncode == 0, a.stderr
    assert a.stdout.startswith("ROMEO:") and len(a.stdout) > len("ROMEO:") + 5
    assert a.stdout == b.stdout  # same seed, same text

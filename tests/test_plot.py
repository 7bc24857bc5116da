"""Loss-curve pictures (gptspeed.plot)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import matplotlib  # noqa: E402,F401  (the test extra installs it: never skipped)

from gptspeed.errors import GptspeedError  # noqa: E402
from gptspeed.plot import plot_runs, read_metrics  # noqa: E402

from conftest import SRC  # noqa: E402


def write_metrics(run: Path, resumed: bool = False) -> Path:
    run.mkdir(parents=True)
    recs = [{"step": 0, "tokens": 0, "time_s": 0.5, "val_loss": 10.9}]
    recs += [{"step": s, "tokens": 512 * s, "time_s": 1.0 * s, "train_loss": 10 - s / 10} for s in range(1, 11)]
    recs.append({"step": 10, "tokens": 5120, "time_s": 10.5, "train_loss": 9.0, "val_loss": 9.1})
    if resumed:  # the clock restarts at a resume
        recs += [{"step": s, "tokens": 512 * s, "time_s": 1.0 * (s - 10), "train_loss": 9 - s / 100} for s in range(11, 15)]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs) + '{"step": 15, "tok')
    return run


def test_plot_writes_a_png(tmp_path):
    a = write_metrics(tmp_path / "a")
    b = write_metrics(tmp_path / "b", resumed=True)
    out = plot_runs([a, b], tmp_path / "pics" / "loss.png", title="a vs b")
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out.stat().st_size > 10_000
    assert not list((tmp_path / "pics").glob(".*"))


def test_wall_time_is_cumulative_across_resumes(tmp_path):
    records = read_metrics(write_metrics(tmp_path / "r", resumed=True))
    times = [r["time_s"] for r in records]
    assert times == sorted(times) and times[-1] == pytest.approx(10.5 + 4.0)
    assert len(records) == 16  # the cut-off last line is skipped


def test_missing_metrics_is_an_error(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(GptspeedError, match="no metrics.jsonl"):
        plot_runs([tmp_path / "empty"], tmp_path / "x.png")
    env = {**os.environ, "PYTHONPATH": str(SRC), "OMP_NUM_THREADS": "1"}
    res = subprocess.run([sys.executable, "-m", "gptspeed", "plot", str(tmp_path / "nope"), "--out", str(tmp_path / "x.png")],
                         capture_output=True, text=True, env=env, timeout=120)
    assert res.returncode == 2 and "Traceback" not in res.stderr and len(res.stderr.strip().splitlines()) == 1
    assert "does not exist" in res.stderr

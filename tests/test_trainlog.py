"""``gptspeed.trainlog``: what a training run writes and says as it goes -- its metrics records, their
durations from a monotonic clock, and the line that says how the run ended."""

from __future__ import annotations

import json
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from gptspeed.trainer import build_train_config, fit
from gptspeed.trainlog import TrainLog

from support.run_folders import BASE

pytestmark = pytest.mark.usefixtures("one_thread")


def test_durations_come_from_a_monotonic_clock(shakespeare_data, tmp_path, monkeypatch, capsys):
    """A wall clock set back by a day mid-run made time_s negative and the end line say 87600h."""
    real = time.time
    calls = {"n": 0}

    def jumping():
        calls["n"] += 1
        return real() - (86400 if calls["n"] > 3 else 0)

    monkeypatch.setattr(time, "time", jumping)
    run = tmp_path / "run"
    fit(build_train_config("pico", dict(BASE, data=str(shakespeare_data), out=str(run), max_steps=4)))
    times = [json.loads(line)["time_s"] for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert all(t >= 0 for t in times) and times == sorted(times)
    done = [line for line in capsys.readouterr().out.splitlines() if line.startswith("done:")]
    assert done and "h" not in done[0].split(" in ")[1].split(";")[0]  # seconds, not hours


def ended(step, first_step, stopping, summary=None, skipped=0):
    """The lines :meth:`TrainLog.say_end` says for a run at ``step`` that started at ``first_step``."""
    said = []
    trainer = SimpleNamespace(
        step=step,
        skipped_steps=skipped,
        run_dir=Path("runs/r"),
        rt=SimpleNamespace(distributed=False, world_size=1),
        cfg=SimpleNamespace(train=SimpleNamespace(stop_at_val_loss=3.5)),
        say=said.append,
    )
    log = TrainLog(trainer)
    log.wall_start = time.monotonic() - 90
    log.say_end(summary or {}, stopping, first_step)
    return said


@pytest.mark.parametrize("skipped", [0, 2])
def test_the_closing_line_says_how_the_run_ended(skipped):
    """Stopped before its first step: nothing to save; stopped by a signal: where the checkpoint is and
    the command that resumes it; done: the steps of this start, the skipped ones if any, the time, and
    the --stop-at-val-loss target when it was reached."""
    assert ended(5, 5, 15) == ["stopped before the first step: nothing to save"]
    (stopped,) = ended(7, 5, 15)
    assert stopped.startswith("stopped at step 7; checkpoint saved in runs/r. ")
    assert stopped.endswith("Resume with: gptspeed train --out runs/r --resume")
    (done,) = ended(9, 5, None, skipped=skipped)
    also = f" ({skipped} skipped as non-finite in all)" if skipped else ""
    assert done == f"done: 4 steps{also} in 1m30s; checkpoint in runs/r"
    reached, done = ended(9, 0, None, {"reached_target": 9, "last_val_loss": 3.25})
    assert reached == "reached --stop-at-val-loss 3.5: val loss 3.2500 at step 9"
    assert done.startswith("done: 9 steps in ")

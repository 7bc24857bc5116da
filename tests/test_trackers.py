"""``gptspeed.trackers``: experiment trackers: every metrics record also goes to TensorBoard and/or Weights & Biases."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import pytest

from gptspeed.trainer import build_train_config, fit

from support.cli import child_env
from support.shapes import QUICK_RUN
from support.training import records

pytestmark = pytest.mark.usefixtures("one_thread")


HAS_TENSORBOARD = importlib.util.find_spec("tensorboard") is not None


HAS_WANDB = importlib.util.find_spec("wandb") is not None


NO_TENSORBOARD = "the tensorboard package is not installed (pip install -e '.[tensorboard]')"


NO_WANDB = "wandb is not installed (pip install -e '.[wandb]')"


def numeric(record):
    """The fields a tracker receives as numbers: every numeric field but the step (bools as 0/1)."""
    return {k: float(v) for k, v in record.items() if k != "step" and isinstance(v, (int, float))}


@pytest.fixture(scope="module")
def tracked_run(shakespeare_data, tmp_path_factory):
    """A run logged to every tracker installed: 4 steps with checkpoints at 2 and 4, then the step-4
    checkpoint removed and the run resumed from step 2, so steps 3 and 4 are logged twice (W&B in
    offline mode, writing nothing outside the run folder). The folder starts with a stale
    TensorBoard event file beside the config.json an earlier attempt wrote at its start, as one that
    failed before its first checkpoint leaves (TensorBoard events alone are the user's: refused)."""
    run = tmp_path_factory.mktemp("tracked") / "run"
    home = tmp_path_factory.mktemp("wandb-home")
    if HAS_TENSORBOARD:  # left by an attempt that failed before its first checkpoint: hidden by the new run
        from torch.utils.tensorboard import SummaryWriter

        with SummaryWriter(str(run / "tensorboard")) as stale:
            stale.add_scalar("val_loss", 99.0, 0)
            stale.add_scalar("train_loss", 42.0, 1)
    with pytest.MonkeyPatch.context() as mp:
        for name in [k for k in os.environ if k.startswith("WANDB_")]:
            mp.delenv(name)
        mp.setenv("WANDB_MODE", "offline")
        mp.setenv("WANDB_SILENT", "true")
        mp.setenv("WANDB_CONSOLE", "off")
        mp.setenv("WANDB_CONFIG_DIR", str(home))
        mp.setenv("WANDB_CACHE_DIR", str(home))
        mp.setenv("WANDB_DATA_DIR", str(home))
        base = dict(
            QUICK_RUN,
            data=str(shakespeare_data),
            out=str(run),
            max_steps=4,
            save_every=2,
            keep_checkpoints=5,
            log_to="tensorboard,wandb",
            wandb_project="gptspeed-tests",
        )
        cfg = build_train_config("pico", base)
        if HAS_TENSORBOARD:
            (run / "config.json").write_text(json.dumps({**cfg.to_dict(), "derived": {"run_id": "an-earlier-attempt"}}))
        fit(cfg, echo=False)
        first = records(run)
        for path in run.glob("ckpt_00000004.*"):
            path.unlink()
        summary = fit(build_train_config(None, dict(out=str(run), resume=True)), echo=False)
    assert summary["step"] == 4
    return run, first


def wandb_records(run_folder):
    """The records of a W&B offline run folder, read by wandb's own reader of the run's
    transaction log (``wandb leet inspect --json``)."""
    proc = subprocess.run(
        [sys.executable, "-m", "wandb", "leet", "inspect", "--json", str(run_folder)],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "WANDB_MODE": "offline", "WANDB_SILENT": "true"},
    )
    if proc.returncode != 0 and "No such command" in proc.stderr:
        pytest.skip("this wandb has no `wandb leet inspect` (wandb>=0.31) to read an offline run with")
    assert proc.returncode == 0, proc.stderr
    return [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]


@pytest.mark.skipif(not HAS_TENSORBOARD, reason=NO_TENSORBOARD)
def test_tensorboard_events_hold_the_metrics(tracked_run):
    """Read with TensorBoard's own EventAccumulator: every numeric field of every record of
    metrics.jsonl is a scalar of the same name at the record's step, once (the events of the steps
    the resume redid, and the stale ones, are purged), with the value metrics.jsonl has; the
    configuration is there as hyperparameters."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.plugins.hparams import metadata

    run, first = tracked_run
    acc = EventAccumulator(str(run / "tensorboard"), size_guidance={"scalars": 0})
    acc.Reload()
    final = records(run)
    assert [r["step"] for r in final] == [0, 1, 2, 3, 4]
    assert final[3]["time_s"] != first[3]["time_s"]  # redone: the purge has something to remove
    expected: dict[str, dict[int, float]] = {}
    for r in final:
        for k, v in numeric(r).items():
            expected.setdefault(k, {})[r["step"]] = v
    assert set(acc.Tags()["scalars"]) == set(expected)
    for tag, by_step in expected.items():
        events = acc.Scalars(tag)
        assert [e.step for e in events] == sorted(by_step), tag  # each step once
        for e in events:
            assert e.value == pytest.approx(by_step[e.step], rel=1e-6), (tag, e.step)  # float32 in the events
    content = acc.PluginTagToContent("hparams")
    start = metadata.parse_session_start_info_plugin_data(content[metadata.SESSION_START_INFO_TAG])
    assert start.hparams["model.n_embd"].number_value == 32
    assert start.hparams["train.log_to"].string_value == "tensorboard,wandb"


@pytest.mark.skipif(not HAS_WANDB, reason=NO_WANDB)
def test_wandb_offline_run_holds_the_metrics(tracked_run):
    """WANDB_MODE=offline: the run folder holds one W&B offline run per process, both with the run
    id kept in RUN_DIR/wandb_run_id (the resume continued the same W&B run); their history holds
    each record with metrics.jsonl's field names and values, and the configuration is the run's."""
    run, first = tracked_run
    run_id = (run / "wandb_run_id").read_text().strip()
    folders = sorted((run / "wandb").glob("offline-run-*"))
    assert len(folders) == 2 and all(f.name.endswith("-" + run_id) for f in folders)
    final = records(run)
    for folder, want in zip(folders, (first, final[3:])):
        recs = wandb_records(folder)
        head = next(r["run"] for r in recs if r["type"] == "run")
        assert head["run_id"] == run_id and head["project"] == "gptspeed-tests" and head["display_name"] == "run"
        assert head["config"]["update"]["model"]["n_embd"] == 32
        history = [r["history"]["item"] for r in recs if r["type"] == "history"]
        assert len(history) == len(want)
        for got, r in zip(history, want):
            assert got["step"] == r["step"]
            for k, v in r.items():
                if v is not None:
                    assert got[k] == v, (r["step"], k)  # JSON numbers both ways: exact


def test_a_tracker_that_cannot_start_is_one_line(shakespeare_data, tmp_path):
    """TensorBoard missing (its import fails) and W&B not logged in (no API key; or wandb missing):
    one line each on stderr at start, then the run trains to the end, exit 0."""
    run = tmp_path / "run"
    code = (
        "import sys; sys.modules['torch.utils.tensorboard'] = None; from gptspeed.cli import main; "
        "sys.exit(main(sys.argv[1:]))"
    )
    args = [
        "train",
        "--preset",
        "pico",
        "--n-layer",
        "1",
        "--n-embd",
        "32",
        "--seq-len",
        "32",
        "--batch-size",
        "4",
        "--max-steps",
        "2",
        "--eval-tokens",
        "512",
        "--device",
        "cpu",
        "--data",
        str(shakespeare_data),
        "--out",
        str(run),
        "--log-to",
        "jsonl,tensorboard,wandb",
    ]
    env = {k: v for k, v in child_env().items() if not k.startswith("WANDB_")}
    env.update(HOME=str(tmp_path), OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert "Traceback" not in proc.stderr
    assert len(lines) == 2, proc.stderr
    assert lines[0].startswith(
        "gptspeed: --log-to tensorboard: not used (tensorboard cannot be imported -- pip "
        "install 'gptspeed[tensorboard]'"
    )
    assert lines[1].startswith("gptspeed: --log-to wandb: not used (")
    assert records(run)[-1]["step"] == 2
    assert not (run / "wandb_run_id").exists()


def test_a_tracker_failing_mid_run_is_dropped_with_one_line(shakespeare_data, tmp_path, monkeypatch, capsys):
    """A tracker whose log raises at its second record: one line naming the step, no further
    calls, the run goes on to the end and metrics.jsonl has every record; close is still called."""
    from gptspeed import trackers

    calls = {"log": [], "close": 0}

    class Flaky:
        name = "tensorboard"

        def __init__(self, run_dir, config, resume_step):
            assert config["model"]["n_embd"] == 32 and resume_step is None
            self.log_dir = run_dir

        def log(self, record):
            calls["log"].append(record["step"])
            if len(calls["log"]) == 2:
                raise OSError("disk quota exceeded\nsecond line")

        def close(self):
            calls["close"] += 1

    monkeypatch.setitem(trackers.TRACKERS, "tensorboard", Flaky)
    run = tmp_path / "run"
    summary = fit(
        build_train_config(
            "pico", dict(QUICK_RUN, data=str(shakespeare_data), out=str(run), max_steps=4, log_to="tensorboard")
        ),
        echo=False,
    )
    assert summary["step"] == 4 and [r["step"] for r in records(run)] == [0, 1, 2, 3, 4]
    assert calls == {"log": [0, 1], "close": 0}  # dropped: never called again, not closed
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert err == [
        "gptspeed: --log-to tensorboard stopped at step 1 (training goes on): OSError: disk quota "
        "exceeded; metrics.jsonl has every record"
    ]


def test_trackers_are_closed_at_the_end(shakespeare_data, tmp_path, monkeypatch):
    """A tracker that works gets every record, the resume step on --resume, and one close."""
    from gptspeed import trackers

    seen = []

    class Recorder:
        name = "wandb"

        def __init__(self, run_dir, config, resume_step):
            seen.append(("open", resume_step))

        def log(self, record):
            seen.append(record["step"])

        def close(self):
            seen.append("close")

    monkeypatch.setitem(trackers.TRACKERS, "wandb", Recorder)
    run = tmp_path / "run"
    fit(
        build_train_config(
            "pico", dict(QUICK_RUN, data=str(shakespeare_data), out=str(run), max_steps=2, log_to="wandb")
        ),
        echo=False,
    )
    fit(build_train_config(None, dict(out=str(run), resume=True, max_steps=3)), echo=False)
    assert seen == [("open", None), 0, 1, 2, "close", ("open", 2), 3, "close"]

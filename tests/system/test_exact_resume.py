"""Exact resume, end to end: a run stopped (Ctrl-C, SIGKILL at random moments, a checkpoint) and resumed logs the losses of the run that was never stopped."""

from __future__ import annotations

import json
import random
import shutil
import signal
import time

import pytest

from gptspeed.checkpoint import check_checkpoint, list_checkpoints, load_checkpoint
from gptspeed.errors import GptspeedError
from gptspeed.trainer import build_train_config, fit

from support.cli import finish, run_main, start_cli, wait_for_line
from support.runs import TINY, start
from support.settings import TINY as TINY_SETTINGS
from support.training import records, train_losses


def test_sigkill_at_random_moments_then_resume_matches_uninterrupted_run(shakespeare_data, tmp_path):
    """3 SIGKILLs, each after a random number (1-3) of new records and a random part of a step
    (so stepping, logging and saving are all hit), then a resume to the end: the same losses."""
    args = ("--max-steps", "14", "--save-every", "1", "--keep-checkpoints", "2")
    ref = tmp_path / "ref"
    assert run_main("train", *TINY, "--data", str(shakespeare_data), "--out", str(ref), *args).returncode == 0
    run = tmp_path / "run"
    rng = random.Random(4)
    for _attempt in range(3):  # at most 3 steps and a fraction per attempt: the run (14 steps) never ends first
        proc = start(shakespeare_data, run, *args, "--resume")
        lines = [wait_for_line(proc, "| loss ") for _ in range(rng.randint(1, 3))]
        step_s = json.loads((run / "metrics.jsonl").read_text().splitlines()[-1]).get("step_ms", 100) / 1000
        time.sleep(rng.uniform(0.0, step_s))
        assert proc.poll() is None, lines
        proc.kill()  # SIGKILL: no handler runs
        finish(proc)
    final = run_main("train", *TINY, "--data", str(shakespeare_data), "--out", str(run), *args, "--resume")
    assert final.returncode == 0, final.stderr
    assert train_losses(run) == train_losses(ref)  # every step's loss, bit for bit
    for ck in list_checkpoints(run):
        assert check_checkpoint(ck) is None


def test_muon_resume_from_checkpoint_is_bit_identical(shakespeare_data, tmp_path):
    from support.settings import TINY
    from support.training import records

    full = tmp_path / "full"
    base = dict(
        TINY,
        data=str(shakespeare_data),
        max_steps=5,
        save_every=2,
        keep_checkpoints=5,
        eval_every=0,
        optimizer="muon",
        muon_lr=0.02,
    )
    summary = fit(build_train_config("pico", dict(base, out=str(full))), echo=False)
    assert summary["step"] == 5 and summary["interrupted"] is None, summary
    part = tmp_path / "part"
    part.mkdir()
    shutil.copy(full / "ckpt_00000002.pt", part)
    shutil.copy(full / "ckpt_00000002.json", part)
    assert fit(build_train_config(None, dict(out=str(part), resume=True)), echo=False)["step"] == 5
    a = {r["step"]: r for r in records(full)}
    b = {r["step"]: r for r in records(part)}
    for s in range(3, 6):
        assert b[s]["train_loss"] == a[s]["train_loss"], s
    assert b[5]["val_loss"] == a[5]["val_loss"]
    with pytest.raises(GptspeedError, match="optimizer"):  # the other optimizer would not continue the run
        fit(build_train_config(None, dict(out=str(part), resume=True, max_steps=6, optimizer="adamw")), echo=False)


def test_resume_from_checkpoint_is_bit_identical(shakespeare_data, tmp_path):
    full = tmp_path / "full"
    base = dict(TINY_SETTINGS, data=str(shakespeare_data), max_steps=8, save_every=3, keep_checkpoints=5, eval_every=4)
    fit(build_train_config("pico", dict(base, out=str(full))), echo=False)
    # a run that stopped right after its step-3 checkpoint: copy that checkpoint, resume to the end
    part = tmp_path / "part"
    part.mkdir()
    shutil.copy(full / "ckpt_00000003.pt", part)
    shutil.copy(full / "ckpt_00000003.json", part)  # its seal
    summary = fit(build_train_config(None, dict(out=str(part), resume=True)), echo=False)
    assert summary["step"] == 8
    a = {r["step"]: r for r in records(full)}
    b = {r["step"]: r for r in records(part)}
    assert set(b) == set(range(4, 9))
    for s in range(4, 9):
        assert b[s]["train_loss"] == a[s]["train_loss"], s  # bit-identical on CPU
        assert b[s]["documents"] == a[s]["documents"] and b[s]["tokens"] == a[s]["tokens"]
    assert b[8]["val_loss"] == a[8]["val_loss"] and b[4]["val_loss"] == a[4]["val_loss"]


def test_ctrl_c_saves_and_resumes_to_the_same_losses(shakespeare_data, tmp_path):
    args = [
        "train",
        "--preset",
        "pico",
        "--data",
        str(shakespeare_data),
        "--n-layer",
        "2",
        "--n-embd",
        "32",
        "--batch-size",
        "8",
        "--max-steps",
        "10",
        "--log-every",
        "1",
        "--eval-every",
        "0",
        "--save-every",
        "0",
        "--device",
        "cpu",
    ]
    ref = tmp_path / "ref"
    assert run_main(*args, "--out", str(ref)).returncode == 0
    run = tmp_path / "run"
    proc = start_cli(*args, "--out", str(run))
    wait_for_line(proc, "step  3/10")
    proc.send_signal(signal.SIGINT)
    out, err = finish(proc)
    assert proc.returncode == 130, err
    assert "--resume" in out
    stopped = load_checkpoint(list_checkpoints(run)[-1])["step"]
    assert 3 <= stopped < 10
    res = run_main("train", "--out", str(run), "--resume")
    assert res.returncode == 0, res.stderr
    a = {r["step"]: r["train_loss"] for r in records(ref) if "train_loss" in r}
    b = {r["step"]: r["train_loss"] for r in records(run) if "train_loss" in r}
    assert set(b) == set(a)
    assert b == a

"""Runs interrupted from outside: signals, a second Ctrl-C, two writers on one run folder, a shard truncated under the run. Each ends saved, in bounded time, with every checkpoint valid."""

from __future__ import annotations

import shutil
import signal
import subprocess
import time

import pytest

from gptspeed.checkpoint import check_checkpoint, list_checkpoints, load_checkpoint, seal_path

from support.cli import assert_user_error, finish, run_cli, run_main, start_cli, wait_for_line
from support.runs import start
from support.shapes import TEXT_RUN_FLAGS
from support.training import train_losses


@pytest.mark.parametrize("sig,code", [(signal.SIGTERM, 143), (signal.SIGINT, 130), (signal.SIGHUP, 129)])
def test_signal_saves_and_exits_with_its_status(shakespeare_data, tmp_path, sig, code):
    run = tmp_path / "run"
    proc = start(shakespeare_data, run, "--max-steps", "500", "--save-every", "0")
    wait_for_line(proc, "step   2/500")
    proc.send_signal(sig)
    out, err = finish(proc)
    assert proc.returncode == code, err
    assert "Resume with: gptspeed train --out" in out
    (ck,) = list_checkpoints(run)
    assert check_checkpoint(ck) is None and load_checkpoint(ck)["step"] >= 2


def test_a_flood_of_sigterms_is_noted_once_and_the_save_finishes(shakespeare_data, tmp_path):
    """A scheduler repeating SIGTERM while the checkpoint is written: one notice, then the save, the
    resume line and exit 143 (the notice used to be printed ~170 times, and a print interrupted by
    another signal's print killed the process before its resume line)."""
    run = tmp_path / "run"
    proc = start(shakespeare_data, run, "--max-steps", "500", "--save-every", "0")
    wait_for_line(proc, "step   2/500")
    for _ in range(200):
        proc.send_signal(signal.SIGTERM)
        time.sleep(0.002)
    out, err = finish(proc)
    assert proc.returncode == 143, err
    assert out.count("SIGTERM received") == 1 and "Resume with: gptspeed train --out" in out
    assert "Traceback" not in err
    (ck,) = list_checkpoints(run)
    assert check_checkpoint(ck) is None


def test_a_second_ctrl_c_quits_at_once_and_leaves_every_checkpoint_valid(shakespeare_data, tmp_path):
    run = tmp_path / "run"
    proc = start(shakespeare_data, run, "--max-steps", "500", "--save-every", "1")
    wait_for_line(proc, "step   2/500")
    proc.send_signal(signal.SIGINT)
    wait_for_line(proc, "SIGINT received")
    proc.send_signal(signal.SIGINT)  # the second: no waiting for the step and the save
    out, err = finish(proc)
    assert proc.returncode == 130 and "gptspeed train: interrupted" in err, err
    assert "Traceback" not in err
    assert list_checkpoints(run) and all(
        check_checkpoint(ck) is None for ck in list_checkpoints(run) if seal_path(ck).exists()
    )


def test_one_writer_per_run_folder_and_a_killed_writer_never_blocks_resume(shakespeare_data, tmp_path):
    run = tmp_path / "run"
    first = start(shakespeare_data, run, "--max-steps", "500", "--save-every", "1")
    wait_for_line(first, "step   1/500")
    second = run_cli(
        "train", *TEXT_RUN_FLAGS, "--data", str(shakespeare_data), "--out", str(run), "--max-steps", "500", "--resume"
    )  # e.g. a job scheduler that requeues a job still running
    assert_user_error(second, "is being written by pid", "another `gptspeed train`")
    assert f"pid {first.pid}" in second.stderr
    first.kill()  # SIGKILL: the lock file stays, its flock dies with the process
    finish(first)
    assert (run / ".gptspeed.lock").exists()
    last = load_checkpoint(list_checkpoints(run)[-1])["step"]
    res = run_cli("train", "--out", str(run), "--resume", "--max-steps", str(last + 1))
    assert res.returncode == 0, res.stderr
    assert "resumed from step" in res.stdout


def test_a_shard_truncated_under_the_run_is_named_and_the_steps_are_saved(shakespeare_data, tmp_path):
    """The shard is cut while the trainer has it memory-mapped: reading its lost pages was SIGBUS
    (exit -7/135, no message, the steps since the last checkpoint lost). Now one line names the
    shard, the last finished step is saved, and once the shard is back the run resumes."""
    data = tmp_path / "data"
    shutil.copytree(shakespeare_data, data)
    shard = data / "train_000000.bin"
    whole = shard.read_bytes()
    run = tmp_path / "run"
    proc = start(data, run, "--max-steps", "500", "--save-every", "1000")
    wait_for_line(proc, "step   2/500")
    with open(shard, "r+b") as f:  # in place, as a re-prepare or a copy over it would
        f.truncate(1024 + 2 * 8 * 512)  # 8 steps of 512 tokens: a few steps from now
    out, err = finish(proc)
    assert_user_error(
        subprocess.CompletedProcess(proc.args, proc.returncode, out, err),
        "train_000000.bin shrank to 9,216 bytes",
        "was saved: fix the shard",
    )
    (ck,) = list_checkpoints(run)
    step = int(ck.stem.split("_")[1])
    assert check_checkpoint(ck) is None and step >= 2 and f"checkpoint of step {step} was saved" in err
    shard.write_bytes(whole)
    resumed = run_main("train", "--out", str(run), "--resume", "--max-steps", str(step + 2))
    assert resumed.returncode == 0, resumed.stderr
    assert sorted(train_losses(run))[-1] == step + 2


def test_ctrl_c_during_the_first_evaluation_stops_without_finishing_it(shakespeare_data, tmp_path):
    """The val loss before step 1 says it is running, and a Ctrl-C does not wait for it (nor for
    a step): the new run stops with nothing saved and nothing left behind."""
    run = tmp_path / "run"
    proc = start_cli(
        "train",
        "--preset",
        "pico",
        "--data",
        str(shakespeare_data),
        "--out",
        str(run),
        "--eval-tokens",
        "0",
        "--seq-len",
        "16",
        "--batch-size",
        "1",
        "--device",
        "cpu",
    )
    wait_for_line(proc, "step 0: evaluating the val loss")  # ~2,100 batches to go
    proc.send_signal(signal.SIGINT)
    out, err = finish(proc)
    assert proc.returncode == 130, err
    assert "stopped before the first step: nothing to save" in out and "step 0/" not in out
    assert not run.exists()

"""``gptspeed.signals``: signals that stop a run cleanly, in bounded time: Ctrl-C, a scheduler's SIGTERM, a closed terminal's SIGHUP."""

from __future__ import annotations

import os
import signal

from gptspeed.checkpoint import check_checkpoint, list_checkpoints, load_checkpoint
from gptspeed.data.loader import TokenLoader

from support.cli import finish, run_main, start_cli, wait_for_line
from support.training import TINY_MODEL, flags, train_losses

TINY = [
    "--preset",
    "pico",
    *flags(dict(TINY_MODEL, n_layer=2, block_size=64, batch_size=8)),
    "--log-every",
    "1",
    "--eval-every",
    "0",
    "--eval-tokens",
    "512",
    "--device",
    "cpu",
    "--dtype",
    "float32",
    "--no-compile",
]


def test_a_signal_does_not_wait_for_a_long_step_to_finish(shakespeare_data, tmp_path):
    """A step of 4,000 micro-batches (tens of seconds; a GPT-2 step on a CPU is many minutes): a
    SIGTERM as the first step begins stops the run at the next micro-batch, not after the step.
    (It waited for the whole step: a scheduler's SIGKILL 30 s later lost everything since the
    last checkpoint.)"""
    run = tmp_path / "run"
    proc = start_cli(
        "train",
        "--preset",
        "pico",
        *flags(dict(TINY_MODEL, batch_size=1, block_size=16)),
        "--total-batch-tokens",
        str(16 * 4000),
        "--max-steps",
        "2",
        "--eval-tokens",
        "64",
        "--device",
        "cpu",
        "--dtype",
        "float32",
        "--no-compile",
        "--data",
        str(shakespeare_data),
        "--out",
        str(run),
    )
    wait_for_line(proc, "step 0/2 | val")  # the step-0 val loss is printed: the first step begins
    proc.send_signal(signal.SIGTERM)
    out, err = finish(proc, timeout=60)
    assert proc.returncode == 143, err
    assert "leaving this step at its next micro-batch" in out
    assert "stopped before the first step: nothing to save" in out and "step 1/2" not in out
    assert not run.exists()  # a new run that never finished a step leaves nothing behind


def test_a_step_left_by_a_signal_is_redone_on_resume_to_the_same_losses(shakespeare_data, tmp_path, monkeypatch):
    """SIGTERM during the 2nd of step 2's 4 micro-batches: no further micro-batch is read, step 1 is
    saved, and the resumed run's losses equal a run that never stopped, at every step."""
    args = [
        *TINY,
        "--data",
        str(shakespeare_data),
        "--total-batch-tokens",
        str(4 * 8 * 64),
        "--max-steps",
        "3",
        "--save-every",
        "0",
    ]
    ref = tmp_path / "ref"
    assert run_main("train", *args, "--out", str(ref)).returncode == 0
    reads = []
    real = TokenLoader.next_batch

    def next_batch(self):
        reads.append(self.batches)
        if len(reads) == 6:  # step 2's 2nd micro-batch
            os.kill(os.getpid(), signal.SIGTERM)
        return real(self)

    monkeypatch.setattr(TokenLoader, "next_batch", next_batch)
    handlers = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGHUP)}
    try:
        res = run_main("train", *args, "--out", str(tmp_path / "run"))
    finally:
        for s, h in handlers.items():  # a stopped run leaves SIGTERM / SIGHUP ignored until its process exits
            signal.signal(s, h)
    assert res.returncode == 143, res.stderr
    assert len(reads) == 6, reads  # nothing read after the micro-batch the signal arrived in
    assert "step 2 was left after 2 of its 4 micro-batches: a resume redoes it" in res.stdout
    assert "stopped at step 1; checkpoint saved" in res.stdout
    (ck,) = list_checkpoints(tmp_path / "run")
    assert check_checkpoint(ck) is None and load_checkpoint(ck)["step"] == 1
    monkeypatch.setattr(TokenLoader, "next_batch", real)
    res = run_main("train", "--out", str(tmp_path / "run"), "--resume")
    assert res.returncode == 0, res.stderr
    assert train_losses(tmp_path / "run") == train_losses(ref)  # bit for bit, step 2 included

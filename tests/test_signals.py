"""``gptspeed.signals``: signals that stop a run cleanly, in bounded time: Ctrl-C, a scheduler's SIGTERM, a closed terminal's SIGHUP."""

from __future__ import annotations

import signal

from support.cli import finish, start_cli, wait_for_line
from support.training import TINY_MODEL, flags


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

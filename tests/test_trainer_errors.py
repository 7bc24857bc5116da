"""What the training loop says in one line instead of a traceback: out of memory in a step, and a
run folder whose own files (the lock, config.json, metrics.jsonl) were replaced by folders."""

import shutil

import pytest
import torch
from conftest import TINY_MODEL, assert_user_error, flags, run_main

from gptspeed.checkpoint import check_checkpoint, list_checkpoints
from gptspeed.model import GPT

TINY = [
    "--preset",
    "pico",
    *flags(dict(TINY_MODEL, n_layer=1, block_size=32, batch_size=4)),
    "--log-every",
    "1",
    "--eval-every",
    "0",
    "--eval-tokens",
    "128",
    "--device",
    "cpu",
    "--dtype",
    "float32",
    "--no-compile",
]


@pytest.mark.parametrize(
    "at_step,error",
    [
        (1, MemoryError()),
        (
            3,
            RuntimeError(
                "DefaultCPUAllocator: can't allocate memory: you tried to allocate 8589934592 bytes. Error code 12"
            ),
        ),
    ],
)
def test_out_of_memory_in_a_step_is_one_line_naming_the_micro_batch(
    shakespeare_data, tmp_path, monkeypatch, at_step, error
):
    """Out of memory right after the model is built (the first step's forward) was the allocator's
    traceback. Now one line: the micro-batch, a smaller --batch-size at the same --total-batch-tokens,
    activation checkpointing, and the newest checkpoint, intact."""
    real, steps = GPT.forward, []

    def forward(self, *a, **k):
        if torch.is_grad_enabled():
            steps.append(1)
            if len(steps) == at_step:
                raise error
        return real(self, *a, **k)

    monkeypatch.setattr(GPT, "forward", forward)
    run = tmp_path / "run"
    res = run_main(
        "train", *TINY, "--data", str(shakespeare_data), "--out", str(run), "--max-steps", "4", "--save-every", "2"
    )
    assert_user_error(
        res,
        f"out of memory on cpu in step {at_step}'s forward and backward, at a micro-batch of "
        "--batch-size 4 x --seq-len 32 = 128 tokens: use a smaller --batch-size (e.g. 2) with the "
        "same --total-batch-tokens 128",
        "--activation-checkpointing full, then --resume",
    )
    if at_step == 1:
        assert "no checkpoint was written yet" in res.stderr and not run.exists()
    else:
        assert "the checkpoint of step 2 is intact" in res.stderr
        assert [check_checkpoint(c) for c in list_checkpoints(run)] == [None]


@pytest.mark.parametrize("name", [".gptspeed.lock", "config.json"])
def test_the_runs_own_files_replaced_by_folders_are_one_line(shakespeare_data, tmp_path, name):
    """A folder under the lock's name (os.open: IsADirectoryError) or config.json's (its atomic
    rename onto a folder) was a traceback, on a new run and on --resume."""
    run = tmp_path / "run"
    args = ["train", *TINY, "--data", str(shakespeare_data), "--out", str(run), "--max-steps", "1"]
    assert run_main(*args).returncode == 0
    (run / name).unlink()
    (run / name).mkdir()
    fragment = "cannot take the run folder's lock" if name.endswith("lock") else "is not a file (a folder?)"
    assert_user_error(run_main(*args[:-1], "2", "--resume"), f"{run / name}", fragment, "move")
    assert [check_checkpoint(c) for c in list_checkpoints(run)] == [None]  # untouched
    if name.endswith("lock"):
        shutil.rmtree(run)
        (run / name).mkdir(parents=True)
        assert_user_error(run_main(*args), fragment)

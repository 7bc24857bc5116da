"""--resume of a run killed before its first checkpoint: the run restarts from step 0 as itself, from
the config.json it wrote when it started -- never as another run over that config.json."""

import json

import pytest
from conftest import TINY_MODEL, assert_user_error, flags, run_main, train_losses

from gptspeed.checkpoint import list_checkpoints, load_checkpoint
from gptspeed.step import TrainStep

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


def settings(run) -> dict:
    doc = json.loads((run / "config.json").read_text())
    return {g: doc[g] for g in ("model", "optim", "train", "runtime")}


def test_a_run_killed_before_its_first_checkpoint_resumes_as_itself(shakespeare_data, tmp_path, monkeypatch):
    """The README's "run the first command again" after a crash at step 2, before any checkpoint:
    `--resume` restarted a GPT-2 124M run on the default corpus and wrote its config.json over the
    run's. Now it restarts the run's own configuration (flags given apply on top), and a flag that
    would make it another run is refused in one line, config.json untouched."""
    run = tmp_path / "run"
    args = [*TINY, "--data", str(shakespeare_data), "--max-steps", "3", "--save-every", "0"]
    assert run_main("train", *args, "--out", str(tmp_path / "ref")).returncode == 0
    real = TrainStep.__call__
    calls = []

    def crash_at_step_2(self, *a, **k):
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("the machine went away")  # as a SIGKILL: no checkpoint, config.json stays
        return real(self, *a, **k)

    monkeypatch.setattr(TrainStep, "__call__", crash_at_step_2)
    with pytest.raises(RuntimeError, match="went away"):
        run_main("train", *args, "--out", str(run))
    monkeypatch.setattr(TrainStep, "__call__", real)
    assert not list_checkpoints(run) and (run / "config.json").is_file()
    started = settings(run)

    changed = run_main("train", "--out", str(run), "--resume", "--n-layer", "3")
    assert_user_error(changed, f"--resume: {run} has no checkpoint yet", "model.n_layer", "--force-resume")
    assert settings(run) == started

    res = run_main("train", "--preset", "pico", "--out", str(run), "--resume")  # the first command, again
    assert res.returncode == 0, res.stderr
    assert "restarting the run of its config.json from step 0" in res.stdout
    assert train_losses(run) == train_losses(tmp_path / "ref")  # the same run, from step 0
    now = settings(run)
    now["train"]["resume"] = started["train"]["resume"]
    assert now == started
    ck = load_checkpoint(list_checkpoints(run)[-1])
    assert ck["step"] == 3 and ck["config"]["model"] == started["model"]


def test_a_cpu_run_resumed_with_another_thread_count_says_so(shakespeare_data, tmp_path):
    """The bit-identical CPU resume holds for the same intra-op thread count (MKL's and PyTorch's
    reductions split by it); a scheduler that gives the resumed job other CPUs changes PyTorch's
    default count silently. The resume says so, and how to keep it."""
    run = tmp_path / "run"
    assert (
        run_main("train", *TINY, "--data", str(shakespeare_data), "--out", str(run), "--max-steps", "1").returncode == 0
    )
    doc = json.loads((run / "config.json").read_text())
    doc["environment"]["threads"] = 99
    (run / "config.json").write_text(json.dumps(doc))
    res = run_main("train", "--out", str(run), "--resume", "--max-steps", "2")
    assert res.returncode == 0, res.stderr
    assert f"note: {run} ran with 99 CPU threads and resumes with" in res.stdout and "--threads 99 keeps" in res.stdout

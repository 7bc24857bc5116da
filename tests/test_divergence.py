"""``gptspeed.divergence``: the ``--on-nan`` policy: what a run does after a step whose loss or gradient was not finite."""

from __future__ import annotations

import pytest
import torch

from gptspeed.checkpoint import list_checkpoints, load_checkpoint
from gptspeed.errors import GptspeedError
from gptspeed.trainer import build_train_config, fit

from support.cli import assert_user_error, run_main

pytestmark = pytest.mark.usefixtures("one_thread")


def test_divergence_stops_or_skips(shakespeare_data, tmp_path):
    base = dict(
        n_layer=2,
        n_embd=32,
        batch_size=8,
        device="cpu",
        data=str(shakespeare_data),
        eval_every=0,
        lr=1e30,
        warmup_steps=1,
        max_steps=6,
        log_every=3,
        save_every=1,
    )
    run = tmp_path / "stop"
    with pytest.raises(GptspeedError, match=r"diverged.*step 2 .*last good checkpoint: ckpt_00000001\.pt"):
        fit(build_train_config("pico", dict(base, out=str(run))), echo=False)
    assert [p.name for p in list_checkpoints(run)] == ["ckpt_00000001.pt"]
    proc = run_main(
        "train",
        "--out",
        str(tmp_path / "stop2"),
        *[f"--{k.replace('_', '-')}={v}" for k, v in base.items()],
        "--preset",
        "pico",
    )
    assert_user_error(proc, "diverged", "--on-nan skip")
    # --on-nan skip goes on past isolated bad steps only: 3 of 4 skipped (every step from step 2 on) is a
    # diverged run, not "done" (each step is a log step here: save_every=1)
    with pytest.raises(
        GptspeedError,
        match=r"diverged: 3 of the 4 steps so far .* skipped.*last good checkpoint: "
        r"ckpt_00000003\.pt",
    ):
        fit(build_train_config("pico", dict(base, out=str(tmp_path / "skip"), on_nan="skip")), echo=False)
    ck = load_checkpoint(list_checkpoints(tmp_path / "skip")[-1])
    assert all(torch.isfinite(v).all() for v in ck["model"].values())  # the skipped steps never touched the weights
    assert ck["trainer"]["skipped_steps"] == 2  # steps 2 and 3; step 4's made it stop before its save


def test_on_nan_skip_goes_on_past_an_isolated_bad_step(shakespeare_data, tmp_path, monkeypatch, capsys):
    from gptspeed.trainer import Trainer

    real = Trainer.train_step

    def one_bad(self, *a, **kw):
        loss, norm, bad = real(self, *a, **kw)
        return loss, norm, bad | (self.step == 2)  # the step that becomes step 3 is reported non-finite

    monkeypatch.setattr(Trainer, "train_step", one_bad)
    base = dict(
        n_layer=1,
        n_embd=32,
        batch_size=4,
        device="cpu",
        data=str(shakespeare_data),
        eval_every=0,
        max_steps=6,
        log_every=2,
        save_every=0,
    )
    summary = fit(build_train_config("pico", dict(base, out=str(tmp_path / "r"), on_nan="skip")))
    assert summary["step"] == 6 and summary["skipped_steps"] == 1
    out = capsys.readouterr().out
    assert "skipped 1 step(s) with a non-finite loss or gradient (first at step 3)" in out
    assert "done: 6 steps (1 skipped as non-finite in all)" in out

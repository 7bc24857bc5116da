"""A run folder is gptspeed's or it is refused; a checkpoint is of this run and this step or it is
skipped (issue 28, "Lost work or files"). docs/reliability.md lists these promises."""

import json
import shutil
import time
from pathlib import Path

import pytest
import torch
from conftest import TINY_MODEL, assert_user_error, flags, run_main

from gptspeed.checkpoint import (
    check_checkpoint,
    folder_run_id,
    latest_valid_checkpoint,
    list_checkpoints,
    load_checkpoint,
    refuse_foreign_folder,
    seal_path,
    write_checkpoint_file,
)
from gptspeed.errors import GptspeedError
from gptspeed.trainer import build_train_config, fit

pytestmark = pytest.mark.usefixtures("one_thread")

BASE = dict(
    TINY_MODEL,
    n_layer=1,
    batch_size=4,
    device="cpu",
    dtype="float32",
    eval_every=0,
    log_every=1,
    save_every=1,
    keep_checkpoints=3,
)


def train(data, out, **kw):
    return fit(build_train_config("pico", dict(BASE, data=str(data), out=str(out), **kw)), echo=False)


def snapshot(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


# ------------------------------------------------------------------------ the folder is gptspeed's
def test_a_folder_of_the_users_files_is_refused_and_left_untouched(shakespeare_data, tmp_path):
    """`train --out DIR` over an HF model folder used to overwrite its config.json and metrics.jsonl,
    and a run failing before step 1 then deleted them."""
    hf = tmp_path / "my_model"
    hf.mkdir()
    (hf / "config.json").write_text(json.dumps({"model_type": "gpt2", "n_layer": 2}))
    (hf / "metrics.jsonl").write_text("epoch,acc\n1,0.5\n")
    (hf / "model.safetensors").write_bytes(b"\0" * 64)
    before = snapshot(hf)
    proc = run_main(
        "train", "--preset", "pico", *flags(BASE), "--data", str(shakespeare_data), "--out", str(hf), "--max-steps", "1"
    )
    assert_user_error(
        proc,
        f"--out {hf} already holds files gptspeed did not write",
        "config.json, metrics.jsonl, model.safetensors",
        "choose another --out",
    )
    assert snapshot(hf) == before and sorted(p.name for p in hf.iterdir()) == sorted(before)  # not even a lock file


def test_the_data_folder_and_the_root_are_not_run_folders(shakespeare_data, tmp_path):
    data = tmp_path / "data"
    shutil.copytree(shakespeare_data, data)
    before = snapshot(data)
    proc = run_main(
        "train", "--preset", "pico", *flags(BASE), "--data", str(data), "--out", str(data), "--max-steps", "1"
    )
    assert_user_error(proc, f"--out {data} is a prepared data folder", "choose another --out")
    assert snapshot(data) == before
    with pytest.raises(GptspeedError, match=r"--out / already holds files gptspeed did not write \(.*and \d+ more\)"):
        refuse_foreign_folder(Path("/"))  # checked alone: a test must not risk writing into /


def test_an_empty_folder_and_a_killed_runs_folder_are_accepted(tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    refuse_foreign_folder(empty)
    killed = tmp_path / "killed"  # a run killed before its first checkpoint: config.json, metrics.jsonl, lock
    killed.mkdir()
    (killed / "config.json").write_text(json.dumps({"model": {"n_layer": 1}, "train": {}, "derived": {}}))
    (killed / "metrics.jsonl").write_text(json.dumps({"step": 0, "val_loss": 10.9}) + "\n")
    (killed / ".gptspeed.lock").write_text("pid 1 on host")
    (killed / ".config.json.0123abcd.tmp").write_text("{")  # left by a kill inside an atomic write
    refuse_foreign_folder(killed)


def test_a_start_deletes_only_the_temporary_names_gptspeed_makes(shakespeare_data, tmp_path):
    """Opening a run folder deleted every hidden `.*.tmp` entry, the user's folders recursively."""
    run = tmp_path / "run"
    train(shakespeare_data, run, max_steps=1)
    thesis = run / ".thesis.tmp"
    thesis.mkdir()
    (thesis / "ch1.tex").write_text("\\chapter{One}")
    (run / ".notes.tmp").write_text("mine")
    (run / "loss.png").write_bytes(b"png")  # `gptspeed plot RUN --out RUN/loss.png`: kept on resume
    stale = [run / ".ckpt_00000009.pt.0a1b2c3d.tmp", run / ".ckpt_00000009.json.0a1b2c3d.tmp"]
    for p in stale:
        p.write_bytes(b"half")
    (run / ".ckpt_00000009.dcp.tmp").mkdir()
    (run / ".ckpt_00000009.dcp.tmp" / "__0_0.distcp").write_bytes(b"half")
    train(shakespeare_data, run, max_steps=2, resume=True)
    assert (thesis / "ch1.tex").read_text() == "\\chapter{One}" and (run / ".notes.tmp").read_text() == "mine"
    assert (run / "loss.png").exists()
    assert not any(p.exists() for p in stale) and not (run / ".ckpt_00000009.dcp.tmp").exists()


# ------------------------------------------------------------------ a checkpoint is of this run and step
def test_a_checkpoint_of_another_run_or_step_is_skipped_and_never_pruned_over(shakespeare_data, tmp_path, capsys):
    """Another run's checkpoint copied in under a newer name used to be adopted ("resumed from step 2"),
    config.json rewritten to the other model, metrics.jsonl cut back, and --keep-checkpoints then
    pruned the run's own newer checkpoints."""
    run, other = tmp_path / "run", tmp_path / "other"
    train(shakespeare_data, run, max_steps=3)
    train(shakespeare_data, other, max_steps=4, n_embd=48, n_head=2)
    run_id = folder_run_id(run)
    assert run_id and folder_run_id(other) and folder_run_id(other) != run_id
    for p in list_checkpoints(run):  # every checkpoint and its seal carry the run's id
        assert json.loads(seal_path(p).read_text())["run_id"] == run_id == load_checkpoint(p)["run_id"]
    # the other run's step-2 checkpoint under the name of step 10; its step-4 one under its own name
    for src, name in (("ckpt_00000002", "ckpt_00000010"), ("ckpt_00000004", "ckpt_00000004")):
        for ext in (".pt", ".json"):
            shutil.copyfile(other / f"{src}{ext}", run / f"{name}{ext}")
    found, skipped = latest_valid_checkpoint(run)
    assert found.name == "ckpt_00000003.pt"
    reasons = dict((p.name, r) for p, r in skipped)
    assert reasons["ckpt_00000010.pt"].startswith("its seal is of step 2, its name of step 10")
    assert reasons["ckpt_00000004.pt"].startswith("it belongs to another run")
    config_before = json.loads((run / "config.json").read_text())
    capsys.readouterr()
    fit(
        build_train_config(
            "pico", dict(BASE, data=str(shakespeare_data), out=str(run), max_steps=6, resume=True, keep_checkpoints=2)
        )
    )
    out = capsys.readouterr().out
    assert "skipping ckpt_00000010.pt: its seal is of step 2" in out and "skipping ckpt_00000004.pt: it belongs" in out
    assert "resumed from step 3" in out
    config_after = json.loads((run / "config.json").read_text())
    assert config_after["model"] == config_before["model"] and config_after["derived"]["run_id"] == run_id
    steps = [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert steps == [0, 1, 2, 3, 4, 5, 6]  # not cut back to step 2
    names = [p.name for p in list_checkpoints(run)]
    assert names == ["ckpt_00000005.pt", "ckpt_00000006.pt", "ckpt_00000010.pt"]  # --keep-checkpoints 2 of its own
    assert load_checkpoint(run / "ckpt_00000005.pt")["run_id"] == run_id
    assert json.loads(seal_path(run / "ckpt_00000010.pt").read_text())["run_id"] != run_id  # neither used nor deleted
    with pytest.raises(GptspeedError, match=r"holds step 2 .* its name says step 10"):
        load_checkpoint(run / "ckpt_00000010.pt")


def test_a_checkpoint_whose_content_is_not_the_sealed_step_is_refused(shakespeare_data, tmp_path):
    run = tmp_path / "run"
    train(shakespeare_data, run, max_steps=2)
    state = load_checkpoint(run / "ckpt_00000002.pt")
    state = {k: v for k, v in state.items() if k not in ("format", "format_version")}
    fake = run / "ckpt_00000003.pt"
    write_checkpoint_file(fake, {**state, "step": 3})  # sealed honestly as step 3 ...
    seal = json.loads(seal_path(fake).read_text())
    torch_state = torch.load(fake, weights_only=True)
    torch_state["step"] = 7  # ... then content of another step, the seal re-hashed to match (a crafted file)
    torch.save(torch_state, fake)
    import hashlib

    seal.update(bytes=fake.stat().st_size, sha256=hashlib.sha256(fake.read_bytes()).hexdigest())
    seal_path(fake).write_text(json.dumps(seal))
    assert check_checkpoint(fake) is None  # the seal matches the bytes
    with pytest.raises(GptspeedError, match=r"holds step 7 .* but its name says step 3 and its seal step 3"):
        load_checkpoint(fake)
    proc = run_main("sample", "--run", str(run), "--max-new-tokens", "2")
    assert_user_error(proc, "holds step 7")


def test_force_resume_with_another_model_shape_is_one_line(shakespeare_data, tmp_path):
    run = tmp_path / "run"
    train(shakespeare_data, run, max_steps=1)
    proc = run_main(
        "train",
        "--preset",
        "pico",
        *flags(dict(BASE, n_layer=3)),
        "--data",
        str(shakespeare_data),
        "--out",
        str(run),
        "--max-steps",
        "2",
        "--resume",
        "--force-resume",
    )
    assert_user_error(
        proc,
        "checkpoint ckpt_00000001.pt: its model state does not fit this run",
        "resume with the settings it was written with",
    )


# ----------------------------------------------------------------------------- clocks and folders
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


def test_a_run_folder_deleted_mid_run_is_one_line(shakespeare_data, tmp_path):
    from gptspeed.trainer import Trainer

    run = tmp_path / "run"
    real = Trainer.train_step

    def delete_at_step_2(self):
        if self.step == 2:
            shutil.rmtree(run)
        return real(self)

    import pytest as _pytest

    with _pytest.MonkeyPatch.context() as mp:
        mp.setattr(Trainer, "train_step", delete_at_step_2)
        with pytest.raises(GptspeedError, match=str(run)):
            train(shakespeare_data, run, max_steps=4)


def test_a_checkpoint_whose_tensors_do_not_fit_its_config_is_one_line_on_sample(shakespeare_data, tmp_path):
    """The seal vouches for the bytes, not for the configuration inside: tensors of another shape
    under a checkpoint's config used to end in load_state_dict's RuntimeError."""
    run = tmp_path / "run"
    train(shakespeare_data, run, max_steps=1)
    path = run / "ckpt_00000001.pt"
    state = load_checkpoint(path)
    state["model"] = {
        k: (v[:, :16] if v.dim() == 2 and k.endswith("c_fc.weight") else v) for k, v in state["model"].items()
    }
    write_checkpoint_file(path, {k: v for k, v in state.items() if k not in ("format", "format_version")})
    proc = run_main("sample", "--run", str(run), "--max-new-tokens", "2")
    assert_user_error(proc, "checkpoint ckpt_00000001.pt: its model state does not fit this run", "c_fc.weight")


def test_plot_and_prepare_refuse_what_would_hang_or_crash(tmp_path):
    import os

    from gptspeed.data.prepare import prepare
    from gptspeed.plot import read_metrics

    run = tmp_path / "run"
    run.mkdir()
    os.mkfifo(run / "metrics.jsonl")
    with pytest.raises(GptspeedError, match="not a regular file"):  # a FIFO used to block `gptspeed plot` forever
        read_metrics(run)
    (tmp_path / "a.txt").write_text("some text " * 100)
    with pytest.raises(GptspeedError, match="--shuffle-seed must be an integer from 0"):  # used to raise in numpy
        prepare(str(tmp_path / "a.txt"), tmp_path / "d", shuffle_seed=-1, progress=False)
    assert not (tmp_path / "d").exists()

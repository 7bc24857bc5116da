"""``gptspeed.resume``: resolve, then freeze: the configuration a run trains with, and the checkpoint it continues."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch

from gptspeed.checkpoint import (
    check_checkpoint,
    folder_run_id,
    latest_valid_checkpoint,
    list_checkpoints,
    load_checkpoint,
    seal_path,
    write_checkpoint_file,
)
from gptspeed.data.shards import read_shard, write_shard
from gptspeed.errors import GptspeedError
from gptspeed.trainer import build_train_config, fit

from support.cli import assert_user_error, run_main
from support.run_folders import BASE, train
from support.shapes import TEXT_RUN, TEXT_RUN_FLAGS
from support.training import flags

pytestmark = pytest.mark.usefixtures("one_thread")


def test_resume_skips_damaged_checkpoints_and_says_why(shakespeare_data, tmp_path, capsys):
    run = tmp_path / "run"
    cfg = dict(
        n_layer=2,
        n_embd=32,
        batch_size=8,
        device="cpu",
        data=str(shakespeare_data),
        eval_every=0,
        max_steps=4,
        save_every=1,
        keep_checkpoints=4,
        out=str(run),
    )
    fit(build_train_config("pico", cfg), echo=False)
    ck = list_checkpoints(run)
    raw = bytearray(ck[3].read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    ck[3].write_bytes(bytes(raw))  # flipped byte
    ck[2].write_bytes(ck[2].read_bytes()[:1000])  # truncated
    seal_path(ck[1]).unlink()  # killed before sealing
    summary = fit(build_train_config(None, dict(out=str(run), resume=True, max_steps=5)), echo=True)
    out = capsys.readouterr().out
    assert "skipping ckpt_00000004.pt: sha256 does not match" in out
    assert "skipping ckpt_00000003.pt: size 1000 bytes" in out
    assert "skipping ckpt_00000002.pt: not sealed" in out
    assert "resumed from step 1" in out and summary["step"] == 5


def test_resume_with_other_data_refused_unless_forced(shakespeare_data, tmp_path):
    run = tmp_path / "run"
    base = dict(n_layer=2, n_embd=32, batch_size=8, device="cpu", eval_every=0, max_steps=2)
    fit(build_train_config("pico", dict(base, data=str(shakespeare_data), out=str(run))), echo=False)
    other = tmp_path / "other"
    shutil.copytree(shakespeare_data, other)
    m = json.loads((other / "manifest.json").read_text())
    m["input_sha256"] = "0" * 64
    (other / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(GptspeedError, match=r"different configuration \(data\).*--force-resume"):
        fit(build_train_config(None, dict(out=str(run), resume=True, data=str(other), max_steps=3)), echo=False)
    s = fit(
        build_train_config(None, dict(out=str(run), resume=True, data=str(other), max_steps=3, force_resume=True)),
        echo=False,
    )
    assert s["step"] == 3


@pytest.mark.parametrize("change", ["tokens overwritten in place", "prepared with another shuffle seed"])
def test_resume_on_changed_shards_is_refused(shakespeare_data, tmp_path, change):
    """The manifest's input hash alone let a resume train on other tokens: the shards' settings and
    fingerprints are part of the data's identity now."""
    data, run = tmp_path / "data", tmp_path / "run"
    shutil.copytree(shakespeare_data, data)
    base = dict(n_layer=1, n_embd=32, batch_size=8, device="cpu", eval_every=0, max_steps=2)
    fit(build_train_config("pico", dict(base, data=str(data), out=str(run))), echo=False)
    if change == "tokens overwritten in place":
        toks = np.array(read_shard(data / "train_000000.bin"))
        write_shard(data / "train_000000.bin", np.full_like(toks, 13))  # same size, same manifest
    else:
        m = json.loads((data / "manifest.json").read_text())
        m["settings"]["shuffle_seed"] = 7
        (data / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(GptspeedError, match=r"different configuration \(data\).*--force-resume"):
        fit(build_train_config(None, dict(out=str(run), resume=True, max_steps=3)), echo=False)


def test_resume_never_writes_over_checkpoints_it_cannot_verify(shakespeare_data, tmp_path):
    run = tmp_path / "run"
    fit(
        build_train_config(
            "pico",
            dict(
                n_layer=1,
                n_embd=32,
                batch_size=8,
                device="cpu",
                eval_every=0,
                max_steps=2,
                save_every=1,
                data=str(shakespeare_data),
                out=str(run),
            ),
        ),
        echo=False,
    )
    for ck in list_checkpoints(run):
        seal_path(ck).unlink()  # every seal gone

    def files():  # the lock file is taken (and its time touched) before the refusal: not data
        return {p.name: p.stat().st_mtime_ns for p in run.iterdir() if p.name != ".gptspeed.lock"}

    before = files()
    proc = run_main(
        "train",
        "--out",
        str(run),
        "--resume",
        "--data",
        str(shakespeare_data),
        "--preset",
        "pico",
        "--device",
        "cpu",
        "--max-steps",
        "3",
    )
    assert_user_error(proc, "holds ckpt_00000001.pt, ckpt_00000002.pt, metrics.jsonl", "refusing to write over them")
    assert files() == before


def test_a_run_keeps_the_global_batch_it_started_with(shakespeare_data, tmp_path):
    """pico leaves --total-batch-tokens unset: the global batch is B x T x the processes it started
    with, and a resume keeps it by adjusting the accumulation (it used to follow the new world
    size). Here a checkpoint written by 2 processes before this was recorded (its seal's world size
    2, no total in its configuration) is resumed by one: 2 micro-steps of 512 tokens per step."""
    run = tmp_path / "run"
    base = dict(n_layer=1, n_embd=32, batch_size=8, device="cpu", eval_every=0, log_every=1, max_steps=2)
    fit(build_train_config("pico", dict(base, data=str(shakespeare_data), out=str(run))), echo=False)
    assert json.loads((run / "config.json").read_text())["train"]["total_batch_tokens"] == 8 * 64  # recorded
    (ck,) = list_checkpoints(run)
    seal = json.loads(seal_path(ck).read_text())
    seal["world_size"], seal["config"]["train"]["total_batch_tokens"] = 2, None
    seal_path(ck).write_text(json.dumps(seal))
    fit(build_train_config(None, dict(out=str(run), resume=True, max_steps=3)), echo=False)
    recs = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    step3 = next(r for r in recs if r.get("step") == 3 and "train_loss" in r)
    assert step3["tokens"] == 2 * 512 + 1024  # counted on: steps 1-2 at 512 tokens, step 3 at 2 x 512
    assert json.loads((run / "config.json").read_text())["derived"]["grad_accum_steps"] == 2


def test_a_cpu_run_resumed_with_another_thread_count_says_so(shakespeare_data, tmp_path):
    """The bit-identical CPU resume holds for the same intra-op thread count (MKL's and PyTorch's
    reductions split by it); a scheduler that gives the resumed job other CPUs changes PyTorch's
    default count silently. The resume says so, and how to keep it."""
    run = tmp_path / "run"
    tiny = (
        *TEXT_RUN_FLAGS,
        "--eval-tokens",
        "512",
        "--dtype",
        "float32",
        "--no-compile",
    )  # the shared run's, 512 val tokens
    assert (
        run_main("train", *tiny, "--data", str(shakespeare_data), "--out", str(run), "--max-steps", "1").returncode == 0
    )
    doc = json.loads((run / "config.json").read_text())
    doc["environment"]["threads"] = 99
    (run / "config.json").write_text(json.dumps(doc))
    res = run_main("train", "--out", str(run), "--resume", "--max-steps", "2")
    assert res.returncode == 0, res.stderr
    assert f"note: {run} ran with 99 CPU threads and resumes with" in res.stdout and "--threads 99 keeps" in res.stdout


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


def test_resume_refuses_a_changed_run(shakespeare_data, tmp_path):
    from gptspeed.errors import GptspeedError

    run = tmp_path / "run"
    fit(
        build_train_config("pico", dict(TEXT_RUN, data=str(shakespeare_data), out=str(run), max_steps=2)),
        echo=False,
    )
    with pytest.raises(GptspeedError, match="n_embd"):
        fit(build_train_config(None, dict(out=str(run), resume=True, n_embd=64, max_steps=4)), echo=False)
    with pytest.raises(GptspeedError, match="already holds checkpoints"):
        fit(build_train_config("pico", dict(TEXT_RUN, data=str(shakespeare_data), out=str(run))), echo=False)

"""Training on real text, metrics, checkpoints and exact resume (CPU, tiny models)."""

import json
import math
import shutil
import signal

import numpy as np
import pytest
import torch
from conftest import TINY_MODEL, finish, records, run_cli, run_main, start_cli, wait_for_line

from gptspeed.checkpoint import list_checkpoints, load_checkpoint
from gptspeed.trainer import build_train_config, fit

TINY = dict(
    TINY_MODEL,
    n_layer=2,
    block_size=64,
    batch_size=8,
    warmup_steps=2,
    lr=3e-3,
    eval_tokens=1024,
    log_every=1,
    device="cpu",
)


def test_val_loss_falls_well_below_its_start(shakespeare_data, tmp_path):
    cfg = build_train_config(
        "pico",
        dict(
            TINY,
            data=str(shakespeare_data),
            out=str(tmp_path / "run"),
            lr=1.5e-2,
            max_steps=24,
            eval_every=24,
            log_every=8,
        ),
    )
    summary = fit(cfg, echo=False)
    recs = records(tmp_path / "run")
    start = recs[0]["val_loss"]
    assert recs[0]["step"] == 0 and start == pytest.approx(math.log(50257), abs=0.3)
    assert summary["last_val_loss"] < start - 2.5, (start, summary["last_val_loss"])
    assert recs[-1]["step"] == 24 and recs[-1]["val_loss"] == summary["last_val_loss"]


def test_metrics_config_and_checkpoint_contents(shakespeare_data, tmp_path):
    run = tmp_path / "run"
    cfg = build_train_config(
        "pico", dict(TINY, data=str(shakespeare_data), out=str(run), max_steps=4, total_batch_tokens=1024, eval_every=0)
    )
    fit(cfg, echo=False)
    rec = records(run)[-1]
    for key in (
        "step",
        "train_loss",
        "val_loss",
        "lr",
        "grad_norm",
        "tokens",
        "documents",
        "step_ms",
        "data_wait_ms",
        "tokens_per_s",
        "mfu",
        "mem_peak_bytes",
        "mem_frac",
        "eta_s",
        "epoch_eta_s",
        "epoch",
        "time_s",
    ):
        assert key in rec, key
    assert rec["tokens"] == 4 * 1024  # 2 micro-steps of 8 x 64 per step
    assert rec["documents"] == 1  # tinyshakespeare is one document, its EOT seen in the first batch
    assert rec["mfu"] is None  # no CPU peak table
    conf = json.loads((run / "config.json").read_text())
    assert conf["derived"]["grad_accum_steps"] == 2 and conf["model"]["n_embd"] == 32
    assert conf["environment"]["torch"] == torch.__version__
    ck = load_checkpoint(list_checkpoints(run)[-1])
    assert ck["step"] == 4 and set(ck) >= {"model", "optimizer", "loader", "rng", "config"}


def test_resume_from_checkpoint_is_bit_identical(shakespeare_data, tmp_path):
    full = tmp_path / "full"
    base = dict(TINY, data=str(shakespeare_data), max_steps=8, save_every=3, keep_checkpoints=5, eval_every=4)
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


def test_resume_refuses_a_changed_run(shakespeare_data, tmp_path):
    from gptspeed.errors import GptspeedError

    run = tmp_path / "run"
    fit(build_train_config("pico", dict(TINY, data=str(shakespeare_data), out=str(run), max_steps=2)), echo=False)
    with pytest.raises(GptspeedError, match="n_embd"):
        fit(build_train_config(None, dict(out=str(run), resume=True, n_embd=64, max_steps=4)), echo=False)
    with pytest.raises(GptspeedError, match="already holds checkpoints"):
        fit(build_train_config("pico", dict(TINY, data=str(shakespeare_data), out=str(run))), echo=False)


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


def test_start_line_says_why_and_warns_of_a_warmup_longer_than_the_run(shakespeare_data, tmp_path, capsys):
    run = tmp_path / "a"
    fit(
        build_train_config(
            "pico", dict(TINY, data=str(shakespeare_data), out=str(run), max_steps=3, warmup_steps=5, eval_every=0)
        )
    )
    out = capsys.readouterr().out
    assert "warning: warm-up is 5 steps but the run has 3" in out
    # the start line says why dtype and compile (both left to auto) resolved as they did on this CPU
    from gptspeed.cpu import default_cpu_compile, default_cpu_dtype

    dtype, why_dtype = default_cpu_dtype()
    assert f"why: dtype {why_dtype} | compile {default_cpu_compile(dtype, 3)[1]} | malloc: " in out
    run = tmp_path / "b"
    fit(
        build_train_config(
            "pico",
            dict(TINY, data=str(shakespeare_data), out=str(run), max_steps=4, warmup_ratio=0.5, lr=1e-3, eval_every=0),
        ),
        echo=False,
    )
    assert json.loads((run / "config.json").read_text())["derived"]["warmup_steps"] == 2
    lrs = [r["lr"] for r in records(run) if "lr" in r]
    assert lrs[:3] == pytest.approx([5e-4, 1e-3, 1e-3])  # a 2-step warm-up, then the cosine from its top
    assert lrs[3] < 1e-3


def test_a_new_run_that_fails_before_its_first_step_leaves_nothing(shakespeare_data, tmp_path):
    from gptspeed.data.shards import write_shard
    from gptspeed.errors import GptspeedError

    data = tmp_path / "data"
    data.mkdir()
    write_shard(data / "train_000000.bin", np.zeros(5000, dtype=np.uint16))
    write_shard(data / "val_000000.bin", np.full(500, 60000, dtype=np.uint16))  # ids beyond the vocabulary
    run = tmp_path / "run"
    with pytest.raises(GptspeedError, match="is not below the vocabulary size"):
        fit(build_train_config("pico", dict(TINY, data=str(data), out=str(run), max_steps=2)), echo=False)
    assert not run.exists()  # not even an empty folder, config.json or lock


def test_fit_with_compile_on_matches_eager(shakespeare_data, tmp_path, monkeypatch):
    """The compiled path of `gptspeed train` (dynamo tracing the model; the "eager" backend keeps
    the test to seconds on a CPU) gives the eager losses."""
    import gptspeed.parallelize as parallelize
    import gptspeed.step as step

    real = parallelize.parallelize
    monkeypatch.setattr(step, "parallelize", lambda *a, **k: real(*a, **{**k, "backend": "eager"}))
    base = dict(TINY, data=str(shakespeare_data), max_steps=3, eval_every=0)
    fit(build_train_config("pico", dict(base, out=str(tmp_path / "e"), compile=False)), echo=False)
    fit(build_train_config("pico", dict(base, out=str(tmp_path / "c"), compile=True)), echo=False)
    assert json.loads((tmp_path / "c" / "config.json").read_text())["derived"]["compile"] is True
    loss = lambda run: [r["train_loss"] for r in records(run) if "train_loss" in r]  # noqa: E731
    assert loss(tmp_path / "c") == pytest.approx(loss(tmp_path / "e"), abs=1e-6)


def test_the_step_0_eval_of_a_compiled_run_compiles_nothing(shakespeare_data, tmp_path, monkeypatch, capsys):
    """Issue 30 item 7: the step-0 eval compiled a no-grad graph, then training compiled again --
    a cold compile (30-60 s on a GPU) before the first step. It runs eagerly now, and says so."""
    import gptspeed.parallelize as parallelize
    import gptspeed.step as step
    from gptspeed.trainer import Trainer

    real = parallelize.parallelize
    monkeypatch.setattr(step, "parallelize", lambda *a, **k: real(*a, **{**k, "backend": "eager"}))
    torch._dynamo.reset()
    frames = torch._dynamo.utils.counters["frames"]
    base = frames["ok"]  # the counters are process-wide: earlier tests' compiles are counted too
    seen = {}
    real_step = Trainer.train_step

    def first_step(self):
        seen.setdefault("before_step_1", frames["ok"])
        return real_step(self)

    monkeypatch.setattr(Trainer, "train_step", first_step)
    fit(
        build_train_config(
            "pico",
            dict(TINY, data=str(shakespeare_data), out=str(tmp_path / "c"), compile=True, max_steps=2, eval_every=0),
        )
    )
    assert "step 0: evaluating the val loss on 1024 val tokens (eagerly" in capsys.readouterr().out
    assert seen["before_step_1"] == base and frames["ok"] > base  # training compiled; the step-0 eval did not


def test_train_from_a_hugging_face_dataset_file_with_its_field_and_split(tmp_path):
    """`--data hf:FILE` goes through the datasets library; --text-field / --split reach it."""
    docs = [{"body": "To be, or not to be, that is the question. " * 8}] * 40
    path = tmp_path / "d.jsonl"
    path.write_text("".join(json.dumps(d) + "\n" for d in docs))
    run = tmp_path / "run"
    summary = fit(
        build_train_config(
            "pico",
            dict(TINY, data=f"hf:{path}", text_field="body", split="train", out=str(run), max_steps=2, eval_every=0),
        ),
        echo=False,
    )
    assert summary["step"] == 2 and summary["last_train_loss"] is not None
    ck = load_checkpoint(list_checkpoints(run)[-1])
    assert ck["loader"]["documents"] > 0 and ck["data"] == {
        "stream": f"hf:{path}",
        "text_field": "body",
        "hf_name": None,
        "split": "train",
    }
    from gptspeed.errors import GptspeedError

    with pytest.raises(GptspeedError, match="body2"):  # the field the user named, not silently "text"
        fit(
            build_train_config(
                "pico",
                dict(TINY, data=f"hf:{path}", text_field="body2", out=str(tmp_path / "x"), max_steps=1, eval_every=0),
            ),
            echo=False,
        )


def test_eval_and_sample_commands(shakespeare_data, tmp_path):
    run = tmp_path / "run"
    fit(build_train_config("pico", dict(TINY, data=str(shakespeare_data), out=str(run), max_steps=3)), echo=False)
    res = run_main("eval", "--run", str(run), "--data", str(shakespeare_data), "--max-tokens", "2048")
    assert res.returncode == 0, res.stderr
    out = json.loads(res.stdout)
    assert out["step"] == 3 and out["tokens"] == 2048
    assert out["perplexity"] == pytest.approx(math.exp(out["val_loss"]))
    a = run_cli("sample", "--run", str(run), "--prompt", "ROMEO:", "--max-new-tokens", "20", "--seed", "7")
    b = run_main("sample", "--run", str(run), "--prompt", "ROMEO:", "--max-new-tokens", "20", "--seed", "7")
    assert a.returncode == 0, a.stderr
    assert a.stdout.startswith("ROMEO:") and len(a.stdout) > len("ROMEO:") + 5
    assert a.stdout == b.stdout  # same seed, same text

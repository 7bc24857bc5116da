"""``gptspeed.trainer``: the training loop: a :class:`Trainer` that builds a run's parts once and steps them."""

from __future__ import annotations

import contextlib
import gzip
import json
import os
import shutil
import signal
from pathlib import Path

import numpy as np
import pytest
import torch

from gptspeed.checkpoint import (
    check_checkpoint,
    list_checkpoints,
    load_checkpoint,
)
from gptspeed.errors import GptspeedError
from gptspeed.model import GPT
from gptspeed.parallelize import parallelize
from gptspeed.runtime import resolve_runtime
from gptspeed.trainer import build_train_config, fit

from support.cli import assert_user_error, run_main
from support.host_reads import HostReads
from support.padded_model import _batch, _model
from support.records import lines_of
from support.run_folders import train
from support.shapes import FP32_EAGER_FLAGS, HOST_READS_MODEL, STREAM_SETTINGS, TEXT_RUN
from support.training import TINY_MODEL, records

pytestmark = pytest.mark.usefixtures("one_thread")


def _stream_run(path: Path, run: Path, **over):
    tiny = dict(
        STREAM_SETTINGS, data=f"jsonl:{path}", out=str(run), max_steps=10_000, save_every=100_000, compile=False
    )
    return fit(build_train_config("pico", {**tiny, **over}), echo=False)


@pytest.mark.usefixtures("eager_compile")
def test_the_training_loop_reads_the_device_only_at_log_eval_and_save_steps(shakespeare_data, tmp_path):
    """The whole loop (lr, step, non-finite counters, what is due, signals): host reads happen
    only inside log_step, evaluation and checkpointing."""
    from gptspeed.configure import build_train_config
    from gptspeed.runtime import resolve_runtime as rr
    from gptspeed.trainer import Trainer

    cfg = build_train_config(
        "pico",
        dict(
            **HOST_READS_MODEL,
            data=str(shakespeare_data),
            out=str(tmp_path / "run"),
            batch_size=2,
            total_batch_tokens=64,
            max_steps=6,
            log_every=100,
            eval_every=0,
            eval_tokens=64,
            save_every=0,
            device="cpu",
            dtype="float32",
        ),
    )
    trainer = Trainer(cfg, rr("cpu", "float32", False), echo=False)
    mode = HostReads()
    paused = {"depth": 0}
    for owner, name in ((trainer.log, "log_step"), (trainer, "evaluate"), (trainer.log, "record")):
        inner = getattr(owner, name)

        def outside(*a, _inner=inner, **k):
            paused["depth"] += 1
            before = len(mode.reads)
            try:
                return _inner(*a, **k)
            finally:
                del mode.reads[before:]
                paused["depth"] -= 1

        setattr(owner, name, outside)
    save = trainer.checkpointer.save

    def save_outside(step):
        before = len(mode.reads)
        try:
            return save(step)
        finally:
            del mode.reads[before:]

    trainer.checkpointer.save = save_outside
    with mode:
        summary = trainer.train()
    assert summary["step"] == 6 and trainer.accum == 2
    assert mode.reads == []


def test_a_stream_that_fails_or_ends_saves_the_last_finished_step(tmp_path):
    """A truncated .gz under a streaming run saved nothing (a bad shard saved the last step). Now
    the run ends with one line naming the file and how many steps and tokens were trained, and
    the checkpoint of the last finished step, which resumes once the file is whole."""
    from gptspeed.checkpoint import check_checkpoint, list_checkpoints

    rng = np.random.default_rng(0)  # text that compresses little: half the .gz holds half the documents
    docs = [" ".join(f"w{int(x)}" for x in rng.integers(0, 5000, 40)) for _ in range(12)]
    data = lines_of(docs)
    whole = gzip.compress(data)
    path = tmp_path / "d.jsonl.gz"
    path.write_bytes(whole[: len(whole) // 2])
    run = tmp_path / "run"
    with pytest.raises(GptspeedError) as e:
        _stream_run(path, run)
    msg = str(e.value)
    (ck,) = list_checkpoints(run)
    step = int(ck.stem.split("_")[1])
    assert "\n" not in msg and "d.jsonl.gz is truncated" in msg, msg
    assert step >= 2 and f"Trained {step:,} steps (" in msg and f"checkpoint of step {step} was saved" in msg, msg
    assert check_checkpoint(ck) is None
    path.write_bytes(whole)
    summary = _stream_run(path, run, resume=True, max_steps=step + 2)
    assert summary["step"] == step + 2
    # the stream runs out before --max-steps: the same, with the batch count
    short = tmp_path / "short.jsonl"
    short.write_bytes(data[: data.rindex(b"\n", 0, len(data) // 4) + 1])
    run2 = tmp_path / "run2"
    with pytest.raises(
        GptspeedError,
        match=r"short\.jsonl ended after [0-9,]+ batches of 4x32 tokens.*"
        r"Trained [0-9,]+ steps \([0-9,]+ tokens\); the checkpoint of step",
    ):
        _stream_run(short, run2)
    assert len(list_checkpoints(run2)) == 1


# ------------------------------------------------------------------------ stop signals
@contextlib.contextmanager
def _signal_handlers_kept():
    """The handlers of the stop signals as they were, after a run a signal stopped in this process
    (it leaves SIGTERM and SIGHUP ignored, and SIGINT its own, until the process exits)."""
    saved = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
    try:
        yield
    finally:
        for s, h in saved.items():
            signal.signal(s, h)


def _killed_compiler(sig: int) -> Exception:
    """What a compile raises when a signal sent to the whole process group (a terminal's Ctrl-C,
    ``timeout``'s SIGTERM) reached this process and killed the C++ compiler inductor was running:
    the signal is delivered here, and the compile fails with inductor's ``CppCompileError``."""
    from torch._inductor.exc import CppCompileError

    os.kill(os.getpid(), sig)
    return CppCompileError(["g++", "kernel.cpp", "-o", "kernel.so"], "")


@pytest.mark.parametrize("sig,code", [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_a_step_that_raises_as_a_stop_signal_arrives_is_left_and_the_last_finished_step_saved(
    shakespeare_data, tmp_path, monkeypatch, sig, code
):
    """Ctrl-C while torch.compile built a step's kernels also killed its compiler: the step raised
    CppCompileError, a traceback, and the steps since the last checkpoint were lost. Now a step that
    raises once a stop signal arrived is left as the stop leaves a step: the last finished step saved,
    the signal's status and its resume line, the exception named in one line, no traceback."""
    from gptspeed.step import TrainStep

    real, calls = TrainStep.forward_backward, []

    def compiler_killed_in_step_3(self, *a, **k):
        calls.append(1)
        if len(calls) == 3:
            raise _killed_compiler(sig)
        return real(self, *a, **k)

    monkeypatch.setattr(TrainStep, "forward_backward", compiler_killed_in_step_3)
    run = tmp_path / "run"
    with _signal_handlers_kept():
        res = run_main(
            "train", *FP32_EAGER_FLAGS, "--max-steps", "50", "--save-every", "0",
            "--data", str(shakespeare_data), "--out", str(run),
        )  # fmt: skip
    assert res.returncode == code, res.stderr
    assert "Traceback" not in res.stderr and "C++ compile error" not in res.stdout + res.stderr
    assert "step 3 was left in its micro-batch 1 of 1, which raised CppCompileError as the stop arrived" in res.stdout
    assert f"stopped at step 2; checkpoint saved in {run}. Resume with:" in res.stdout
    (ck,) = list_checkpoints(run)
    assert check_checkpoint(ck) is None and load_checkpoint(ck)["step"] == 2
    assert load_checkpoint(ck)["loader"]["batches"] == 2  # rewound: a resume redoes step 3 from its batch


def test_an_evaluation_that_raises_as_a_stop_signal_arrives_is_left_and_its_step_saved(
    shakespeare_data, tmp_path, monkeypatch
):
    """The first val loss of a compiled run compiles its no-grad graph: a Ctrl-C then killed the compiler
    and the evaluation's traceback lost the steps since the last checkpoint. Now the evaluation is left,
    said in one line, and the step it followed saved."""
    from gptspeed.eval.during import RunEvaluator

    real, calls = RunEvaluator.val_loss, []

    def compiler_killed_at_the_second_eval(self, *a, **k):
        calls.append(1)
        if len(calls) == 2:  # the first is step 0's
            raise _killed_compiler(signal.SIGINT)
        return real(self, *a, **k)

    monkeypatch.setattr(RunEvaluator, "val_loss", compiler_killed_at_the_second_eval)
    run = tmp_path / "run"
    with _signal_handlers_kept():
        res = run_main(
            "train", *FP32_EAGER_FLAGS, "--max-steps", "50", "--save-every", "0", "--eval-every", "2",
            "--data", str(shakespeare_data), "--out", str(run),
        )  # fmt: skip
    assert res.returncode == 130, res.stderr
    assert "Traceback" not in res.stderr
    assert "the val loss after step 2 was left: it raised CppCompileError as the stop arrived" in res.stdout
    assert "stopped at step 2; checkpoint saved" in res.stdout
    (ck,) = list_checkpoints(run)
    assert check_checkpoint(ck) is None and load_checkpoint(ck)["step"] == 2


# ----------------------------------------------------------------------------- folders
def test_a_run_folder_deleted_mid_run_is_one_line(shakespeare_data, tmp_path):
    from gptspeed.trainer import Trainer

    run = tmp_path / "run"
    real = Trainer.train_step

    def delete_at_step_2(self, *a, **kw):
        if self.step == 2:
            shutil.rmtree(run)
        return real(self, *a, **kw)

    import pytest as _pytest

    with _pytest.MonkeyPatch.context() as mp:
        mp.setattr(Trainer, "train_step", delete_at_step_2)
        with pytest.raises(GptspeedError, match=str(run)):
            train(shakespeare_data, run, max_steps=4)


def test_eval_after_training_does_not_recompile():
    """Dynamo guards on grad mode, so the first evaluation (under no_grad, same shapes) compiles
    its forward-only graph once; after that, train and eval alternate with no compile at all."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    x, y = _batch()
    model = _model()
    train_model = parallelize(model, resolve_runtime("cpu", "float32", True), backend="eager")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)

    def train():
        train_model(x, y)[1].backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    def evaluate():
        model.eval()
        with torch.no_grad():
            train_model(x, y)
        model.train()

    train()
    train()
    assert counters["stats"]["unique_graphs"] == 1
    evaluate()
    after_first_eval = counters["stats"]["unique_graphs"]
    assert after_first_eval <= 2  # the grad-free forward, once
    for _ in range(2):
        train()
        evaluate()
    assert counters["stats"]["unique_graphs"] == after_first_eval
    assert not counters["recompiles"] or max(counters["recompiles"].values(), default=0) <= 1
    torch._dynamo.reset()


def test_metrics_config_and_checkpoint_contents(shakespeare_data, tmp_path):
    run = tmp_path / "run"
    cfg = build_train_config(
        "pico",
        dict(TEXT_RUN, data=str(shakespeare_data), out=str(run), max_steps=4, total_batch_tokens=1024, eval_every=0),
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


def test_start_line_says_why_and_warns_of_a_warmup_longer_than_the_run(shakespeare_data, tmp_path, capsys):
    run = tmp_path / "a"
    fit(
        build_train_config(
            "pico", dict(TEXT_RUN, data=str(shakespeare_data), out=str(run), max_steps=3, warmup_steps=5, eval_every=0)
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
            dict(
                {
                    k: v for k, v in TEXT_RUN.items() if k != "warmup_steps"
                },  # --warmup-ratio replaces it: both is refused
                data=str(shakespeare_data),
                out=str(run),
                max_steps=4,
                warmup_ratio=0.5,
                lr=1e-3,
                eval_every=0,
            ),
        ),
        echo=False,
    )
    assert json.loads((run / "config.json").read_text())["derived"]["warmup_steps"] == 2
    lrs = [r["lr"] for r in records(run) if "lr" in r]
    assert lrs[:3] == pytest.approx([5e-4, 1e-3, 1e-3])  # a 2-step warm-up, then the cosine from its top
    assert lrs[3] < 1e-3


def test_a_resume_of_a_run_that_reached_its_target_val_loss_trains_no_further(shakespeare_data, tmp_path, capsys):
    """A run stopped at its --stop-at-val-loss, resumed, trained on to --max-steps (issue 56): now it says the run
    reached its target and stops (exit 0, nothing written); a lower target goes on. (Only a stream has no val
    split, refused with a target by the configuration: a data folder without one is refused by find_train_data.)"""
    run = tmp_path / "run"
    tiny = dict(TEXT_RUN, data=str(shakespeare_data), out=str(run), max_steps=6, eval_every=2, eval_tokens=256)
    first = fit(build_train_config("pico", dict(tiny, stop_at_val_loss=100.0)), echo=False)
    assert (first["step"], first["reached_target"]) == (2, 2)
    kept = (records(run), list_checkpoints(run))
    again = fit(build_train_config(None, dict(out=str(run), resume=True)), echo=True)
    assert (again["step"], again["reached_target"]) == (2, 2) and (records(run), list_checkpoints(run)) == kept
    assert "reached --stop-at-val-loss 100 at step 2 (val loss" in capsys.readouterr().out
    lower = fit(build_train_config(None, dict(out=str(run), resume=True, stop_at_val_loss=1e-3)), echo=False)
    assert lower["step"] == 6 and lower.get("reached_target") is None


def test_a_new_run_that_fails_before_its_first_step_leaves_nothing(shakespeare_data, tmp_path):
    from gptspeed.data.shards import write_shard
    from gptspeed.errors import GptspeedError

    data = tmp_path / "data"
    data.mkdir()
    write_shard(data / "train_000000.bin", np.zeros(5000, dtype=np.uint16))
    write_shard(data / "val_000000.bin", np.full(500, 60000, dtype=np.uint16))  # ids beyond the vocabulary
    run = tmp_path / "run"
    with pytest.raises(GptspeedError, match="is not below the vocabulary size"):
        fit(build_train_config("pico", dict(TEXT_RUN, data=str(data), out=str(run), max_steps=2)), echo=False)
    assert not run.exists()  # not even an empty folder, config.json or lock


def test_fit_with_compile_on_matches_eager(shakespeare_data, tmp_path, monkeypatch):
    """The compiled path of `gptspeed train` (dynamo tracing the model; the "eager" backend keeps
    the test to seconds on a CPU) gives the eager losses."""
    import gptspeed.parallelize as parallelize
    import gptspeed.step as step

    real = parallelize.parallelize
    monkeypatch.setattr(step, "parallelize", lambda *a, **k: real(*a, **{**k, "backend": "eager"}))
    base = dict(TEXT_RUN, data=str(shakespeare_data), max_steps=3, eval_every=0)
    fit(build_train_config("pico", dict(base, out=str(tmp_path / "e"), compile=False)), echo=False)
    fit(build_train_config("pico", dict(base, out=str(tmp_path / "c"), compile=True)), echo=False)
    assert json.loads((tmp_path / "c" / "config.json").read_text())["derived"]["compile"] is True
    loss = lambda run: [r["train_loss"] for r in records(run) if "train_loss" in r]  # noqa: E731
    assert loss(tmp_path / "c") == pytest.approx(loss(tmp_path / "e"), abs=1e-6)


def test_the_step_0_eval_of_a_compiled_run_compiles_nothing(shakespeare_data, tmp_path, monkeypatch, capsys):
    """The step-0 eval compiled a no-grad graph, then training compiled again --
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

    def first_step(self, *a, **kw):
        seen.setdefault("before_step_1", frames["ok"])
        return real_step(self, *a, **kw)

    monkeypatch.setattr(Trainer, "train_step", first_step)
    fit(
        build_train_config(
            "pico",
            dict(
                TEXT_RUN, data=str(shakespeare_data), out=str(tmp_path / "c"), compile=True, max_steps=2, eval_every=0
            ),
        )
    )
    assert "step 0: evaluating the val loss on 1024 val tokens (eagerly" in capsys.readouterr().out
    assert seen["before_step_1"] == base and frames["ok"] > base  # training compiled; the step-0 eval did not


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
        "train",
        *FP32_EAGER_FLAGS,
        "--data",
        str(shakespeare_data),
        "--out",
        str(run),
        "--max-steps",
        "4",
        "--save-every",
        "2",
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
    args = ["train", *FP32_EAGER_FLAGS, "--data", str(shakespeare_data), "--out", str(run), "--max-steps", "1"]
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


def test_a_slow_start_says_within_its_first_micro_steps_how_long_a_step_and_the_run_take(
    shakespeare_data, tmp_path, capsys, monkeypatch
):
    """GPT-2 124M's default steps on a laptop are minutes each: the run says so from the speed of its
    own first units (the step-0 evaluation's batches, the first step's micro-steps), here on a clock
    that makes each unit take 15 s, and names the preset that trains in minutes on a CPU."""
    import gptspeed.metrics as metrics

    now = [0.0]

    def clock():
        now[0] += 15.0
        return now[0]

    monkeypatch.setattr(metrics, "pace_clock", clock)
    shape = dict(TINY_MODEL, batch_size=2, total_batch_tokens=4 * 2 * 32, eval_tokens=4 * 2 * 32, max_steps=2)
    fit(build_train_config("gpt2", dict(shape, data=str(shakespeare_data), out=str(tmp_path / "r"), device="cpu")))
    out = capsys.readouterr().out.splitlines()
    assert (
        out.count(
            "step 0: an evaluation batch takes 15.0 s here, so the 4 batches of --eval-tokens 256 about 1m00s "
            "(a smaller --eval-tokens evaluates fewer)"
        )
        == 1
    )
    line = [s for s in out if s.startswith("step 1: a micro-step")]
    assert line == [
        "step 1: a micro-step of 2 x 32 tokens takes 15.0 s here, so a step (4 micro-steps) about 1m00s and the "
        "run's 2 steps about 2m00s; for a quick run on a CPU: --preset nano (a 10M-parameter model, minutes)"
    ]
    assert out.index(line[0]) < next(i for i, s in enumerate(out) if s.startswith("step 1/2 |"))


def test_out_of_memory_on_a_gpu_names_batch_size_auto_first(tmp_path):
    """On CUDA the probe of ``--batch-size auto`` finds the largest micro-batch that fits: the line
    names it before the smaller --batch-size (on a CPU it is refused, so it is not named there)."""
    from types import SimpleNamespace

    from gptspeed.trainer import out_of_memory_error

    cfg = build_train_config("pico", dict(TINY_MODEL, batch_size=8, total_batch_tokens=8 * 32 * 4))
    fake = SimpleNamespace(
        cfg=cfg, rt=SimpleNamespace(device=torch.device("cuda"), world_size=1), run_dir=tmp_path, step=0
    )
    line = str(out_of_memory_error(fake, "step 1's forward and backward"))
    assert (
        "at a micro-batch of --batch-size 8 x --seq-len 32 = 256 tokens: use --batch-size auto (the largest that "
        "fits, found by a probe) or a smaller --batch-size (e.g. 4) with the same --total-batch-tokens 1024" in line
    )
    assert "no checkpoint was written yet" in line and "\n" not in line


# ------------------------------------------------------------------ --attn-window: the window of each step
@pytest.mark.usefixtures("eager_compile")
def test_the_window_of_each_step_reaches_the_compiled_model_without_a_recompile(shakespeare_data, tmp_path):
    """--seq-len 512 --attn-window 512 --attn-window-start 128 over 4 steps, compiled: the loop sets
    windows 128, 256, 384, 512 (``attn_window_at``) into the model before each step, and the one
    training graph the first step compiled runs all four (the window is a tensor the mask reads: no
    recompile when it moves)."""
    from torch._dynamo.utils import counters

    from gptspeed.schedules import attn_window_at
    from gptspeed.trainer import Trainer

    cfg = build_train_config(
        "pico",
        dict(
            TINY_MODEL,
            block_size=512,
            attn_window=512,
            attn_window_start=128,
            softmax="data",
            data=str(shakespeare_data),
            out=str(tmp_path / "run"),
            batch_size=1,
            total_batch_tokens=None,
            max_steps=4,
            log_every=4,
            eval_every=0,
            save_every=0,
            device="cpu",
            dtype="float32",
            compile=True,
        ),
    )
    trainer = Trainer(cfg, resolve_runtime("cpu", "float32", True), echo=False)
    seen = []
    real = trainer.train_step

    def spy(*a, **kw):
        seen.append(int(trainer.model.attn_window_now))
        out = real(*a, **kw)
        graphs.append(counters["stats"]["unique_graphs"])  # after the step
        return out

    trainer.train_step = spy
    counters.clear()
    graphs = []
    assert trainer.train()["step"] == 4
    assert seen == [attn_window_at(s, cfg) for s in range(4)] == [128, 256, 384, 512]
    assert graphs == [1] * 4, graphs  # the training graph of the first step, and no other
    assert not counters["recompiles"], dict(counters["recompiles"])


@pytest.mark.usefixtures("eager_compile")
def test_a_compiled_training_forward_computes_with_the_window_set_last_and_reads_nothing_on_the_host():
    """``set_attn_window`` between the calls of one compiled graph: each loss is the eager model's with
    that window (and the windows give different losses); setting the window and the training forward
    and backward read no device value on the host (a CUDA step never waits for it)."""
    from torch._dynamo.utils import counters

    from support.host_reads import HostReads

    x, y = _batch()
    model = _model(attn_window=32)
    train_model = parallelize(model, resolve_runtime("cpu", "float32", True), backend="eager")
    counters.clear()
    losses = []
    for window in (4, 16, 2, 32):
        model.set_attn_window(window)
        compiled = train_model(x, y)[1]
        assert torch.equal(compiled, torch.compiler.disable(model)(x, y)[1]), window
        losses.append(compiled.item())
    assert len(set(losses)) == 4
    assert counters["stats"]["unique_graphs"] == 1 and not counters["recompiles"]
    with HostReads() as mode:
        model.set_attn_window(8)
        model(x, y)[1].backward()
    assert mode.reads == []


@pytest.mark.usefixtures("eager_compile")  # dynamo traces and counts the graphs; no inductor code generation
def test_the_batch_and_length_warm_ups_give_each_step_its_micro_batches_tokens_and_length(shakespeare_data, tmp_path):
    """--batch-warmup-steps 3 from one micro-batch to 4, --seq-len-warmup-steps 3 from 16 tokens to 64, compiled:
    the loop gives steps 1-5 1, 2, 3, 4, 4 micro-batches (``grad_accum_at``) at lengths 16, 32, 32, 64, 64
    (``seq_len_at``); the loader hands out exactly those micro-batches, each record counts the tokens trained so
    far, the ETA is the tokens left at the measured tokens/s, and each length compiles once, into a static graph."""
    from torch._dynamo.utils import counters

    from gptspeed.schedules import grad_accum_at, seq_len_at, tokens_between
    from gptspeed.trainer import Trainer

    cfg = build_train_config(
        "pico",
        dict(
            TINY_MODEL,
            block_size=64,
            data=str(shakespeare_data),
            out=str(tmp_path / "run"),
            batch_size=2,
            total_batch_tokens=4 * 2 * 64,
            batch_warmup_steps=3,
            batch_start_tokens=150,  # one micro-batch of 128, rounded down
            seq_len_warmup_steps=3,
            seq_len_start=16,
            max_steps=5,
            log_every=1,
            eval_every=0,
            save_every=0,
            device="cpu",
            dtype="float32",
            compile=True,
        ),
    )
    trainer = Trainer(cfg, resolve_runtime("cpu", "float32", True), echo=False)
    seen, shapes = [], []
    real_step, real_forward = trainer.train_step, trainer.stepper.forward_backward

    def spy(accum, seq_len):
        seen.append((accum, seq_len, trainer.loader.batches))
        return real_step(accum, seq_len)

    def forward_backward(x, y, last_micro_step, accum=None, seq_len=None):
        shapes.append((tuple(x.shape), seq_len))
        return real_forward(x, y, last_micro_step, accum, seq_len)

    trainer.train_step, trainer.stepper.forward_backward = spy, forward_backward
    counters.clear()
    assert trainer.train()["step"] == 5
    assert [(a, t) for a, t, _ in seen] == [(grad_accum_at(s, cfg), seq_len_at(s, cfg)) for s in range(5)]
    assert [(a, t) for a, t, _ in seen] == [(1, 16), (2, 32), (3, 32), (4, 64), (4, 64)]
    assert [b for _, _, b in seen] == [0, 1, 3, 6, 10] and trainer.loader.batches == 14
    assert shapes == [((2, 64), t) for a, t, _ in seen for _ in range(a)]  # the loader's shape; cut in the step
    recs = [r for r in records(tmp_path / "run") if r["step"] > 0]
    assert [r["tokens"] for r in recs] == [128 * n for n in (1, 3, 6, 10, 14)]
    assert [r["tokens"] for r in recs] == [tokens_between(0, s, cfg) for s in range(1, 6)]
    for r in recs:
        assert r["eta_s"] == pytest.approx(tokens_between(r["step"], 5, cfg) / r["tokens_per_s"], rel=1e-9)
    # one static graph per length (16, 32, 64; parallelize's dynamic=False) and the final evaluation's no-grad one
    assert counters["stats"]["unique_graphs"] == 4 and not counters["graph_break"], dict(counters["stats"])


def test_mfu_counts_each_steps_own_sequence_length_during_the_seq_len_warm_up(shakespeare_data, tmp_path):
    """--seq-len-warmup-steps 3 from 16 tokens to 64: each logged MFU is the FLOPs of that step's own length
    (``flops_per_token(seq_len_at(step))``: a shorter step's attention term is smaller) times its tokens/s over
    the peak, not the full --seq-len's (at GPT-2 124M and T=128 of 1024 that would read ~13% high)."""
    from gptspeed.schedules import seq_len_at
    from gptspeed.trainer import Trainer

    cfg = build_train_config(
        "pico",
        dict(
            TINY_MODEL,
            block_size=64,
            data=str(shakespeare_data),
            out=str(tmp_path / "run"),
            batch_size=2,
            total_batch_tokens=2 * 64,
            seq_len_warmup_steps=3,
            seq_len_start=16,
            max_steps=4,
            log_every=1,
            eval_every=0,
            save_every=0,
            device="cpu",
            dtype="float32",
            compile=False,
            peak_tflops=1.0,
        ),
    )
    trainer = Trainer(cfg, resolve_runtime("cpu", "float32", False), echo=False)
    assert trainer.train()["step"] == 4
    recs = [r for r in records(tmp_path / "run") if r["step"] > 0]
    lengths = [seq_len_at(r["step"] - 1, cfg) for r in recs]  # each record holds one step (--log-every 1)
    assert lengths == [16, 32, 32, 64]
    full = trainer.model.flops_per_token(64)
    for r, t in zip(recs, lengths):
        assert r["mfu"] == pytest.approx(trainer.model.flops_per_token(t) * r["tokens_per_s"] / 1e12, rel=1e-9)
    assert recs[0]["mfu"] < full * recs[0]["tokens_per_s"] / 1e12  # the full length's FLOPs would read high

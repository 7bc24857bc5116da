"""Hostile or careless configurations and run logs (issue 28): config files that are not files,
`~` in paths, models larger than memory, junk in metrics.jsonl, a full disk on a metrics append, a
clock that jumps. Each is one line or the correct behaviour, never a traceback or a hang."""

from __future__ import annotations

import errno
import json
import os
import time
from pathlib import Path

import pytest
from conftest import assert_user_error, records, run_cli, run_main

from gptspeed.config import preset, read_config_file
from gptspeed.configure import build_train_config
from gptspeed.errors import GptspeedError

pytestmark = pytest.mark.usefixtures("one_thread")

PICO = ["--preset", "pico", "--device", "cpu", "--max-steps", "2", "--eval-tokens", "512", "--log-every", "1"]


def pico_args(data, out, *extra):
    return ("train", *PICO, "--data", str(data), "--out", str(out), *extra)


# ------------------------------------------------------------------------------- config files
def _billion_laughs() -> str:
    """YAML whose `lr` is 9**10 items by aliases (a few hundred bytes of text): the error line used
    to repr it in full, which never ends."""
    lines, prev = ["derived:", "  a: &a [1, 1, 1, 1, 1, 1, 1, 1, 1]"], "a"
    for name in "bcdefghi":
        lines.append(f"  {name}: &{name} [" + ", ".join([f"*{prev}"] * 9) + "]")
        prev = name
    return "\n".join([*lines, "lr: [" + ", ".join(["*i"] * 9) + "]"]) + "\n"


@pytest.mark.parametrize(
    "name, content, fragments",
    [
        ("folder.yaml", None, ["is a folder, not a file"]),
        ("latin1.yaml", b"lr: caf\xe9\n", ["is not UTF-8 text"]),
        ("deep.yaml", b"lr: " + b"[" * 100_000 + b"]" * 100_000, ["is nested too deeply to be read"]),
        ("deep.json", b'{"lr": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", ["is nested too deeply to be read"]),
        ("nan.json", b'{"lr": NaN}', ["is not valid JSON", "NaN is not JSON"]),
        ("digits.yaml", b"seed: " + b"9" * 5000 + b"\n", ["is not valid YAML", "digits"]),
        ("laughs.yaml", _billion_laughs().encode(), ["lr must be float, got [[[", "...]"]),
        ("seed.yaml", b"seed: 99999999999999999999999\n", ["--seed must be an integer from 0 to"]),
        ("big.yaml", b"model:\n  n_layer: 100000000000000000000\n", ["--n-layer must be at most"]),
    ],
)
def test_unreadable_config_files_are_one_line(tmp_path, name, content, fragments):
    """Each used to be a traceback (UnicodeDecodeError from a folder, RecursionError, ValueError
    from int()) or to run forever (the billion laughs' repr); now one line from `gptspeed train`."""
    path = tmp_path / name
    if content is None:
        path.mkdir()
    else:
        path.write_bytes(content)
    started = time.monotonic()
    proc = run_main("train", "--config", str(path), "--print-config")
    assert_user_error(proc, "gptspeed train: error:", *fragments)
    assert time.monotonic() - started < 30


def test_config_that_is_a_fifo_or_a_device_is_one_line_and_never_blocks(tmp_path):
    """A FIFO with no writer blocked the read forever; /dev/zero never ends. In a process of its own
    with a deadline, so a regression fails instead of hanging the suite."""
    fifo = tmp_path / "run.yaml"
    os.mkfifo(fifo)
    for path in (fifo, Path("/dev/zero")):
        proc = run_cli("train", "--config", str(path), "--print-config", timeout=60)
        assert_user_error(proc, f"config file {path} is not a regular file")
    with pytest.raises(GptspeedError, match="does not exist"):
        read_config_file(tmp_path / "missing.yaml")


# ---------------------------------------------------------------------------------- ~ in paths
def test_tilde_is_expanded_in_every_path_setting_from_yaml_flags_and_the_api(tmp_path, monkeypatch):
    """`out: ~/runs/a` created a folder named `~` in the working directory, and `data: ~/...` "did
    not exist". Every path-valued setting (out, data -- also after jsonl: --, init_from) has its
    `~` expanded where values enter the configuration, whichever way they come."""
    home = tmp_path / "home"
    monkeypatch.setenv("HOME", str(home))
    conf = tmp_path / "run.yaml"
    conf.write_text("out: ~/runs/a\ndata: ~/data/ts\ninit_from: ~/gpt2-folder\n")
    cfg = preset("pico").apply_file(str(conf))  # (build_train_config would load init_from's shape)
    assert (cfg.train.out, cfg.train.data, cfg.train.init_from) == (
        f"{home}/runs/a",
        f"{home}/data/ts",
        f"{home}/gpt2-folder",
    )
    conf.write_text("out: ~/runs/a\ndata: ~/data/ts\n")
    cfg = build_train_config("pico", {}, str(conf))
    assert (cfg.train.out, cfg.train.data) == (f"{home}/runs/a", f"{home}/data/ts")
    cfg = preset("pico").override({"out": "~/b", "data": "jsonl:~/docs.jsonl"})
    assert (cfg.train.out, cfg.train.data) == (f"{home}/b", f"jsonl:{home}/docs.jsonl")
    assert preset("pico").override({"data": "hf:~user/set"}).train.data == "hf:~user/set"  # a dataset name
    assert preset("pico").override({"wandb_run_name": "~x"}).train.wandb_run_name == "~x"  # not a path


def test_train_with_tilde_paths_writes_under_home(shakespeare_data, tmp_path, monkeypatch):
    """End to end: `--config` with `~` paths trains into $HOME/..., no `./~` folder appears, and
    `--resume --out ~/...` finds the run again."""
    home, cwd = tmp_path / "home", tmp_path / "cwd"
    (home / "data").mkdir(parents=True)
    cwd.mkdir()
    os.symlink(shakespeare_data, home / "data" / "ts")
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.chdir(cwd)
    conf = tmp_path / "run.yaml"
    conf.write_text("out: ~/runs/r\ndata: ~/data/ts\n")
    proc = run_main("train", "--config", str(conf), *PICO[:-4], "--max-steps", "1", "--eval-tokens", "512")
    assert proc.returncode == 0, proc.stderr
    assert (home / "runs" / "r" / "metrics.jsonl").is_file()
    assert list(cwd.iterdir()) == []  # no literal ./~
    proc = run_main("train", "--out", "~/runs/r", "--resume", "--max-steps", "2", "--device", "cpu")
    assert proc.returncode == 0, proc.stderr
    assert [r["step"] for r in records(home / "runs" / "r")][-1] == 2


# ------------------------------------------------------------------------- model size vs memory
def test_a_model_larger_than_memory_is_refused_before_it_is_built(shakespeare_data, tmp_path, monkeypatch):
    """`n_layer: 1000000000` built layers until memory ran out. The parameter count comes from the
    shape (GPTConfig.num_params, checked against the model itself in test_num_params_...) and the
    estimate is compared with the memory before anything is allocated: one line with both."""
    import gptspeed.step as step

    def never(*a, **k):
        raise AssertionError("the model was built")

    monkeypatch.setattr(step, "GPT", never)
    conf = tmp_path / "big.yaml"
    conf.write_text("model:\n  n_layer: 1000000000\n")
    for how in (["--config", str(conf)], ["--n-layer", "1000000000"]):
        proc = run_main(*pico_args(shakespeare_data, tmp_path / "r", *how))
        assert_user_error(
            proc, "49,984,003,223,680 parameters", "TiB of RAM for its fp32 weights", "RAM available", "lower --n-layer"
        )
        assert not (tmp_path / "r").exists()
    # weights that fit in RAM but not with gradients and AdamW's state (16 bytes a parameter) on the device
    monkeypatch.setattr(step, "host_memory_available", lambda: 100 << 20)  # 100 MiB
    proc = run_main(*pico_args(shakespeare_data, tmp_path / "r", "--n-layer", "300"))
    assert_user_error(
        proc,
        "needs at least",
        "for its weights, gradients and optimizer state (16 bytes a parameter)",
        "more than the 100.00 MiB of RAM available",
    )


def test_num_params_matches_the_model():
    from gptspeed.config import GPTConfig
    from gptspeed.model import GPT

    for shape in (
        dict(n_layer=2, n_head=2, n_embd=64, block_size=64),
        dict(n_layer=1, n_head=4, n_embd=32, block_size=16, vocab_size=50257, attention="manual", softmax="data"),
    ):
        cfg = GPTConfig(**shape)
        model = GPT(cfg)
        assert cfg.num_params() == sum(p.numel() for p in model.parameters())
        assert cfg.buffer_bytes() == sum(b.numel() * b.element_size() for b in model.buffers())


@pytest.mark.parametrize(
    "error",
    [
        RuntimeError(
            "[enforce fail at alloc_cpu.cpp:117] data. DefaultCPUAllocator: can't allocate memory: you tried "
            "to allocate 4096 bytes. Error code 12 (Cannot allocate memory)"
        ),
        MemoryError(),
        "torch.OutOfMemoryError",
    ],
)
def test_out_of_memory_while_building_is_one_line(monkeypatch, error):
    """Memory taken by another process between the estimate and the build: torch's allocator error
    became a traceback; now a GptspeedError with the size. Other errors pass through unchanged."""
    import torch

    import gptspeed.step as step

    if error == "torch.OutOfMemoryError":
        error = torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    def fail(*a, **k):
        raise error

    monkeypatch.setattr(step, "GPT", fail)
    with pytest.raises(GptspeedError, match=r"out of memory while building the model \(3,323,648 parameters") as e:
        step.build_model(preset("pico"))
    assert "\n" not in str(e.value)

    def bug(*a, **k):
        raise RuntimeError("a bug, not memory")

    monkeypatch.setattr(step, "GPT", bug)
    with pytest.raises(RuntimeError, match="a bug, not memory"):
        step.build_model(preset("pico"))


# ------------------------------------------------------------------------------- metrics.jsonl
def test_truncate_after_drops_junk_lines_and_never_raises(tmp_path, capsys):
    """A junk line ({"step": "ten"}, a non-JSON line, a JSON list, a line nested 100k deep, a
    record cut short by a crash) made --resume raise in truncate_after. Records up to the step
    are kept in order; everything else goes, and one line says how many."""
    from gptspeed.metrics import RunLog

    path = tmp_path / "metrics.jsonl"
    good = [json.dumps({"step": i, "train_loss": 1.0}) for i in range(6)]
    junk = [
        '{"step": "ten"}',
        "not json at all",
        "[1, 2, 3]",
        '{"step": true}',
        '{"step": 2.0}',
        "[" * 100_000,
        '{"no_step": 1}',
    ]
    path.write_text("\n".join([good[0], *junk[:4], *good[1:4], *junk[4:], "", *good[4:]]) + '\n{"step": 7, "tra')
    log = RunLog(path)
    assert log.truncate_after(3) == len(junk) + 1
    assert path.read_text() == "".join(g + "\n" for g in good[:4])
    assert "dropped 8 line(s) that were not metrics records (the first was line 2)" in capsys.readouterr().out
    assert log.truncate_after(3) == 0 and path.read_text() == "".join(g + "\n" for g in good[:4])  # nothing to do
    log.truncate_after(-1)  # a new run: the log starts afresh
    assert path.read_text() == ""


@pytest.mark.parametrize("kind", ["folder", "fifo", "latin1"])
def test_a_metrics_log_that_is_not_a_utf8_file_is_one_line(tmp_path, kind):
    from gptspeed.metrics import RunLog

    path = tmp_path / "metrics.jsonl"
    if kind == "folder":
        path.mkdir()
    elif kind == "fifo":
        os.mkfifo(path)
    else:
        path.write_bytes(b'{"step": 1, "note": "caf\xe9"}\n')
    with pytest.raises(GptspeedError, match=f"metrics log {path} is ") as e:
        RunLog(path, echo=False).truncate_after(5)
    assert "\n" not in str(e.value)


def test_resume_over_a_junk_metrics_line(shakespeare_data, tmp_path):
    """The tester's case end to end: a run, a junk line in its metrics.jsonl, `--resume`."""
    run = tmp_path / "r"
    assert run_main(*pico_args(shakespeare_data, run, "--save-every", "1")).returncode == 0
    with open(run / "metrics.jsonl", "a") as f:
        f.write('{"step": "ten"}\n')
    proc = run_main("train", "--out", str(run), "--resume", "--max-steps", "3", "--device", "cpu")
    assert proc.returncode == 0, proc.stderr
    assert "dropped 1 line(s)" in proc.stdout
    assert [r["step"] for r in records(run)] == [0, 1, 2, 3]


def test_a_failed_metrics_append_is_one_line_and_leaves_no_half_record(tmp_path, monkeypatch):
    """Disk full on a metrics append was a raw OSError traceback; a partly written line would be
    left looking like a record cut short. Now the file is cut back and the error is one line."""
    from gptspeed import metrics
    from gptspeed.metrics import RunLog

    with pytest.raises(
        GptspeedError,
        match="cannot append to the metrics log /dev/full at step 3: No space left "
        "on device; the newest checkpoint is intact: free some space, then "
        "continue with --resume",
    ):
        RunLog(Path("/dev/full"), echo=False).write({"step": 3})
    path = tmp_path / "metrics.jsonl"
    log = RunLog(path, echo=False)
    log.write({"step": 1, "train_loss": 2.0})
    before = path.read_bytes()
    real_write = os.write

    def half_then_full(fd, data):
        if len(data) > 8:
            return real_write(fd, data[: len(data) // 2])
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(metrics.os, "write", half_then_full)
    with pytest.raises(GptspeedError, match="at step 2: No space left on device"):
        log.write({"step": 2, "train_loss": 1.5})
    assert path.read_bytes() == before


def test_metrics_lines_are_strict_json(tmp_path):
    """A NaN loss (a step skipped by --on-nan skip) was written as NaN: not JSON for any reader but
    Python's. It is null now; the console line still shows nan."""
    from gptspeed.fileio import parse_json
    from gptspeed.metrics import RunLog

    path = tmp_path / "metrics.jsonl"
    RunLog(path, echo=False).write({"step": 1, "train_loss": float("nan"), "grad_norm": float("inf"), "lr": 1e-3})
    assert parse_json(path.read_text(), "line") == {"step": 1, "train_loss": None, "grad_norm": None, "lr": 1e-3}


# ---------------------------------------------------------------------------------- the clock
def test_durations_survive_a_wall_clock_jump(shakespeare_data, tmp_path, monkeypatch):
    """time_s and the end line's duration came from time.time(): a clock set back by ten years
    mid-run made time_s negative and the end line say "40 steps in 87600h00m". The wall clock
    here jumps back ten years after its first reading; durations come from a monotonic clock."""
    real = time.time
    calls = []

    def jumping():
        calls.append(1)
        return real() - (10 * 365 * 86400 if len(calls) > 1 else 0)

    monkeypatch.setattr(time, "time", jumping)
    proc = run_main(*pico_args(shakespeare_data, tmp_path / "r", "--max-steps", "3"))
    assert proc.returncode == 0, proc.stderr
    times = [r["time_s"] for r in records(tmp_path / "r") if "time_s" in r]
    assert times and all(0 <= t < 600 for t in times) and times == sorted(times)
    done = [line for line in proc.stdout.splitlines() if line.startswith("done:")]
    assert done and "h" not in done[0].split(" in ")[1].split(";")[0]


def test_the_batch_size_probe_takes_the_size_check_as_does_not_fit(monkeypatch):
    """--batch-size auto probes micro-batches until one runs out of memory: the size check's verdict on
    a micro-batch is the probe's "does not fit" (torch.cuda.OutOfMemoryError), not the end of the run;
    a model that cannot train even at micro-batch 1 is said in one line before any probe. (The probe
    needs CUDA; its fits() is replaced here to run the adapter on the CPU.)"""
    import torch

    import gptspeed.batchsize as batchsize
    import gptspeed.step as step
    from gptspeed.runtime import resolve_runtime

    rt = resolve_runtime("cpu", "float32", False)
    cfg = build_train_config("pico", {"batch_size": 8})
    monkeypatch.setattr(step, "host_memory_available", lambda: 64 << 20)  # the pico model's state fits in 64 MiB
    seen = {}

    def probe(device, settings, sequences, make_step, **kw):
        make_step(1)()  # micro-batch 1 fits and steps
        with pytest.raises(torch.cuda.OutOfMemoryError, match="for activations at --batch-size 65536"):
            make_step(65536)  # 2 x 65536 x 64 x 64 x 2 bytes of activations: 1 GiB
        seen["probed"] = True
        return 1

    monkeypatch.setattr(batchsize, "resolve_auto_batch", probe)
    assert step.auto_batch_size(cfg, rt) == 1 and seen["probed"]
    cfg.model.n_layer = 100  # its fp32 weights fit in the 64 MiB, not with gradients and AdamW state
    with pytest.raises(step.ModelTooLarge, match="needs at least"):
        step.auto_batch_size(cfg, rt)

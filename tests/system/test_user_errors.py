"""Bad input at the command line: each a one-line error on stderr, a non-zero exit, no traceback, nothing half-written."""

from __future__ import annotations

import json
import os
import shutil
import time

import pytest

from gptspeed.checkpoint import list_checkpoints
from gptspeed.configure import build_train_config
from gptspeed.errors import GptspeedError
from gptspeed.trainer import fit

from support.cli import assert_user_error, run_cli, run_main, run_python
from support.runs import train_args
from support.shapes import TEXT_RUN_FLAGS
from support.training import records

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture
def data_copy(shakespeare_data, tmp_path):
    dst = tmp_path / "data"
    shutil.copytree(shakespeare_data, dst)
    return dst


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


def test_empty_corpus(tmp_path):
    (tmp_path / "empty.txt").write_text("")
    out = tmp_path / "d"
    assert_user_error(run_main("prepare", str(tmp_path / "empty.txt"), "--out", str(out)), "no text")
    assert not out.exists()  # a failed prepare leaves no new, empty folder


def test_whitespace_only_corpus_and_tiny_shards_are_refused(tmp_path):
    (tmp_path / "blank.txt").write_text("   \n\n\t \n")
    (tmp_path / "a.txt").write_text("some text " * 50)
    out = tmp_path / "d"
    assert_user_error(run_main("prepare", str(tmp_path / "blank.txt"), "--out", str(out)), "no text", "only whitespace")
    assert not out.exists()
    assert_user_error(
        run_main("prepare", str(tmp_path / "a.txt"), "--out", str(out), "--shard-tokens", "10"),
        "--shard-tokens must be an integer of at least 256",
    )


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--beta1", "1.5"], "--beta1 must be in [0, 1)"),
        (["--beta2", "-0.5"], "--beta2 must be in [0, 1)"),
        (["--eps", "-1"], "--eps must be a positive finite number"),
        (["--lr", "inf"], "--lr must be a positive finite number"),
        (["--dist-timeout-s", "-1"], "--dist-timeout-s must be a positive number"),
        (["--loader-workers", "-7"], "--loader-workers must be -1 (auto), 0 or more"),
        (["--peak-tflops", "-5"], "--peak-tflops must be positive"),
        # seeds out of every consumer's range (torch.manual_seed overflowed; numpy refused -1)
        (["--seed", "99999999999999999999999"], "--seed must be an integer from 0 to 9,223,372,036,854,775,807"),
        (["--seed", "-1", "--sampling", "random"], "--seed must be an integer from 0 to"),
        # counts and sizes with no upper bound: hung, or reached a tensor / timer out of range
        (["--loader-workers", "100000"], "--loader-workers must be at most 64 (each keeps 4 batches ready"),
        (["--total-batch-tokens", str(2**40)], "more than 65,536: lower --total-batch-tokens or raise --batch-size"),
        (["--max-steps", str(10**30)], "--max-steps must be at most 9,007,199,254,740,992 (2**53)"),
        (["--eval-tokens", str(2**60)], "--eval-tokens must be at most"),
        (["--log-every", str(10**20)], "--log-every must be at most"),
        (["--keep-checkpoints", str(10**20)], "--keep-checkpoints must be at most"),
        (["--batch-size", str(10**20)], "--batch-size must be at most"),
        (["--n-layer", str(10**20)], "--n-layer must be at most"),
        (["--seq-len", str(10**20)], "--seq-len must be at most"),
        (["--dist-timeout-s", "1e300"], "--dist-timeout-s must be at most 2,592,000 (30 days)"),
        (["--optimizer", "muon", "--muon-lr", "inf"], "--muon-lr must be a finite number"),
        (["--muon-lr", "nan"], "--muon-lr must be a finite number"),  # every float, in use (muon) or not (adamw)
        (["--batch-warmup-steps", "-1"], "--batch-warmup-steps must be"),
        (["--batch-start-tokens", "0"], "--batch-start-tokens must be positive"),
        (["--seq-len-warmup-steps", "-3"], "--seq-len-warmup-steps must be"),
        (["--seq-len-start", "0"], "--seq-len-start must be"),
    ],
)
def test_nonsense_settings_are_one_line(tmp_path, flags, message):
    """Each was accepted, or failed later with a traceback from AdamW, or (--lr inf) as "diverged" at step 2;
    the bounds (seed, loader workers, counts) hung, overflowed or raised in numpy / torch."""
    proc = run_main(*train_args(tmp_path / "nodata", tmp_path / "r", *flags))
    assert_user_error(proc, message)
    assert not (tmp_path / "r").exists()


@pytest.mark.parametrize(
    "data, flags, message",
    [
        ("nodata", ["--seq-len-start", "32"], "--seq-len-start 32 does nothing without --seq-len-warmup-steps"),
        ("jsonl:docs.jsonl", ["--sampling", "random"], "--sampling random acts only with --data a prepared folder"),
        ("nodata", ["--decay-ratio", "0.3"], "--decay-ratio 0.3 acts only with --lr-schedule wsd"),
    ],
)
def test_a_setting_that_would_do_nothing_is_one_line_before_the_first_step(tmp_path, data, flags, message):
    """Accepted, then did nothing (issue 56): a warm-up's start without its steps, random sampling of a stream,
    the WSD cooldown's share under the cosine schedule. Refused in one line, nothing written."""
    proc = run_main(
        *train_args(data if data == "nodata" else f"jsonl:{tmp_path / 'docs.jsonl'}", tmp_path / "r", *flags)
    )
    assert_user_error(proc, message, "or drop")
    assert not (tmp_path / "r").exists()


def test_sample_temperature_nan_and_eval_negative_tokens(tmp_path):
    assert_user_error(run_main("sample", "--run", str(tmp_path), "--temperature", "nan"), "--temperature finite")
    assert_user_error(
        run_main("eval", "--run", str(tmp_path), "--data", str(tmp_path), "--max-tokens", "-5"),
        "--max-tokens must be 0 (all) or more",
    )


@pytest.mark.parametrize(
    "args",
    [
        ["sample", "--run", "RUN", "--seed"],
        ["prepare", "tinyshakespeare", "--out", "RUN/d", "--shuffle-seed"],
        ["bench", "ladder", "--out", "RUN/b", "--synthetic", "--seed"],
    ],
)
def test_every_seed_flag_shares_the_seed_bound(tmp_path, args):
    """`sample --seed` past 64 bits overflowed in torch.Generator.manual_seed; `prepare --shuffle-seed
    -1` and `bench --seed -1` raised in numpy (a traceback; the bench after starting its stage).
    Every seed flag takes the training seed's range (config.parse_seed), refused before any work."""
    args = [a.replace("RUN", str(tmp_path)) for a in args]
    for seed in ("99999999999999999999999", "-1"):
        assert_user_error(run_main(*args, seed), "must be an integer from 0 to 9,223,372,036,854,775,807")
    assert list(tmp_path.iterdir()) == []


def test_negative_workers(tmp_path):
    (tmp_path / "a.txt").write_text("some text")
    out = tmp_path / "d"
    assert_user_error(run_main("prepare", str(tmp_path / "a.txt"), "--out", str(out), "--workers", "-1"), "workers")
    assert not out.exists()


def test_corpus_shorter_than_one_sequence(tmp_path):
    src = tmp_path / "short.txt"
    src.write_text("To be, or not to be, that is the question. " * 3)
    data = tmp_path / "d"
    assert run_main("prepare", str(src), "--out", str(data), "--no-progress").returncode == 0
    out = tmp_path / "run"
    assert_user_error(run_main(*train_args(data, out)), "fewer than one micro-batch")
    assert not out.exists()  # nothing written before the check


def test_shard_with_wrong_magic(data_copy, tmp_path):
    shard = data_copy / "train_000000.bin"
    raw = bytearray(shard.read_bytes())
    raw[0:4] = (12345).to_bytes(4, "little")
    shard.write_bytes(bytes(raw))
    out = tmp_path / "run"
    assert_user_error(run_main(*train_args(data_copy, out)), "train_000000.bin", "magic")
    assert not out.exists()


def test_truncated_shard(data_copy, tmp_path):
    shard = data_copy / "val_000000.bin"
    shard.write_bytes(shard.read_bytes()[:5000])
    out = tmp_path / "run"
    assert_user_error(run_main(*train_args(data_copy, out)), "val_000000.bin", "truncated")
    assert not out.exists()


def test_unknown_preset(shakespeare_data, tmp_path):
    proc = run_main("train", "--preset", "gpt5", "--data", str(shakespeare_data), "--out", str(tmp_path / "r"))
    assert_user_error(proc, "gpt5")


def test_n_embd_not_divisible_by_n_head(shakespeare_data, tmp_path):
    out = tmp_path / "run"
    assert_user_error(run_main(*train_args(shakespeare_data, out, "--n-embd", "30", "--n-head", "4")), "divisible")
    assert not out.exists()


def test_float16_on_cpu(shakespeare_data, tmp_path):
    out = tmp_path / "run"
    assert_user_error(run_main(*train_args(shakespeare_data, out, "--dtype", "float16")), "float16")
    assert not out.exists()


def test_missing_data_folder(tmp_path):
    out = tmp_path / "run"
    assert_user_error(run_main(*train_args(tmp_path / "nope", out)), "nope", "gptspeed prepare")
    assert not out.exists()


def test_indivisible_total_batch(shakespeare_data, tmp_path):
    out = tmp_path / "run"
    assert_user_error(run_main(*train_args(shakespeare_data, out, "--total-batch-tokens", "1000")), "multiple")


def test_sample_without_checkpoint(tmp_path):
    assert_user_error(run_main("sample", "--run", str(tmp_path / "none")), "does not exist")


def test_train_out_on_a_folder_of_only_the_users_metrics_log_is_refused_untouched(shakespeare_data, tmp_path):
    """A folder holding only the user's metrics.jsonl (records with an integer step) was taken for a run
    and the log written over by `train --out`; `--out nothere/../victim` wrote into victim, a folder of the
    user's files: one line naming the file each, nothing written."""
    logs = tmp_path / "logs"
    logs.mkdir()
    (logs / "metrics.jsonl").write_text('{"step": 1, "acc": 0.5}\n')
    for out in (logs, tmp_path / "nothere" / ".." / "logs"):
        proc = run_main(
            "train", *TEXT_RUN_FLAGS, "--data", str(shakespeare_data), "--out", str(out), "--max-steps", "1"
        )
        assert_user_error(proc, f"--out {logs} already holds files gptspeed did not write (metrics.jsonl)")
    assert os.listdir(logs) == ["metrics.jsonl"] and (logs / "metrics.jsonl").read_text() == '{"step": 1, "acc": 0.5}\n'
    assert not (tmp_path / "nothere").exists()


def test_corrupt_checkpoint_on_sample(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    (run / "ckpt_00000005.pt").write_bytes(b"not a checkpoint")
    assert_user_error(run_main("sample", "--run", str(run)), "ckpt_00000005.pt")


# ------------------------------------------------------------------ hints that name what a path is
def test_train_on_a_text_file_says_prepare_it_first_without_overwriting_it(tmp_path):
    text = tmp_path / "notes.txt"
    text.write_text("some text")
    proc = run_main("train", "--preset", "pico", "--data", str(text), "--out", str(tmp_path / "run"))
    assert_user_error(proc, "is a text file", f"gptspeed prepare {text} --out DATA_DIR")
    assert f"--out {text}" not in proc.stderr and text.read_text() == "some text"


def test_eval_with_a_run_folder_as_data_and_sample_with_a_data_folder_as_run(shakespeare_data, tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.json").write_text("{}")
    (run / "metrics.jsonl").write_text("")
    proc = run_main("eval", "--run", str(run), "--data", str(run))
    assert_user_error(proc, "is a run folder", "not a data folder")
    assert f"--out {run}" not in proc.stderr
    proc = run_main("sample", "--run", str(shakespeare_data))
    assert_user_error(proc, "is a prepared data folder", "not a run folder")
    assert f"--out {shakespeare_data}`" not in proc.stderr


def test_version_and_defaults_in_help():
    proc = run_main("--version")
    assert proc.returncode == 0 and proc.stdout.startswith("gptspeed ")
    sample = run_main("sample", "--help").stdout
    for flag, default in (("--max-new-tokens", "200"), ("--temperature", "0.8"), ("--top-k", "200")):
        block = sample.split(flag, 2)[-1].split("\n  --", 1)[0]
        assert f"(default: {default})" in block, (flag, block)
    assert "(default: loss.png)" in run_main("plot", "--help").stdout
    assert "(default: 19073)" in run_main("train", "--help").stdout  # --max-steps, the gpt2 preset's


def test_help_and_user_errors_answer_without_importing_torch(tmp_path):
    """`gptspeed <cmd> --help` and a configuration or data error never wait for torch's import."""
    from support.cli import run_python

    cases = [
        ["train", "--help"],
        ["sample", "--help"],
        ["eval", "--help"],
        ["train", "--preset", "pico", "--data", str(tmp_path / "none"), "--out", str(tmp_path / "r")],
        ["train", "--preset", "pico", "--n-embd", "30", "--data", "x", "--out", "y"],
        ["eval", "--run", "r"],
    ]
    for argv in cases:
        code = (
            f"import sys\nfrom gptspeed.cli import main\ntry:\n    rc = main({argv!r})\nexcept SystemExit as e:\n"
            "    rc = e.code\nprint('torch' in sys.modules, file=sys.stderr)"
        )
        proc = run_python(code)
        assert proc.stderr.strip().splitlines()[-1] == "False", (argv, proc.stderr)


def test_every_options_help_names_its_real_default_once_and_never_none():
    """``--help`` of every command: an option's shown default is the one it has (argparse's own, or the
    setting's declared default for train's flags), never ``None``, ``False``/``True`` for a switch, or
    an empty string, and the formatter never adds a second default to a help that names one."""
    import argparse
    import dataclasses
    import re

    from gptspeed.cli import SUBCOMMANDS, build_parser
    from gptspeed.config import GROUPS, setting_flag

    declared = {
        setting_flag(f.name): f.default
        for group, cls in GROUPS.items()
        if group != "model"
        for f in dataclasses.fields(cls)
    }
    parser = build_parser()
    subparsers = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    assert set(subparsers.choices) == set(SUBCOMMANDS)
    nested = {  # bench's subcommands too
        f"{name} {mode}": parser
        for name, sub in subparsers.choices.items()
        for a in sub._actions
        if isinstance(a, argparse._SubParsersAction)
        for mode, parser in a.choices.items()
    }
    assert {"bench ladder", "bench race", "bench tune"} <= set(nested)
    for name, sub in {**subparsers.choices, **nested}.items():
        fmt = sub.formatter_class(name)  # what --help uses
        for action in sub._actions:
            if not action.option_strings or action.help in (None, argparse.SUPPRESS):
                continue
            text = fmt._get_help_string(action) % {**vars(action), "prog": name}
            where = f"gptspeed {name} {action.option_strings[-1]}: {text}"
            assert not re.search(r"\(default: (None|False|True|)\)", text), where
            own = action.help % {**vars(action), "prog": name}
            if text != own:  # the formatter added the default: argparse's own value, once
                assert text == f"{own} (default: {action.default})" and "default" not in own, where
            shown = re.findall(r"\(default: ([^)]*)\)$", own)
            flag = action.option_strings[0]
            if shown and action.default is argparse.SUPPRESS and declared.get(flag) is not None:
                assert shown == [str(declared[flag])], where  # a train flag: the setting's declared default


def test_the_recipe_help_names_exactly_what_each_recipe_sets():
    """``--recipe``'s help is written from the recipes themselves: the flags it names for a recipe,
    given to ``gptspeed train``, make the same run as ``--recipe NAME`` (it once promised an untied
    head, zero-init and a soft-cap that ``modern`` does not set)."""
    from gptspeed.config import RECIPES
    from gptspeed.configure import config_from_flags, recipe_help

    text = recipe_help()
    for name in RECIPES:
        part = text.split(f"{name} (", 1)[1].split(")", 1)[0]
        flags = [] if part == "as the presets" else part.split()
        named = config_from_flags(["--preset", "pico", *flags], "test").to_dict()
        assert named == config_from_flags(["--preset", "pico", "--recipe", name], "test").to_dict(), (name, part)
    assert "untied" not in text


def test_config_errors_on_the_command_line(tmp_path):
    """The same errors from `gptspeed train`: one line, no traceback, exit 2."""
    path = tmp_path / "run.yaml"
    path.write_text("train:\n  max_step: 10\n")
    proc = run_cli("train", "--config", str(path), "--data", "x", "--out", str(tmp_path / "r"))
    assert_user_error(
        proc, "gptspeed train: error: config file", "unknown setting 'max_step'", "did you mean 'max_steps'"
    )
    assert proc.returncode == 2
    assert_user_error(
        run_cli("train", "--preset", "pico", "--log-to", "tensorboard,wandbb", "--print-config"),
        "unknown tracker 'wandbb'",
        "did you mean 'wandb'",
    )


def test_print_config_and_help_import_no_torch():
    """`train --print-config` and `train --help` answer without importing torch (config.py is
    torch-free; YAML comes from PyYAML)."""
    code = (
        "import sys, contextlib, io; from gptspeed.cli import main\n"
        "with contextlib.redirect_stdout(io.StringIO()):\n"
        "    rc = main(['train', '--preset', 'nano', '--print-config'])\n"
        "    try: main(['train', '--help'])\n"
        "    except SystemExit: pass\n"
        "print(rc, 'torch' in sys.modules, 'yaml' in sys.modules)"
    )
    proc = run_python(code)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["0", "False", "True"]


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


def test_full_or_unwritable_run_folder_reported_before_training(shakespeare_data, tmp_path, monkeypatch):
    afile = tmp_path / "file"
    afile.write_text("x")
    assert_user_error(
        run_cli("train", *TEXT_RUN_FLAGS, "--data", str(shakespeare_data), "--out", str(afile / "run")),
        "cannot write to run folder",
    )
    import shutil as sh

    monkeypatch.setattr(sh, "disk_usage", lambda p: sh._ntuple_diskusage(100, 100, 1000))
    with pytest.raises(GptspeedError, match="GiB free but a checkpoint needs"):
        fit(
            build_train_config("pico", dict(data=str(shakespeare_data), out=str(tmp_path / "r"), device="cpu")),
            echo=False,
        )
    assert not list_checkpoints(tmp_path / "r")


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


def test_native_windows_is_one_line_naming_wsl2_from_the_command_and_the_library(monkeypatch):
    import sys

    import gptspeed

    monkeypatch.setattr(sys, "platform", "win32")
    proc = run_main("train", "--preset", "nano", "--out", "r")
    assert_user_error(proc, "does not run on native Windows", "WSL2")
    with pytest.raises(ImportError, match="run it in WSL2"):
        gptspeed.make_config  # noqa: B018 -- the lazy API's first use


def test_aligning_a_stream_to_its_documents_is_one_line(tmp_path):
    """--align-to-docs reads a prepared folder's document starts; a jsonl stream is refused before any step, and
    the run folder it would have made is left behind by nothing."""
    src = tmp_path / "docs.jsonl"
    src.write_text("".join(json.dumps({"text": f"document {i} " * 50}) + "\n" for i in range(20)))
    proc = run_main(*train_args(f"jsonl:{src}", tmp_path / "r", "--align-to-docs"))
    assert_user_error(proc, "--align-to-docs aligns a prepared folder's rows to its documents; a stream")
    assert not (tmp_path / "r").exists()

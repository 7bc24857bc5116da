"""Config files: YAML as well as JSON, --print-config, and one-line errors naming the nearest key."""

from __future__ import annotations

import json

import pytest
from conftest import assert_user_error, records, run_cli, run_python

from gptspeed.cli import main
from gptspeed.config import AUTO_BATCH_SIZE, config_to_yaml, preset, read_config_file
from gptspeed.configure import build_train_config
from gptspeed.errors import GptspeedError

pytestmark = pytest.mark.usefixtures("one_thread")

FLAGS = [
    "--preset",
    "pico",
    "--n-layer",
    "1",
    "--n-embd",
    "32",
    "--seq-len",
    "32",
    "--batch-size",
    "4",
    "--max-steps",
    "3",
    "--log-every",
    "1",
    "--eval-every",
    "2",
    "--eval-tokens",
    "512",
    "--lr",
    "3e-3",
    "--device",
    "cpu",
]


def test_printed_yaml_config_reproduces_the_run(shakespeare_data, tmp_path, capsys):
    """`train FLAGS --print-config` prints YAML and trains nothing; `train --config that.yaml`
    (with only --out changed) trains the same run: the same configuration and, on the CPU,
    bit-identical losses."""
    a, b = tmp_path / "a", tmp_path / "b"
    flags = [*FLAGS, "--data", str(shakespeare_data)]
    assert main(["train", *flags, "--out", str(a), "--print-config"]) == 0
    text = capsys.readouterr().out
    assert not a.exists()  # printing trains nothing
    (tmp_path / "run.yaml").write_text(text)
    assert "\npreset: pico\n" in text and "\n  n_embd: 32\n" in text and "\n  lr: 0.003\n" in text
    assert main(["train", *flags, "--out", str(a)]) == 0
    assert main(["train", "--config", str(tmp_path / "run.yaml"), "--out", str(b)]) == 0
    conf_a, conf_b = (json.loads((d / "config.json").read_text()) for d in (a, b))
    conf_b["train"]["out"] = conf_a["train"]["out"]
    for group in ("preset", "model", "optim", "train", "runtime"):
        assert conf_b[group] == conf_a[group], group
    ra, rb = records(a), records(b)
    assert [r["step"] for r in ra] == [0, 1, 2, 3]
    assert [(r["step"], r.get("train_loss"), r.get("val_loss")) for r in rb] == [
        (r["step"], r.get("train_loss"), r.get("val_loss")) for r in ra
    ]


def test_yaml_values_are_typed_like_json(tmp_path):
    """YAML 1.2 floats (1e-3, which PyYAML alone reads as a string), null, booleans, `auto` for
    the batch size, nested groups or flat keys; the file's preset is the base unless --preset is
    given; flags win over the file."""
    path = tmp_path / "run.yml"
    path.write_text(
        "preset: nano\nlr: 1e-3\noptim:\n  warmup_ratio: .05\n  fused_adamw: no\n"
        "train:\n  batch_size: auto\n  total_batch_tokens: 4096\nruntime:\n  compile: null\n"
    )
    cfg = build_train_config(None, {"max_steps": 7}, str(path))
    assert cfg.preset == "nano" and cfg.model.n_layer == 4  # nano's shape
    assert cfg.optim.lr == 1e-3 and isinstance(cfg.optim.lr, float) and cfg.optim.warmup_ratio == 0.05
    assert cfg.optim.fused_adamw is False and cfg.runtime.compile is None
    assert cfg.train.batch_size == AUTO_BATCH_SIZE and cfg.train.max_steps == 7
    assert build_train_config("pico", {}, str(path)).model.n_layer == 2  # --preset wins over the file's
    # --print-config's YAML reads back to the same configuration, `auto` included
    printed = tmp_path / "printed.yaml"
    printed.write_text(config_to_yaml(cfg))
    assert "batch_size: auto" in printed.read_text()
    assert build_train_config(None, {}, str(printed)) == cfg


@pytest.mark.parametrize(
    "text, fragments",
    [
        ("model:\n  n_layr: 3\n", ["unknown setting 'n_layr'", "did you mean 'n_layer'"]),
        ("seq_len: 32\n", ["unknown setting 'seq_len'", "did you mean 'block_size'"]),  # the flag's name
        ("modle:\n  n_layer: 3\n", ["unknown setting 'modle'"]),
        ("lr: fast\n", ["lr must be float, got 'fast'"]),
        ("optimizer: adam\n", ["optimizer must be one of adamw, muon"]),
        ("model: 4\n", ["'model' must be a mapping of settings"]),
        ("lr: 1\nmodel: {n_layer: 3\n", ["is not valid YAML", "(line 3, column 1)"]),
        ("- lr: 1\n", ["expected a YAML mapping of settings, got list"]),
        ("preset: nanno\n", ["unknown preset 'nanno'", "did you mean 'nano'"]),
        ("log_to: tensorbord\n", ["--log-to: unknown tracker 'tensorbord'", "did you mean 'tensorboard'"]),
    ],
)
def test_bad_yaml_is_one_line(tmp_path, text, fragments):
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    with pytest.raises(GptspeedError) as err:
        build_train_config(None, {}, str(path)).validate()
    message = str(err.value)
    assert "\n" not in message
    for f in fragments:
        assert f in message, message


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


def test_json_config_files_still_read_as_json(tmp_path):
    path = tmp_path / "c.json"
    path.write_text(json.dumps({"model": {"n_layer": 3}, "lr": 0.01}))
    assert read_config_file(path) == {"model": {"n_layer": 3}, "lr": 0.01}
    assert preset("pico").apply_file(str(path)).model.n_layer == 3
    path.write_text("n_layer: 3\n")  # YAML in a .json file is a JSON error, said so
    with pytest.raises(GptspeedError, match="is not valid JSON"):
        read_config_file(path)


def test_a_configuration_is_validated_where_it_is_built_for_the_launched_world(monkeypatch):
    """build_train_config validates once, for the processes torchrun's environment names: a global
    batch that 3 processes cannot share is refused there, before any training code runs."""
    flags = {"total_batch_tokens": 2 * 8 * 64, "batch_size": 8, "data": "d", "out": "o"}
    assert build_train_config("pico", flags).grad_accum_steps(1) == 2
    monkeypatch.setenv("WORLD_SIZE", "3")
    monkeypatch.setenv("RANK", "2")
    with pytest.raises(GptspeedError, match="not a multiple of batch_size"):
        build_train_config("pico", flags)
    with pytest.raises(GptspeedError, match="--max-steps must be at least 1"):
        build_train_config("pico", {"max_steps": 0})

"""``gptspeed.configio``: reading a ``--config`` file (YAML or JSON) -- each key once, merge keys read, a
FIFO or a device refused in one line without blocking."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest

from gptspeed.config import preset
from gptspeed.configio import read_config_file
from gptspeed.errors import GptspeedError

from support.cli import assert_user_error, run_cli, run_main


def test_json_config_files_still_read_as_json(tmp_path):
    path = tmp_path / "c.json"
    path.write_text(json.dumps({"model": {"n_layer": 3}, "lr": 0.01}))
    assert read_config_file(path) == {"model": {"n_layer": 3}, "lr": 0.01}
    assert preset("pico").apply_file(str(path)).model.n_layer == 3
    path.write_text("n_layer: 3\n")  # YAML in a .json file is a JSON error, said so
    with pytest.raises(GptspeedError, match="is not valid JSON"):
        read_config_file(path)


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


@pytest.mark.parametrize(
    "name,text,key",
    [
        ("flat.yaml", "n_layer: 2\nlr: 1e-3\nn_layer: 3\n", "'n_layer' is given twice (line 3)"),
        ("groups.yaml", "model:\n  n_layer: 2\nmodel:\n  n_head: 2\n", "'model' is given twice (line 3)"),
        ("nested.yaml", "optim:\n  lr: 1e-3\n  lr: 2e-3\n", "'lr' is given twice (line 3)"),
        ("flat.json", '{"n_layer": 2, "n_layer": 3}', "'n_layer' is given twice"),
        ("nested.json", '{"model": {"n_layer": 2}, "optim": {"lr": 1, "lr": 2}}', "'lr' is given twice"),
    ],
)
def test_a_config_file_naming_a_key_twice_is_one_line_naming_it(tmp_path, name, text, key):
    """PyYAML and json keep the last of two equal keys: `n_layer: 2 ... n_layer: 3` trained 3
    layers without a word (and a second `model:` group dropped the first whole)."""
    path = tmp_path / name
    path.write_text(text)
    with pytest.raises(GptspeedError, match=re.escape(f"config file {path}: {key}: keep one")):
        read_config_file(path)
    assert_user_error(run_main("train", "--preset", "pico", "--config", str(path), "--print-config"), key)


def test_yaml_merge_keys_and_distinct_keys_still_read(tmp_path):
    path = tmp_path / "ok.yaml"
    path.write_text("base: &b\n  n_layer: 2\nmodel:\n  <<: *b\n  n_layer: 3\n  n_head: 2\n")
    assert read_config_file(path)["model"] == {"n_layer": 3, "n_head": 2}  # an explicit key overrides a merged one

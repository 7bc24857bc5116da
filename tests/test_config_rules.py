"""Configuration rules that were missing: a config file naming a key twice, RoPE on an odd head
dimension. Each is one line before any work."""

import re

import pytest
from conftest import assert_user_error, run_main

from gptspeed.config import PRESETS, preset, read_config_file
from gptspeed.configure import build_train_config
from gptspeed.errors import GptspeedError


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


@pytest.mark.parametrize("n_embd,n_head", [(6, 2), (4, 4)])
def test_rope_on_an_odd_head_dimension_is_one_line(tmp_path, n_embd, n_head):
    """Head dimension 3 trained silently with queries and keys grown to 4 channels (the rotation
    broadcast its odd half); 1 was a ValueError traceback from the first forward."""
    head = n_embd // n_head
    with pytest.raises(GptspeedError, match=f"n_embd / n_head = {n_embd} / {n_head} = {head} must be even"):
        build_train_config("pico", dict(pos_emb="rope", n_embd=n_embd, n_head=n_head, out=str(tmp_path / "r")))
    res = run_main(
        "train",
        "--preset",
        "pico",
        "--pos-emb",
        "rope",
        "--n-embd",
        str(n_embd),
        "--n-head",
        str(n_head),
        "--out",
        str(tmp_path / "r"),
    )
    assert_user_error(res, "--pos-emb rope rotates pairs of channels")
    for name in PRESETS:  # every preset's shape takes rope
        cfg = preset(name)
        cfg.model.pos_emb = "rope"
        cfg.model.validate()

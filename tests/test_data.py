"""``gptspeed.data``: token data: the shard format (:mod:`.shards`), corpus preparation (:mod:`.prepare`), and finding the shards of a prepared folder."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest

from gptspeed.data import find_shards, load_manifest, write_shard
from gptspeed.data.prepare import prepare
from gptspeed.errors import GptspeedError

from support.cli import assert_user_error, run_main
from support.records import DOCS, lines_of

pytestmark = pytest.mark.usefixtures("no_network")


# --------------------------------------------------------------- 3, 4, 5: finding the shards
def test_shards_without_a_manifest_are_found_by_their_exact_split_word(tmp_path):
    """``*val*.bin`` took retrieval_/interval_/eval_ files for val shards."""
    names = [
        "val_000000.bin",
        "fineweb_val_000000.bin",
        "tiny_shakespeare_val.bin",
        "train_000000.bin",
        "fineweb_train_000001.bin",
        "retrieval_train_000000.bin",
        "interval_000000.bin",
        "eval_000000.bin",
        "medieval.bin",
    ]
    for name in names:
        write_shard(tmp_path / name, np.arange(3))
    assert [p.name for p in find_shards(tmp_path, "val")] == [
        "fineweb_val_000000.bin",
        "tiny_shakespeare_val.bin",
        "val_000000.bin",
    ]
    assert [p.name for p in find_shards(tmp_path, "train")] == [
        "fineweb_train_000001.bin",
        "retrieval_train_000000.bin",
        "train_000000.bin",
    ]
    only = tmp_path / "only"
    only.mkdir()
    write_shard(only / "retrieval_000000.bin", np.arange(3))
    with pytest.raises(GptspeedError, match="no val shards"):
        find_shards(only, "val")


@pytest.mark.parametrize("shard", ["ABS", "../other/train_000000.bin", "sub/train_000000.bin", "..", ""])
def test_manifest_shard_paths_stay_inside_the_folder(tmp_path, shakespeare_data, shard):

    other = tmp_path / "other"
    shutil.copytree(shakespeare_data, other)
    data = tmp_path / "data"
    shutil.copytree(shakespeare_data, data)
    (data / "sub").mkdir()
    shutil.copy(other / "train_000000.bin", data / "sub")
    m = json.loads((data / "manifest.json").read_text())
    name = str(other / "train_000000.bin") if shard == "ABS" else shard
    m["splits"]["train"]["shards"] = [name]
    (data / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(GptspeedError, match="not a file name inside"):
        find_shards(data, "train")
    proc = run_main(
        "train",
        "--data",
        str(data),
        "--out",
        str(tmp_path / "run"),
        "--max-steps",
        "1",
        "--preset",
        "pico",
        "--device",
        "cpu",
    )
    assert_user_error(proc, "not a file name inside")


def test_a_manifest_that_is_not_utf8_or_is_a_folder_is_one_line(tmp_path):
    src = tmp_path / "d.jsonl"
    src.write_bytes(lines_of(DOCS))
    out = tmp_path / "out"
    prepare(str(src), out, progress=False)
    manifest = out / "manifest.json"
    manifest.write_bytes(b'{"format": "gptspeed-shards", "x": "\xff\xfe"}')
    with pytest.raises(GptspeedError, match="manifest .*manifest.json is not UTF-8 text"):
        load_manifest(out)
    assert_user_error(run_main("prepare", str(src), "--out", str(out)), "manifest.json is not UTF-8", "--force")
    manifest.unlink()
    manifest.mkdir()
    with pytest.raises(GptspeedError, match="manifest.json is a folder"):
        find_shards(out, "train")
    assert_user_error(run_main("prepare", str(src), "--out", str(out)), "manifest.json is a folder")
    manifest.rmdir()
    manifest.write_text("[" * 100_000)
    with pytest.raises(GptspeedError, match="nested too deeply"):
        load_manifest(out)


def test_find_shards_without_manifest(tmp_path):
    for name in ("fineweb_val_000000.bin", "fineweb_train_000002.bin", "fineweb_train_000001.bin"):
        write_shard(tmp_path / name, np.arange(3))
    assert load_manifest(tmp_path) is None
    assert [p.name for p in find_shards(tmp_path, "train")] == ["fineweb_train_000001.bin", "fineweb_train_000002.bin"]
    assert [p.name for p in find_shards(tmp_path, "val")] == ["fineweb_val_000000.bin"]


def test_find_shards_errors(tmp_path):
    with pytest.raises(GptspeedError, match="does not exist: run `gptspeed prepare"):
        find_shards(tmp_path / "nope", "train")
    with pytest.raises(GptspeedError, match="no val shards"):
        find_shards(tmp_path, "val")
    (tmp_path / "manifest.json").write_text("{not json")
    with pytest.raises(GptspeedError, match="manifest.json is not valid JSON"):
        find_shards(tmp_path, "train")
